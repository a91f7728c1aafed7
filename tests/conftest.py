"""Shared test helpers: launch real jobs the way the notebooks do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FSDP = "launch_configs/fsdp/full_shard.yaml"
ZERO3 = "launch_configs/deepspeed/zero3.yaml"


def job_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    return env


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    """On a GPU node, tests marked ``cpu_only(reason)`` are skipped with their reason; the rest runs (nccl)."""
    if not gpu_count():
        return
    for item in items:
        mark = item.get_closest_marker("cpu_only")
        if mark:
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {mark.args[0] if mark.args else ''}"))


def module_cmd(module: str, args: list, nproc: int = 2) -> list[str]:
    """torchrun (nproc > 0) or plain python (nproc == 0) -m module args. On a GPU node with fewer GPUs
    than ``nproc`` the test is skipped: nccl takes one GPU per rank."""
    gpus = gpu_count()
    if gpus and nproc > gpus:
        pytest.skip(f"needs {nproc} GPUs (one per nccl rank); this node has {gpus}")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc else [sys.executable])
    return [*launcher, "-m", module, *(str(a) for a in args)]


def job_cmd(config: str, out: Path, nproc: int = 2, *extra: str) -> list[str]:
    """``module_cmd`` for helpers.job.run."""
    return module_cmd("helpers.train", ["--config", config, "--out", out, *extra], nproc)


def forked(launcher: str) -> bool:
    """Whether a test job's ranks are forked from tests/zygote.py's server (CPU; see there) or torchrun starts
    them: ``launcher="torchrun"`` for tests of torchrun's own behaviour, GUIDE_TEST_LAUNCHER=torchrun for all."""
    if launcher not in ("auto", "torchrun"):
        raise ValueError(f"launcher={launcher!r}: 'auto' or 'torchrun'")
    return launcher == "auto" and os.environ.get("GUIDE_TEST_LAUNCHER", "fork") == "fork" and not gpu_count()


def run_module(module: str, args: list, nproc: int = 2, *, timeout: int = 600, env: dict | None = None,
               launcher: str = "auto") -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc -m module args`` (nproc 0: ``python -m module args``) to the end, as
    subprocess.run with captured text output. ``env`` adds variables (e.g. GUIDE_FAIL_*)."""
    args = [str(a) for a in args]
    cmd = module_cmd(module, args, nproc)
    base = job_env()
    full_env = {**base, **(env or {})}
    if forked(launcher):
        import zygote

        return zygote.run(module, args, nproc, full_env, str(REPO), timeout, cmd, server_env=base)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_job(config: str, out: Path, nproc: int = 2, *extra: str, timeout: int = 600, env: dict | None = None,
            launcher: str = "auto"):
    """Run a job to the end; returns CompletedProcess. ``env`` adds variables (e.g. GUIDE_FAIL_*)."""
    return run_module("helpers.train", ["--config", config, "--out", out, *extra], nproc, timeout=timeout, env=env,
                      launcher=launcher)


def run_families(config: str, out: Path, steps: int, *extra: str) -> Path:
    """helpers.families on 2 ranks (the aligned pair's parity sweep over model families); fails the test on
    a non-zero exit. ``extra``: e.g. ``--families llama,qwen2``."""
    proc = run_module("helpers.families", ["--config", config, "--out", out, "--steps", steps, *extra], 2,
                      timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def start_job(config: str, out: Path, nproc: int = 2, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """Start a job in the background, stdout and stderr merged into one text pipe."""
    return subprocess.Popen(job_cmd(config, out, nproc, *extra), cwd=REPO, env={**job_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # so a test can end the whole tree: os.killpg


def summary(out: Path) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """One 2-rank, 20-step tiny run per backend (updated fractions tracked), shared by the tests that read them."""
    base = tmp_path_factory.mktemp("pair")
    outs = {}
    for name, cfg in (("fsdp", FSDP), ("deepspeed", ZERO3)):
        proc = run_job(cfg, base / name, 2, "--model", "tiny", "--steps", "20", "--track-updates")
        assert proc.returncode == 0, f"{name} job failed:\n{proc.stderr[-3000:]}"
        outs[name] = base / name
    return outs
