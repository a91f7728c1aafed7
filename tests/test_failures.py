"""Jobs that go wrong: a rank raises, is killed or hangs; two jobs at once; two jobs, one --out."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest
from conftest import FSDP, run_job, start_job, summary

from helpers.job.guard import LOCK, OutDirError, claim_out_dir, error_file, read_report
from helpers.nb.results import RunError, load_run

FAIL_RANK_1 = {"GUIDE_FAIL_RANK": "1", "GUIDE_FAIL_STEP": "2"}  # test hooks, see helpers.job.guard
TINY = ("--model", "tiny", "--steps", "4")


class Timed:
    """A started job whose output lines are read as they come, with the time each one arrived."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.end = proc, [], None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and its ranks
            raise
        self.end = time.monotonic()
        self._reader.join(30)
        return rc

    def when(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def test_rank_1_error_is_shown_once_and_recorded(tmp_path):
    out = tmp_path / "run"
    proc = run_job(FSDP, out, 2, *TINY, env=FAIL_RANK_1)
    assert proc.returncode != 0
    everything = proc.stdout + proc.stderr
    assert everything.count("injected failure on rank 1 at step 2") == 1, everything[-4000:]
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert ours == ["error: rank 1 failed at step 2: RuntimeError: injected failure on rank 1 at step 2 "
                    "(test hook GUIDE_FAIL_RANK/GUIDE_FAIL_STEP)"], proc.stderr[-4000:]
    assert "last lines of rank 1's traceback" in proc.stderr and "in fault_hook" in proc.stderr
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] == 1, s
    assert s["reason"].startswith("RuntimeError: injected failure on rank 1 at step 2")
    assert s["steps"] == 2 and len(s["losses"]) == 2
    assert error_file(out, 1).read_text().startswith("rank: 1\nkind: error\n")
    assert ours[0] in (out / "log.txt").read_text()
    assert not (out / LOCK).exists()
    with pytest.raises(RunError, match=f"run {out} failed on rank 1: RuntimeError: injected failure"):
        load_run(out)


def run_fault(out, mode: str, timeout: int):
    """Rank 1 fails in ``mode`` at step 2; the finished job and seconds from the fault to the job's end."""
    job = Timed(start_job(FSDP, out, 2, *TINY, "--timeout", str(timeout), env={**FAIL_RANK_1, "GUIDE_FAIL_MODE": mode}))
    rc = job.wait(600)
    at = job.when(f"[rank 1] test hook GUIDE_FAIL_MODE={mode} at step 2")
    assert rc != 0 and at is not None, job.text[-4000:]
    return job, job.end - at


def test_killed_rank_ends_the_job_at_once(tmp_path):
    out = tmp_path / "run"
    job, seconds = run_fault(out, "kill", timeout=300)
    print(f"killed rank -> job ended in {seconds:.2f} s")
    # torchrun notices the death and stops the others at once; without that only the watchdog would end
    # the job, --timeout (300 s) after the last step: the bound sits far from both
    assert seconds < 150, job.text[-4000:]
    assert job.text.count("died without reporting an error") == 1, job.text[-4000:]
    assert re.search(r"^error: rank 1 \(pid \d+\) died without reporting an error", job.text, re.M)
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] == 1 and s["steps"] == 2, s
    with pytest.raises(RunError, match="failed on rank 1"):
        load_run(out)


@pytest.mark.cpu_only("the hung stack shows gloo's blocking all_gather; nccl collectives are asynchronous")
def test_hung_rank_ends_the_job_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    job, seconds = run_fault(out, "hang", timeout=30)
    print(f"hung rank -> job ended in {seconds:.2f} s (--timeout 30)")
    assert 25 < seconds < 30 + 60
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] is None and s["steps"] == 2, s
    assert s["reason"].startswith("timed out: no training step finished for 30 s (--timeout 30) at step 2")
    assert job.text.count("error: timed out") == 1
    assert re.search(r"rank 1: helpers/job/guard.py:\d+ in fault_hook", job.text), job.text[-4000:]
    assert re.search(r"rank 0: \S*torch/distributed/\S+ in all_gather", job.text), job.text[-4000:]
    # the hung rank can only be ended by its own watchdog, which leaves a timeout report
    hung = read_report(error_file(out, 1))
    assert hung and hung["kind"] == "timeout" and hung["step"] == 2, hung
    assert hung["reason"].startswith("timed out: no training step finished for 30 s"), hung
    # rank 0 waits in the collective: its own watchdog fires, or (the two clocks start within a moment
    # of each other) the collective breaks first because rank 1's watchdog ended rank 1. Either way its
    # report is at step 2 and not earlier than rank 1's, so the verdict above names the timeout
    waiting = read_report(error_file(out, 0))
    assert waiting and waiting["step"] == 2, waiting
    if waiting["kind"] == "timeout":
        assert waiting["reason"].startswith("timed out: no training step finished for 30 s"), waiting
    else:
        assert waiting["kind"] == "error" and waiting["time"] >= hung["time"], (waiting, hung)


