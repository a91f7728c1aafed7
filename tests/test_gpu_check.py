"""benchmarks/gpu_check.py on a CPU: a hung job is a FAIL row (its own --timeout below the check's limit), a
raising check is a row, and a dry run lists every check with the versions in the JSON."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["gpu_check"]


def test_a_hung_job_is_a_failed_row_not_a_lost_table(gc, tmp_path, monkeypatch):
    # a "job" that ignores its --timeout and never ends: killed with its whole session after the grace
    fake = tmp_path / "hang.py"
    fake.write_text("import sys, time\nprint(sys.argv[sys.argv.index('--timeout') + 1], flush=True)\n"
                    "time.sleep(600)\n")
    real = gc.subprocess.Popen
    monkeypatch.setattr(gc.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, str(fake), *cmd[3:]], **kw))
    monkeypatch.setattr(gc, "GRACE_S", 1)
    c = gc.Ctx(tmp_path, gpu=False, gpus=0, job_timeout=1)
    gc.memory_budget(c)
    row = json.loads((tmp_path / "gpu_check.json").read_text())["rows"][0]
    assert row["check"] == "memory budget" and row["result"] == "FAIL" and "timed out" in row["detail"]
    assert "killed by gpu_check after 2 s (the job's --timeout 1 s" in c.runs["budget_oom"]["stderr_tail"]
    assert (tmp_path / "budget_oom.log").read_text().startswith("1\n")  # the job was given its own --timeout


def test_dry_run_lists_every_check_and_runs_the_selected(gc, tmp_path, monkeypatch):
    def boom(c):
        raise RuntimeError("no such thing")

    monkeypatch.setattr(gc, "CHECKS", [*gc.CHECKS[:-1], ("2 ranks", boom, True)])
    code = gc.main(["--dry-run", "--out", str(tmp_path), "--only", "memory budget,2 ranks"])
    got = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["check"]: r for r in got["rows"]}
    assert list(rows) == got["checks"] and len(rows) == len(gc.CHECKS) + 3  # three checks add a second row
    assert rows["memory budget"]["result"] == "PASS", rows["memory budget"]  # the budget's stop, as a result
    assert rows["2 ranks"]["result"] == "FAIL" and "raised RuntimeError: no such thing" in rows["2 ranks"]["detail"]
    assert rows["2 ranks offload"]["result"] == "FAIL"  # not reached
    assert {r["result"] for n, r in rows.items() if n not in ("memory budget", "2 ranks", "2 ranks offload")} \
        == {"skip"}
    assert set(got["versions"]) >= {"torch", "deepspeed", "transformers", "accelerate"} and code == 1
    assert gc.main(["--dry-run", "--out", str(tmp_path), "--only", "nope"]) == 2


def test_gpu_check_needs_a_gpu_or_dry_run():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no GPU visible")
