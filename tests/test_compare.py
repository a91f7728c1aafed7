"""helpers.compare and --trace-tensors: exit codes, the first differing step and tensor, exact fingerprints."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import FSDP, REPO, job_env, run_job

from helpers.compare import compare
from helpers.job.observe.tensor_trace import _MODS, fingerprint

LOW = "launch_configs/fsdp/full_shard_low_precision.yaml"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "helpers.compare", *map(str, args)], cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=120)


def fake_run(path, losses, norms, status="completed", trace=None):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"status": status, "steps": len(losses)}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": x, "grad_norm": g}) + "\n"
                                                for i, (x, g) in enumerate(zip(losses, norms, strict=True))))
    if trace is not None:
        (path / "tensor_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace))
    return path


def trace_step(step, **over):
    rec = {"weight": ["aa", "fp32"], "grad_local": ["bb", "bf16"], "grad_reduced": ["cc", "fp32"],
           "update": ["dd", "fp32", 10]}
    params = {"w0": dict(rec), "w1": dict(rec)}
    for key, value in over.items():
        name, stage = key.split("__")
        params[name] = {**params[name], stage: value}
    return {"step": step, "params": params}


# ----------------------------------------------------------------- fingerprints


def test_fingerprint_is_exact_and_independent_of_sharding():
    t = torch.randn(1001, dtype=torch.float32)
    whole = fingerprint(t)
    for k in (1, 500, 1000):  # any split, folded at its global offset, adds up to the whole
        parts = fingerprint(t[:k]) + fingerprint(t[k:], k)
        assert torch.equal(parts % torch.tensor([m[0] for m in _MODS]), whole)
    assert torch.equal(fingerprint(t.bfloat16()), fingerprint(t.bfloat16().float()))  # values, not dtype
    assert not torch.equal(fingerprint(t.bfloat16()), whole)  # rounded values differ
    bumped = t.clone()
    bumped[700] = torch.nextafter(bumped[700], torch.tensor(float("inf")))  # one ulp, one element
    assert not torch.equal(fingerprint(bumped), whole)
    assert not torch.equal(fingerprint(t.flip(0)), whole)  # order matters


# ----------------------------------------------------------------- compare on run directories


def test_identical_runs_exit_0(tmp_path):
    a = fake_run(tmp_path / "a", [2.5, 2.25], [1.0, 0.5])
    b = fake_run(tmp_path / "b", [2.5, 2.25], [1.0, 0.5])
    proc = cli(a, b)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("identical: 2 steps") and "no tensor trace in" in proc.stdout


def test_first_difference_names_the_step_and_both_values(tmp_path):
    a = fake_run(tmp_path / "a", [2.5, 2.25, 2.0], [1.0, 0.5, 0.25])
    b = fake_run(tmp_path / "b", [2.5, 2.25, 2.0000000000000004], [1.0, 0.5000000000000001, 0.25])
    proc = cli(a, b)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0] == ("first difference: step 1 loss 2.25 vs 2.25, "
                                           "grad_norm 0.5 vs 0.5000000000000001")


def test_traces_name_the_first_step_stage_and_dtypes(tmp_path):
    same = [trace_step(0), trace_step(1)]
    a = fake_run(tmp_path / "a", [2.5, 2.25], [1.0, 0.5], trace=same)
    b = fake_run(tmp_path / "b", [2.5, 2.3], [1.0, 0.5],
                 trace=[trace_step(0, w1__update=["ee", "bf16", 3], w0__grad_reduced=["ff", "fp32"]),
                        trace_step(1, w0__weight=["00", "bf16"])])
    result = compare(a, b)
    t = result.tensor
    # step 0: grad_reduced (w0) comes before update (w1) in a step
    assert (t.step, t.stage, t.param, t.dtype_a, t.dtype_b) == (0, "grad_reduced", "w0", "fp32", "fp32")
    assert result.first_step == 1 and not result.identical
    b2 = fake_run(tmp_path / "b2", [2.5, 2.3], [1.0, 0.5], trace=[trace_step(0, w1__update=["ee", "bf16", 3]),
                                                                   trace_step(1)])
    proc = cli(a, b2)
    assert proc.returncode == 1
    assert "first differing tensor: step 0 update of w1: fp32 vs bf16; elements changed 10 vs 3" in proc.stdout


def test_shorter_run_is_a_difference(tmp_path):
    a = fake_run(tmp_path / "a", [2.5, 2.25], [1.0, 0.5])
    b = fake_run(tmp_path / "b", [2.5], [1.0])
    proc = cli(a, b)
    assert proc.returncode == 1 and "A ran 2 steps, B 1" in proc.stdout


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such run directory"),
    ("not_a_run", "not a finished run directory (no summary.json)"),
    ("failed", "status = 'failed' in summary.json"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, case, expect):
    good = fake_run(tmp_path / "good", [2.5], [1.0])
    other = {"missing": tmp_path / "nope", "not_a_run": tmp_path,
             "failed": fake_run(tmp_path / "bad", [2.5], [1.0], status="failed")}[case]
    proc = cli(good, other)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expect in lines[0], proc.stderr
    assert str(other) in lines[0] and proc.stdout == ""


# ----------------------------------------------------------------- real jobs


def test_trace_tensors_refuses_zero2_with_one_line(tmp_path):
    proc = run_job("launch_configs/deepspeed/zero2.yaml", tmp_path / "run", 0, "--model", "tiny", "--steps", "2",
                   "--trace-tensors")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "zero_optimization.stage = 2: --trace-tensors reads ZeRO-3 partitions" in lines[0]


def test_stalling_pair_points_at_the_update_bf16_rounds_away(tmp_path):
    """bf16-only FSDP vs aligned FSDP at lr 1e-5: same start and gradients, the first step's update differs."""
    args = ("--model", "tiny", "--steps", "3", "--lr", "1e-5", "--micro-batch", "4", "--seq-len", "32",
            "--trace-tensors")
    for name, cfg in (("low", LOW), ("aligned", FSDP)):
        proc = run_job(cfg, tmp_path / name, 2, *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
    result = compare(tmp_path / "low", tmp_path / "aligned")
    assert result.first_step == 1  # step 0's loss does not depend on its own update
    t = result.tensor
    assert (t.step, t.stage, t.dtype_a, t.dtype_b) == (0, "update", "bf16", "fp32"), t
    assert 0 < t.changed_a < t.changed_b / 2, t  # most small updates vanish in bf16
    trace = [json.loads(x) for x in (tmp_path / "low" / "tensor_trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trace] == [0, 1, 2]
    q = trace[0]["params"]["model.layers.0.self_attn.q_proj.weight"]
    assert [q[s][1] for s in ("weight", "grad_local", "grad_reduced", "update")] == ["bf16"] * 4
