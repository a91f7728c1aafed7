"""Real 2-rank jobs: the run-directory contract and FSDP/DeepSpeed parity."""

import json
import re
import statistics
import subprocess
import sys
import textwrap

import pytest
from conftest import FSDP, REPO, job_env, run_job, summary

from helpers.core.metrics import STEP_KEYS, SUMMARY_KEYS, WARMUP_STEPS
from helpers.nb.results import RunError, load_run


def test_fsdp_and_zero3_train_bit_identically(tiny_pair):
    a, b = summary(tiny_pair["fsdp"]), summary(tiny_pair["deepspeed"])
    assert len(a["losses"]) == len(b["losses"]) == 20
    assert a["losses"] == b["losses"]  # exact float equality, every step


def test_loss_goes_down(tiny_pair):
    for out in tiny_pair.values():
        losses = summary(out)["losses"]
        assert losses[-1] < losses[0] - 1.0, losses


def test_run_directory_contract(tiny_pair):
    for backend, out in tiny_pair.items():
        s = summary(out)
        assert s["status"] == "completed" and s["backend"] == backend
        assert set(s) == set(SUMMARY_KEYS)
        assert s["world_size"] == 2 and s["dist_backend"] == "gloo" and s["device"] == "cpu"
        assert 400_000 < s["num_params"] < 800_000
        assert s["versions"]["torch"].startswith("2.13.0")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(20))
        assert all(set(r) == set(STEP_KEYS) for r in rows)
        assert [r["loss"] for r in rows] == s["losses"]
        median = statistics.median(r["step_time_s"] for r in rows[WARMUP_STEPS:])
        assert s["step_time_s"] == median and s["tokens_per_s_per_rank"] == pytest.approx(8 * 64 / median)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["backend"] == backend and cfg["world_size"] == 2
        # rank 0 logs every 2nd step (20 // 10) and the last, each with the loss metrics.jsonl holds
        logged = re.findall(r"^step +(\d+) +loss (\d+\.\d{4}) ", (out / "log.txt").read_text(), re.M)
        assert logged == [(str(r["step"]), f"{r['loss']:.4f}") for r in rows if r["step"] % 2 == 0 or
                          r["step"] == 19], logged
        assert load_run(out).summary == s


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_deepspeed_config_autos_are_filled(tiny_pair):
    ds = json.loads((tiny_pair["deepspeed"] / "config.json").read_text())["deepspeed"]["json"]
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 1
    assert ds["gradient_clipping"] == 0.0 and ds["bf16"]["enabled"] is True


def test_single_process_without_torchrun_and_a_given_peak(tmp_path):
    out = tmp_path / "one"
    proc = run_job(FSDP, out, 0, "--model", "tiny", "--steps", "3", "--peak-tflops", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(out)
    assert s["world_size"] == 1 and s["steps"] == 3 and s["status"] == "completed"
    # --peak-tflops replaces the CPU measurement: the peak, its source and the MFU follow it
    assert s["peak_flops"] == 0.5e12 and s["peak_flops_source"] == "--peak-tflops 0.5"
    assert "peak 500 GFLOP/s per device (--peak-tflops 0.5)" in (out / "log.txt").read_text()
    median = statistics.median(r["step_time_s"] for r in _rows(out)[WARMUP_STEPS:])
    # 2,934,528 FLOPs per token (tiny at seq 64, counted by hand in test_throughput), 8 x 64 tokens per step
    assert s["mfu"] == pytest.approx(2_934_528 * (8 * 64 / median) / 0.5e12, rel=1e-9)


def test_update_tracker_is_opt_in(tmp_path):
    proc = run_job(FSDP, tmp_path / "one", 0, "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(set(r) == set(STEP_KEYS) for r in rows)
    assert all(r["updated_fraction"] is None and r["updated_fraction_compute"] is None for r in rows)
    notes = [ln for ln in (tmp_path / "one" / "log.txt").read_text().splitlines() if "updated_fraction" in ln]
    assert notes == ["note: updated_fraction not tracked (null in metrics.jsonl): it copies every shard each "
                     "step; pass --track-updates"]


OBSERVER_JOB = """
import json, os, sys
from helpers.job import run as train
from helpers.job.observe import observers

calls = []

class Recorder(observers.Observer):  # a new measurement: one class, nothing else edited
    def on_load_begin(self, s): calls.append("load")
    def on_model_built(self, s): calls.append("model")
    def on_engine_ready(self, s): calls.append("engine")
    def on_train_begin(self, s): calls.append("begin")
    def on_step_begin(self, s, step): calls.append(f"step {step}")
    def step_sums(self, s): return {"recorder.rank_plus_one": s.rank + 1}
    def step_row(self, s, sums): calls.append(sums["recorder.rank_plus_one"]); return {}
    def on_step_end(self, s, step, row): calls.append(f"end {step}: {row['step']}")
    def on_train_end(self, s): calls.append("train end")
    def summary(self, s): return {"mode_key": "recorded"}  # any key of the schema
    def close(self, s): calls.append("close")

default = observers.default_observers
observers.default_observers = lambda s: observers.Observers([*default(s).items, Recorder()])
train.main(sys.argv[1:])
print("CALLS", json.dumps(calls), flush=True)
os._exit(0)
"""


def test_an_observer_is_one_class(tmp_path):
    """A measurement plugs in as one Observer: its hooks run in order on every rank, its per-step numbers
    come back summed over the ranks, its keys reach summary.json."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(OBSERVER_JOB))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), "--config", FSDP, "--out", str(out), "--model", "tiny", "--steps", "2"],
                          cwd=REPO, env={**job_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [json.loads(ln[len("CALLS "):]) for ln in proc.stdout.splitlines() if ln.startswith("CALLS ")]
    assert calls == [["load", "model", "engine", "begin", "step 0", 3.0, "end 0: 0", "step 1", 3.0, "end 1: 1",
                      "train end", "close"]], proc.stdout[-2000:]  # rank 0 prints; 1 + 2 summed over 2 ranks
    assert summary(out)["mode_key"] == "recorded" and summary(out)["status"] == "completed"


def test_failing_job_says_failed_and_plots_refuse_it(tmp_path):
    # GPT-2 with 16 positions cannot take 64-token sequences: fails in the first forward
    cfg = tmp_path / "gpt2.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2,
                               "n_positions": 16, "vocab_size": 100}))
    out = tmp_path / "bad"
    proc = run_job(FSDP, out, 0, "--model", str(cfg), "--steps", "2")
    assert proc.returncode == 1
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] == 0 and s["reason"]
    with pytest.raises(RunError, match=f"run {out} failed on rank 0: "):
        load_run(out)
