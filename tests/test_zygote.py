"""The unit tests' forked ranks (tests/zygote.py) train and fail exactly as torchrun's do."""

import pytest
from conftest import FSDP, ZERO3, run_job, run_module

from helpers.nb.results import load_run

STEPS = ("--model", "tiny", "--steps", "3")


@pytest.mark.cpu_only("a GPU node starts every test job with torchrun")
@pytest.mark.parametrize("config", [FSDP, ZERO3], ids=["fsdp", "zero3"])
def test_forked_ranks_train_like_torchrun(tmp_path, config):
    runs = {}
    for launcher in ("auto", "torchrun"):
        proc = run_job(config, tmp_path / launcher, 2, *STEPS, launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = load_run(tmp_path / launcher)  # completed, every step in metrics.jsonl
        runs[launcher] = dict(loss=run.metrics["loss"].tolist(), grad_norm=run.metrics["grad_norm"].tolist(),
                              world_size=run.summary["world_size"], memory_bytes=run.summary["memory_bytes"])
    assert len(runs["auto"]["loss"]) == 3
    for key in runs["auto"]:  # bit for bit: the same seed, data and arithmetic
        assert runs["auto"][key] == runs["torchrun"][key], (key, runs["auto"][key], runs["torchrun"][key])


@pytest.mark.cpu_only("a GPU node starts every test job with torchrun")
def test_exit_codes_and_messages_are_torchruns(tmp_path):
    """Bad input on two ranks: every rank exits 2, the job 1, each with the same one-line error; one process
    (nproc 0) exits with its own code."""
    for nproc, code in ((2, 1), (0, 2)):
        procs = {launcher: run_module("helpers.train", ["--config", FSDP, "--out", tmp_path / f"{launcher}{nproc}",
                                                        "--steps", "-3"], nproc, launcher=launcher)
                 for launcher in ("auto", "torchrun")}
        errors = {k: [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")] for k, p in procs.items()}
        assert {k: p.returncode for k, p in procs.items()} == {"auto": code, "torchrun": code}, errors
        assert errors["auto"] == errors["torchrun"] and errors["auto"], errors
