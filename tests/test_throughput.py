"""Throughput and MFU in the summaries, the FLOPs formula against a hand count, the peak table, the bar."""

import json
import statistics

import pytest
import torch
from conftest import FSDP, ZERO3, run_job, summary

from helpers.core import models
from helpers.core.config import ConfigError, TrainOptions, adamw_kwargs, load_job_config
from helpers.core.metrics import WARMUP_STEPS
from helpers.job.backends import optimizer_impl
from helpers.job.observe import progress, throughput


def hand_count(vocab, h, inter, layers, heads, seq, tied=False):
    """Training FLOPs per token of a Llama preset, counted by hand."""
    per_layer = 4 * h * h + 3 * h * inter + 2 * h  # q, k, v, o; gate, up, down; two RMSNorm weights
    n = layers * per_layer + h + vocab * h  # + final norm + lm_head (the embedding table is left out)
    return 6 * n + 12 * layers * heads * (h // heads) * seq


def meta_model(spec):
    with torch.device("meta"):
        return models.build_model(spec, torch.bfloat16, seed=0, device="meta")


def test_flops_per_token_tiny_by_hand():
    model = meta_model(models.resolve_model("tiny"))
    # tiny: vocab 1000, hidden 128, MLP 256, 2 layers, 4 heads; 584,320 params of which 128,000 embedding
    assert hand_count(1000, 128, 256, 2, 4, seq=64) == 6 * 456_320 + 196_608 == 2_934_528
    assert throughput.embedding_params(model) == 128_000
    assert throughput.flops_per_token(model, seq_len=64) == 2_934_528
    assert throughput.flops_per_token(model, seq_len=128) == 2_934_528 + 196_608  # attention grows with T


def test_tied_embedding_counted_once_as_the_output_matmul(tmp_path):
    cfg = dict(models.PRESETS["tiny"], model_type="llama", tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = meta_model(models.resolve_model(str(tmp_path / "config.json")))
    assert throughput.embedding_params(model) == 0  # the one table is the lm_head's weight
    assert throughput.flops_per_token(model, 64) == hand_count(1000, 128, 256, 2, 4, 64)


# Dense bf16 TFLOPS from each vendor datasheet (the sparsity figure halved): A100 312; H100 SXM 989 (989.4),
# PCIe 756, NVL 835 (per GPU); H200 and GH200 989; L4 121; L40S 362 (362.05); A10 125. Unknown GPUs: None.
@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA H100 80GB HBM3", 989),
    ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989), ("NVIDIA GH200 480GB", 989),
    ("NVIDIA L4", 121), ("NVIDIA L40S", 362), ("NVIDIA A10", 125), ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None),
])
def test_gpu_peak_table(name, tflops):
    assert throughput.gpu_peak(name) == (tflops * 1e12 if tflops else None)


@pytest.mark.cpu_only("the peak is measured on a CPU; on a GPU it comes from the table")
def test_mfu_and_tokens_per_s_in_both_backends(tiny_pair):
    flops = hand_count(1000, 128, 256, 2, 4, seq=64)
    for name, out in tiny_pair.items():
        s = summary(out)
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert s["flops_per_token"] == flops, name
        assert s["peak_flops_source"].startswith("measured: 512x512 bf16 matmul, 1 thread(s)"), name
        # one core's bf16 matmul: between 0.1 GFLOP/s and 10 TFLOP/s, whatever the CPU (a unit slip is 1e3 off)
        assert 1e8 < s["peak_flops"] < 1e13, (name, s["peak_flops"])
        assert f"peak {throughput.fmt_flops(s['peak_flops'])} per device (measured" in (out / "log.txt").read_text()
        median = statistics.median(r["step_time_s"] for r in steps[WARMUP_STEPS:])  # warm-up left out
        assert s["step_time_s"] == median
        # from the raw step times, the hand count and one rank's tokens (8 x 64 a step; not the global 16 x 64)
        assert s["tokens_per_s_per_rank"] == pytest.approx(8 * 64 / median)
        assert s["mfu"] == pytest.approx(flops * 8 * 64 / median / s["peak_flops"], rel=1e-9)
        elapsed = [r["elapsed_s"] for r in steps]
        assert elapsed == sorted(elapsed) and all(r["tokens_per_s"] > 0 for r in steps)
        log = (out / "log.txt").read_text()
        assert "\r" not in log and "it/s" not in log and "step/s" not in log  # no progress bar in the log
        assert f"MFU {s['mfu']:.2f}" in log.splitlines()[-1]


@pytest.mark.parametrize("value", ["-3", "0", "abc", "inf"])
def test_bad_peak_tflops_is_refused(tmp_path, value):
    out = tmp_path / "run"
    proc = run_job(FSDP, out, 0, "--peak-tflops", value, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: argument --peak-tflops: --peak-tflops = '{value}': must be a number of TFLOPS > 0, the device's "
        "dense peak in the compute dtype (e.g. 312 for an A100 in bf16) (see python -m helpers.train --help)"]
    assert not out.exists()


def test_progress_lines_when_captured(monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)
    bar = progress.Progress(3, active=True)
    for i in range(3):
        bar.update(2.5 - i, 1234.0)
    bar.close()
    quiet = progress.Progress(3, active=False)  # not rank 0
    quiet.update(1.0, 1.0)
    quiet.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 4, err  # one plain line per redraw (0/3 first: no delay), no duplicate
    assert lines[-1].startswith("train: 100%") and "3/3" in lines[-1]
    assert "loss 0.5000, 1,234 tok/s/rank" in lines[-1]


@pytest.mark.parametrize("config", [FSDP, ZERO3])
def test_optimizer_impl_fused_reaches_both_backends(tmp_path, config):
    """--optimizer-impl fused steps torch's fused AdamW (CPU kernels exist in torch 2.13) on FSDP's DTensors and
    on ZeRO's flat partitions; the summary reads it back from the optimizer, the log says parity is off."""
    out = tmp_path / "run"
    proc = run_job(config, out, 0, "--model", "tiny", "--steps", "2", "--optimizer-impl", "fused", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(out)
    assert s["optimizer_impl"] == "fused" and s["status"] == "completed"
    assert "note: --optimizer-impl fused: AdamW steps with fused=True" in (out / "log.txt").read_text()


def test_optimizer_impl_kwargs_and_refusal():
    t = TrainOptions()
    assert adamw_kwargs(t) == dict(lr=t.lr, weight_decay=t.weight_decay, foreach=False, fused=False)
    t.optimizer_impl = "foreach"
    assert adamw_kwargs(t)["foreach"] is True and adamw_kwargs(t)["fused"] is False
    assert optimizer_impl(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], **adamw_kwargs(t))) == "foreach"
    job = load_job_config(FSDP, {"optimizer_impl": "for-loop"})
    assert not [n for n in job.notes if "--optimizer-impl" in n]  # the parity mode says nothing
    with pytest.raises(ConfigError, match=r"--optimizer-impl = 'fast': allowed values are for-loop, foreach, fused"):
        load_job_config(FSDP, {"optimizer_impl": "fast"})


def test_optimizer_impl_with_a_json_optimizer_is_a_note(tmp_path):
    js = tmp_path / "ds.json"
    js.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 0,
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    cfg = tmp_path / "ds.yaml"
    cfg.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {js}\n")
    job = load_job_config(str(cfg), {"optimizer_impl": "foreach"})
    assert [n for n in job.notes if n.startswith("--optimizer-impl foreach: no effect, the DeepSpeed config's "
                                                  "optimizer section builds the optimizer")]
