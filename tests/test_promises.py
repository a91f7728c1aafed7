"""Promises of the README and docs/ with no test of their own elsewhere: clipping parity, --compile, load_run's refusals,
GUIDE_PROGRESS=0, gloo on loopback. (A given --peak-tflops: test_train's one-rank job.)"""

import json
import os
import shutil

import pytest
from conftest import FSDP, REPO, run_job, summary

from helpers.job import run as train
from helpers.job.observe import progress
from helpers.nb.results import RunError, load_run

CLIP_STEPS = 6


@pytest.fixture(scope="session")
def clipped(tmp_path_factory):
    """FSDP --grad-clip 1.0 and ZeRO-3 with gradient_clipping 1.0, the tiny pair's first steps otherwise."""
    b = tmp_path_factory.mktemp("clip")
    js = json.loads((REPO / "launch_configs/deepspeed/zero3.json").read_text())
    js["gradient_clipping"] = 1.0
    (b / "zero3_clip.json").write_text(json.dumps(js))
    (b / "zero3_clip.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       f"  deepspeed_config_file: {b / 'zero3_clip.json'}\n")
    tiny = ("--model", "tiny", "--steps", str(CLIP_STEPS))
    for name, cfg, extra in (("fsdp", FSDP, ("--grad-clip", "1.0")), ("deepspeed", str(b / "zero3_clip.yaml"), ())):
        proc = run_job(cfg, b / name, 2, *tiny, *extra)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"
    return b


def test_fsdp_grad_clip_matches_deepspeed_clipping(clipped, tiny_pair):
    f, d = summary(clipped / "fsdp"), summary(clipped / "deepspeed")
    unclipped = summary(tiny_pair["fsdp"])  # same job, no clipping (a job's first steps do not depend on --steps)
    norms = [json.loads(x)["grad_norm"] for x in (clipped / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert max(norms[:-1]) > 1.0, norms  # clipping acted on a step whose effect the losses show
    assert f["losses"] != unclipped["losses"][:CLIP_STEPS]  # it changed the training...
    assert f["losses"][0] == unclipped["losses"][0]  # ...from step 1 on (step 0's forward came first)
    assert f["losses"] == d["losses"]  # and exactly as DeepSpeed's clipping does


def test_compile_trains_like_eager(tmp_path, tiny_pair):
    """--compile (FSDP2: each block compiled before sharding), one rank, 2 steps: the tiny pair's losses."""
    out = tmp_path / "compiled"
    proc = run_job(FSDP, out, 0, "--model", "tiny", "--steps", "2", "--micro-batch", "16", "--compile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(out)
    assert json.loads((out / "config.json").read_text())["train"]["compile"] is True
    # one rank with the whole global batch of 16 vs two ranks of 8: the same data, bf16 rounding apart
    assert s["losses"] == pytest.approx(summary(tiny_pair["fsdp"])["losses"][:2], rel=2e-3)


# --------------------------------------------------------------------------- load_run refuses


def test_load_run_refuses_incomplete_and_inconsistent_runs(tiny_pair, tmp_path):
    good = tmp_path / "good"
    shutil.copytree(tiny_pair["fsdp"], good)
    assert load_run(good).summary["steps"] == 20
    short = tmp_path / "short"  # a metrics line lost: the summary says 20 steps
    shutil.copytree(good, short)
    lines = (short / "metrics.jsonl").read_text().splitlines()
    (short / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(RunError, match=f"run {short}: metrics.jsonl has 19 steps, summary says 20"):
        load_run(short)
    running = tmp_path / "running"  # still running or killed: no summary yet
    shutil.copytree(good, running)
    (running / "summary.json").unlink()
    with pytest.raises(RunError, match=f"run {running} is incomplete: no summary.json"):
        load_run(running)
    with pytest.raises(RunError, match="no such run directory"):
        load_run(tmp_path / "never")


# --------------------------------------------------------------------------- GUIDE_PROGRESS=0, gloo on loopback


def test_guide_progress_0_turns_the_bar_off(monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)
    for env, lines in (("1", 4), ("0", 0)):  # the same bar, on then off
        monkeypatch.setenv("GUIDE_PROGRESS", env)
        bar = progress.Progress(3, active=True)
        for i in range(3):
            bar.update(1.0 - i / 10, 100.0)
        bar.close()
        err = capsys.readouterr().err
        assert len(err.splitlines()) == lines, (env, err)


@pytest.mark.parametrize("addr, want", [("127.0.0.1", "lo"), ("localhost", "lo"), ("192.0.2.7", None)])
def test_gloo_stays_on_loopback_for_a_local_rendezvous(monkeypatch, addr, want):
    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    train._loopback_gloo()
    assert os.environ.get("GLOO_SOCKET_IFNAME") == want
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # the user's choice is kept
    train._loopback_gloo()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
