"""--memory-budget-gib: a job that fits says so; one that does not stops with one line (helpers.job.observe.tensor_peak)."""

import re
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest
from conftest import FSDP, REPO, job_cmd, job_env, run_job, summary

from helpers.job.guard import JobStop
from helpers.job.observe.tensor_peak import over_budget

GIB = 2**30


def test_over_budget_names_the_largest_rank():
    assert over_budget([100, 200], 200, "0-1") is None  # equal to the budget fits
    assert over_budget([None], 1, "0-1") is None  # nothing measured: nothing to say
    why = over_budget([300, 2 * GIB], GIB, "0-1")
    assert why == "peak tensor memory 2.0000 GiB (rank 1, steps 0-1) passed --memory-budget-gib 1"
    # the user's value, as given: 0.001 GiB is not a round number of bytes
    assert over_budget([GIB], int(0.001 * GIB), "0-1", 0.001).endswith("--memory-budget-gib 0.001")


def test_gpu_out_of_memory_becomes_one_line():
    import torch

    from helpers.job.run import budget_verdict

    s = SimpleNamespace(args=Namespace(memory_budget_gib=0.5), start_step=0, records=[{}, {}], rank=1, in_loop=True)
    stop = budget_verdict(s, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ..."))
    assert isinstance(stop, JobStop) and str(stop) == "out of memory under --memory-budget-gib 0.5 at step 2 (rank 1)"
    setup = SimpleNamespace(args=s.args, start_step=0, records=[], rank=0, in_loop=False)  # apply_fsdp's upcast
    assert "during set-up (building, loading or sharding the model, before step 0) (rank 0)" in \
        str(budget_verdict(setup, torch.cuda.OutOfMemoryError("CUDA out of memory.")))
    other = RuntimeError("x")
    assert budget_verdict(s, other) is other  # only an out-of-memory is the budget's answer
    s.args.memory_budget_gib = None
    oom = torch.cuda.OutOfMemoryError("y")
    assert budget_verdict(s, oom) is oom  # without a budget it stays the error it is


@pytest.mark.cpu_only
def test_fits_then_does_not(tmp_path):
    """The same tiny job under a budget above its peak (completes, fits) and under half its peak (one error
    line, exit 1, failed summary saying it did not fit)."""
    proc = run_job(FSDP, tmp_path / "fits", 2, "--model", "tiny", "--steps", "2", "--micro-batch", "4",
                   "--memory-budget-gib", "0.25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(tmp_path / "fits")
    peak = max(s["peak_tensor_bytes"])
    assert s["memory_budget_bytes"] == GIB // 4 and s["memory_budget_fits"] is True and 0 < peak <= GIB // 4
    assert "memory budget: fits" in (tmp_path / "fits" / "log.txt").read_text()

    budget = round(peak / 2 / GIB, 6)  # one rank: plain python, so stderr is the job's own lines only
    proc = subprocess.run(job_cmd(FSDP, tmp_path / "over", 0, "--model", "tiny", "--steps", "2", "--micro-batch",
                                  "4", "--memory-budget-gib", str(budget)),
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert re.fullmatch(rf"error: peak tensor memory \d+\.\d{{4}} GiB \(rank 0, steps 0-1\) passed "
                        rf"--memory-budget-gib {budget:g}", lines[0]), lines
    assert len(lines) == 2 and lines[1].startswith("  details: ") and "Traceback" not in proc.stderr, lines
    s = summary(tmp_path / "over")
    assert s["status"] == "failed" and s["memory_budget_fits"] is False and s["steps"] == 2
    assert s["memory_budget_bytes"] == int(budget * GIB) and s["failed_rank"] == 0
    assert f"{s['peak_tensor_bytes'][0] / GIB:.4f} GiB" in s["reason"]  # the number is the summary's peak


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan"])
def test_bad_budget_exits_2(tmp_path, value):
    proc = subprocess.run([sys.executable, "-m", "helpers.train", "--config", FSDP, "--out", str(tmp_path / "r"),
                           "--memory-budget-gib", value], cwd=REPO, env=job_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: argument --memory-budget-gib: --memory-budget-gib = {value!r}: must be a number of GiB > 0 (the "
        "tensor memory each rank may use, e.g. 0.5) (see python -m helpers.train --help)"]


@pytest.mark.cpu_only
def test_budget_with_profile_is_refused_on_cpu(tmp_path):
    proc = subprocess.run(job_cmd(FSDP, tmp_path / "r", 0, "--model", "tiny", "--steps", "4", "--profile",
                                  "--memory-budget-gib", "1"), cwd=REPO, env=job_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --memory-budget-gib with --profile: on a CPU the budget is checked against peak_tensor_bytes, which "
        "--profile leaves untracked (one profiler per thread); drop one"]
