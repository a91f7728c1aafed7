"""Precision: the model dtype flag, the live dtype probe, updated fractions, bf16 stalls, accumulation parity."""

import json

import pytest
from conftest import FSDP, REPO, ZERO3, run_job, summary

from helpers.core.config import ConfigError, load_job_config

LOW = "launch_configs/fsdp/full_shard_low_precision.yaml"
TINY = ("--model", "tiny")


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------- which dtype the model is loaded in


def test_model_dtype_auto_keeps_the_shipped_modes():
    assert load_job_config(str(REPO / FSDP)).train.model_dtype == "bf16"  # upcast by mixed precision
    assert load_job_config(str(REPO / ZERO3)).train.model_dtype == "bf16"
    low = load_job_config(str(REPO / LOW))
    assert low.mixed_precision == "no" and low.train.model_dtype == "bf16"  # low precision by default
    assert load_job_config(str(REPO / LOW), {"model_dtype": "fp32"}).train.model_dtype == "fp32"


def test_deepspeed_without_bf16_takes_fp32_and_refuses_bf16(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"bf16": {"enabled": False}, "zero_optimization": {"stage": 3}}))
    (tmp_path / "c.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    assert load_job_config(str(tmp_path / "c.yaml")).train.model_dtype == "fp32"
    with pytest.raises(ConfigError, match="--model-dtype = 'bf16' needs bf16.enabled = true.*allowed here: fp32, auto"):
        load_job_config(str(tmp_path / "c.yaml"), {"model_dtype": "bf16"})


def test_bad_model_dtype_one_line_exit_2(tmp_path):
    proc = run_job(FSDP, tmp_path / "run", 0, "--model-dtype", "fp16")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "--model-dtype = 'fp16': allowed values are auto, bf16, fp32" in lines[0]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------- dtypes read from the live objects

SEED_ROWS = {  # what each mode must show (the seeds' table, plus what it leaves out)
    "fsdp_low": dict(loaded="bf16", stored_param="bf16", master_param=None, optimizer_param="bf16",
                     forward_weight="bf16", grad_before_reduce="bf16", stored_grad="bf16",
                     optimizer_states="bf16"),
    "fsdp": dict(loaded="bf16", stored_param="fp32", master_param=None, optimizer_param="fp32",
                 forward_weight="bf16", grad_before_reduce="bf16", reduce_dtype="bf16", stored_grad="fp32",
                 optimizer_states="fp32"),
    "deepspeed": dict(loaded="bf16", stored_param="bf16", master_param="fp32", optimizer_param="fp32",
                      forward_weight="bf16", grad_before_reduce="bf16", reduce_dtype="bf16", stored_grad="bf16",
                      optimizer_grad="fp32", optimizer_states="fp32"),
}


@pytest.fixture(scope="module")
def stall_pair(tmp_path_factory):
    """Low precision and aligned FSDP at a rate where bf16 updates round away."""
    base = tmp_path_factory.mktemp("stall")
    for name, cfg in (("fsdp_low", LOW), ("fsdp", FSDP)):
        proc = run_job(cfg, base / name, 2, *TINY, "--steps", "40", "--lr", "1e-5", "--track-updates")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return base


@pytest.mark.parametrize("mode", list(SEED_ROWS))
def test_dtype_probe_reads_each_stage(mode, stall_pair, tiny_pair):
    out = stall_pair / mode if mode == "fsdp_low" else tiny_pair[mode]
    d = summary(out)["dtypes"]
    assert d["param"] == "model.layers.0.self_attn.q_proj.weight"
    for key, want in SEED_ROWS[mode].items():
        assert d[key] == want, (mode, key, d[key], want)
    assert None not in [d[k] for k in d if k != "master_param"], d


def test_updated_fraction_is_the_same_arithmetic_on_both_backends(tiny_pair):
    f, d = metrics(tiny_pair["fsdp"]), metrics(tiny_pair["deepspeed"])
    assert [r["updated_fraction_compute"] for r in f] == [r["updated_fraction_compute"] for r in d]
    for r in f:  # fp32 shards change wherever there is a gradient; unused embedding rows never do
        assert 0.5 < r["updated_fraction_compute"] <= r["updated_fraction"] < 1.0


def test_low_precision_stalls_where_mixed_precision_learns(stall_pair):
    low, mixed = summary(stall_pair / "fsdp_low"), summary(stall_pair / "fsdp")
    assert low["losses"][0] == mixed["losses"][0]  # same model, same first batch

    def drop(losses):
        return losses[0] - sum(losses[-10:]) / 10

    assert drop(mixed["losses"]) > 0.03, mixed["losses"]
    assert drop(low["losses"]) < 0.5 * drop(mixed["losses"]), (low["losses"], mixed["losses"])
    fl, fm = metrics(stall_pair / "fsdp_low"), metrics(stall_pair / "fsdp")
    mean = lambda rows, k: sum(r[k] for r in rows[5:]) / len(rows[5:])  # noqa: E731
    assert all(r["updated_fraction"] == r["updated_fraction_compute"] for r in fl)  # bf16 is all it has
    assert mean(fl, "updated_fraction") < 0.75 * mean(fm, "updated_fraction_compute")  # fewer bf16 weights move
    assert mean(fm, "updated_fraction") > 0.5  # the fp32 shard takes every update


# ----------------------------------------------------------------- training knobs


def test_gradient_accumulation_agrees_across_backends(tmp_path):
    """Same first step; then close, not bitwise: FSDP2 accumulates before its one reduction,
    ZeRO-3 reduces every micro-batch into a bf16 buffer (see notebooks/12_parity)."""
    outs = {}
    for name, cfg in (("fsdp", FSDP), ("deepspeed", ZERO3)):
        outs[name] = tmp_path / name
        proc = run_job(cfg, outs[name], 2, *TINY, "--steps", "6", "--grad-accum", "2")
        assert proc.returncode == 0, proc.stderr[-3000:]
    f, d = summary(outs["fsdp"]), summary(outs["deepspeed"])
    assert f["tokens_per_step"] == d["tokens_per_step"] == 2 * 2 * 8 * 64
    assert f["losses"][0] == d["losses"][0]
    assert max(abs(a - b) for a, b in zip(f["losses"], d["losses"], strict=True)) < 1e-3
    assert f["losses"][-1] < f["losses"][0] - 0.5


def test_dtype_probe_under_zero3_sub_groups(tmp_path):
    """A small sub_group_size (a valid DeepSpeed config) splits the fp32 master into several flat partitions,
    which ZeRO-3 hands its optimizer one at a time: the probe waits for the one holding its parameter
    (it once stopped the job at step 1 with StopIteration)."""
    ds = json.loads((REPO / "launch_configs/deepspeed/zero3.json").read_text())
    ds["zero_optimization"]["sub_group_size"] = 4096
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "c.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    proc = run_job(str(tmp_path / "c.yaml"), tmp_path / "run", 2, *TINY, "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = summary(tmp_path / "run")["dtypes"]
    for key, want in SEED_ROWS["deepspeed"].items():
        assert d[key] == want, (key, d[key], want)
