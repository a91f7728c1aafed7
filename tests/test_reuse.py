"""--reuse DIR: a completed run of the same job is copied, anything else runs and says why (helpers.job.reuse)."""

import argparse
import json
from pathlib import Path

from conftest import FSDP, run_job, summary

from helpers.job import reuse

TINY = ("--model", "tiny", "--steps", "2")


def test_the_same_job_is_copied_and_another_one_runs(tmp_path):
    src = tmp_path / "core"
    first = run_job(FSDP, src, 2, *TINY)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_job(FSDP, tmp_path / "deep", 2, *TINY, "--reuse", src)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(again.stdout.splitlines()) == 1 and f"reused {src}: the same job, completed" in again.stdout, again.stdout
    got = summary(tmp_path / "deep")
    assert got["reused_from"] == str(src) and got["job_key"] == got["reuse_key"] == summary(src)["job_key"]
    assert got["losses"] == summary(src)["losses"]
    assert (tmp_path / "deep" / "metrics.jsonl").read_bytes() == (src / "metrics.jsonl").read_bytes()
    assert json.loads((tmp_path / "deep" / "config.json").read_text())["out"] == str(tmp_path / "deep")
    assert not (tmp_path / "deep" / ".lock").exists()

    other = run_job(FSDP, tmp_path / "other", 2, "--model", "tiny", "--steps", "1", "--reuse", src)
    assert other.returncode == 0, other.stderr[-2000:]
    assert f"note: --reuse {src}: not reused, its run is another job" in other.stdout, other.stdout
    assert summary(tmp_path / "other")["reused_from"] is None and summary(tmp_path / "other")["reuse_key"] is None
    assert summary(tmp_path / "other")["steps"] == 1


def _args(**kw):
    base = dict(config="launch_configs/fsdp/full_shard.yaml", out="runs/a", reuse=None, model="tiny", steps=2)
    return argparse.Namespace(**{**base, **kw})


def test_the_key_covers_flags_ranks_and_code_but_not_out(tmp_path, monkeypatch):
    for top in reuse.CODE:
        (tmp_path / top).mkdir()
        (tmp_path / top / "x.py").write_text("a = 1\n")
    monkeypatch.setattr(reuse, "ROOT", tmp_path)
    key = reuse.job_key(_args(), 2)
    assert reuse.job_key(_args(out="elsewhere", reuse="runs/b"), 2) == key
    assert reuse.job_key(_args(steps=3), 2) != key
    assert reuse.job_key(_args(), 4) != key
    (tmp_path / "helpers" / "x.py").write_text("a = 2\n")
    assert reuse.job_key(_args(), 2) != key


def test_a_failed_or_missing_run_is_not_reused(tmp_path):
    assert reuse.why_not(_args(out=str(tmp_path / "b"), reuse=str(tmp_path / "none")), 2) == "no finished run there"
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "summary.json").write_text(json.dumps({"status": "failed", "job_key": "x"}))
    assert reuse.why_not(_args(out=str(tmp_path / "b"), reuse=str(tmp_path / "failed")), 2) == \
        "its run did not complete: status 'failed'"
    assert reuse.why_not(_args(out=str(tmp_path / "b"), reuse=str(tmp_path / "b")), 2) == "it is --out itself"
    assert Path(reuse.ROOT / "helpers" / "job" / "reuse.py") in reuse.code_files(reuse.ROOT)