def test_two_jobs_at_once_do_not_collide(tmp_path):
    jobs = [Timed(start_job(FSDP, tmp_path / name, 2, "--model", "tiny", "--steps", "3")) for name in "ab"]
    codes = [job.wait(600) for job in jobs]
    assert codes == [0, 0], [job.text[-2000:] for job in jobs]
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert a["status"] == b["status"] == "completed" and a["losses"] == b["losses"]


def test_second_job_into_a_live_run_dir_is_refused(tmp_path):
    out = tmp_path / "run"
    first = Timed(start_job(FSDP, out, 2, "--model", "tiny", "--steps", "100000"))
    try:
        deadline = time.monotonic() + 300
        while not (out / "config.json").exists():
            assert first.proc.poll() is None and time.monotonic() < deadline, first.text[-3000:]
            time.sleep(0.2)
        config = (out / "config.json").read_text()
        second = run_job(FSDP, out, 0, "--steps", "2", timeout=300)
        assert second.returncode == 2
        assert re.fullmatch(rf"error: --out {re.escape(str(out))} is in use by a running job \(pid \d+ on \S+, "
                            r"started [\d:]+\); wait for it to finish or pick another --out\n", second.stderr)
        assert (out / "config.json").read_text() == config and first.proc.poll() is None
    finally:
        first.proc.send_signal(signal.SIGTERM)  # what Slurm's time limit or an interrupted cell sends
        first.wait(120)
    s = summary(out)
    assert s["status"] == "failed" and s["failed_rank"] is None and "SIGTERM" in s["reason"], s
    assert not (out / LOCK).exists()
    for rank in (0, 1):  # torchrun passed the SIGTERM on: every rank says it was stopped
        report = read_report(error_file(out, rank))
        assert report and report["kind"] == "signal" and "stopped by SIGTERM" in report["reason"], (rank, report)
    rerun = run_job(FSDP, out, 0, "--model", "tiny", "--steps", "2")  # free again: a rerun replaces it
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert summary(out)["status"] == "completed" and not error_file(out, 0).exists()


def test_out_dir_lock_lives_as_long_as_its_holder(tmp_path):
    out = tmp_path / "run"
    lock = claim_out_dir(out)
    with pytest.raises(OutDirError, match=rf"--out {re.escape(str(out))} is in use by a running job \(pid {os.getpid()}"):
        claim_out_dir(out)
    (out / "config.json").write_text("{}")  # the run writes its files
    lock.close()  # what the kernel does when the holder exits, even by SIGKILL: the .lock file stays
    assert (out / LOCK).exists()
    claim_out_dir(out).close()  # a stale .lock is no obstacle, and the earlier run is replaced
    assert [p.name for p in out.iterdir()] == [LOCK]


def test_a_rank_that_reported_then_exited_is_not_called_silent(tmp_path, monkeypatch):
    """Rank 0 reads the reports, rank 1 writes its own and exits, rank 0 then finds rank 1 dead: its report
    (final once it is dead) decides, not 'died without reporting an error'."""
    from helpers.job import guard

    (tmp_path / "config.json").write_text("{}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    g = guard.JobGuard(str(tmp_path), 0, 2, timeout=60)
    g.peers = {0: (guard.socket.gethostname(), os.getpid()), 1: (guard.socket.gethostname(), dead.pid)}
    real_read, reads = guard.read_report, []

    def read_late(path):  # the first read comes before rank 1 wrote; it writes, then it is gone
        reads.append(path)
        if len(reads) == 1:
            guard.write_report(str(tmp_path), 1, "stop", 2, "peak passed --memory-budget-gib 0.32", [], "")
            return None
        return real_read(path)

    monkeypatch.setattr(guard, "read_report", read_late)
    own = {"rank": 0, "kind": "stop", "time": time.time() + 1, "step": 2, "reason": "rank 0's own stop",
           "where": [], "details": ""}
    failed, why, message = g._verdict(own)
    assert "died without reporting" not in message, message
    assert why == "peak passed --memory-budget-gib 0.32", message
