"""What keeps a job honest when something goes wrong: run-directory lock, failure reports, hang bound.

``helpers.train`` uses one ``JobGuard`` per rank:

* ``claim_out_dir(path)`` (rank 0, before any process group; ``refuse_if_busy`` first): refuses an
  ``--out`` that is a file, a directory that is not a run directory, or one a
  live job holds (``DIR/.lock``, an ``flock`` the kernel drops when the holder
  dies, so a killed job never leaves a stale lock). An earlier run there is
  replaced.
* A failing rank writes ``DIR/error_rank{r}.txt`` (reason, step, traceback)
  before it exits. Rank 0, whichever way it learns of the failure (its own
  exception, a collective that breaks, torchrun's SIGTERM, the timeout),
  names the rank that failed first, writes the failed ``summary.json`` and
  prints one ``error:`` block. A rank that died without a word (SIGKILL, out
  of memory) is found by its pid when it ran on rank 0's host.
* A watchdog thread ends the job when no training step has finished for
  ``--timeout`` seconds (start-up included): a hung collective or a dead peer
  cannot hang a notebook cell forever.

Test hooks (for the failure tests; never set in real runs): ``GUIDE_FAIL_RANK=R``
makes rank R fail at the start of step ``GUIDE_FAIL_STEP`` (default 0) in the
way ``GUIDE_FAIL_MODE`` says: ``raise`` (a RuntimeError, the default), ``exit``
(``os._exit(1)``, no report), ``kill`` (SIGKILL to itself, no report) or
``hang`` (sleeps forever). ``exit``, ``kill`` and ``hang`` print one line from
that rank saying so, which is how the tests time them. ``GUIDE_FAIL_PHASE=save``
moves the failure into the checkpoint save of step ``GUIDE_FAIL_STEP`` (state
written, checkpoint not yet complete; see helpers.job.checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from helpers import CHECKOUT

LOCK = ".lock"
GRACE_S = 2.0  # how long rank 0 waits for the other ranks' reports
FAIL_MODES = ("raise", "exit", "kill", "hang")
_REPO = CHECKOUT


class JobStop(RuntimeError):
    """A failure that is its own explanation (e.g. a memory budget passed): reported as one ``error:`` line,
    without a traceback."""


class OutDirError(ValueError):
    """``--out`` cannot be used; the message says why and what to do."""


def error_file(out: str | os.PathLike, rank: int) -> Path:
    return Path(out) / f"error_rank{rank}.txt"


# --------------------------------------------------------------------------- the run-directory lock


def claim_out_dir(path: str | os.PathLike):
    """Lock ``path`` for this process and empty it of an earlier run; return the open lock file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutDirError(f"--out {p}: is a file, not a directory; give a directory path for the run")
    names = {e.name for e in p.iterdir()} if p.is_dir() else set()
    if names and not names & {"config.json", "summary.json"} and not all(
            n == LOCK or n.startswith("error_rank") for n in names):
        raise OutDirError(f"--out {p}: directory exists, is not empty and is not a run directory; "
                          "pick a new path so nothing else is overwritten")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutDirError(f"--out {p}: cannot create the directory: {e.strerror}") from None
    lock = _lock(p / LOCK)
    for e in p.iterdir():  # an earlier run in this directory: this one replaces it
        if e.name != LOCK:
            shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
    return lock


def refuse_if_busy(path: str | os.PathLike) -> None:
    """An ``--out`` a live job holds, refused before the slow checks (its lock taken, dropped: claim_out_dir claims)."""
    with contextlib.suppress(OSError), open(Path(path) / LOCK) as f:  # no lock file: no live job there
        _flock(f, Path(path) / LOCK)


def _flock(f, path: Path) -> None:
    """Lock the open lock file ``path``, or raise OutDirError naming the job that holds it."""
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise OutDirError(f"--out {path.parent} is in use by a running job ({f.read().strip() or 'another job'}); "
                          "wait for it to finish or pick another --out") from None


def _lock(path: Path):
    for _ in range(5):
        f = open(path, "a+")  # noqa: SIM115 - held for the life of the job
        try:
            _flock(f, path)
        except OutDirError:
            f.close()
            raise
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:  # not unlinked by a finishing job
                f.truncate(0)
                f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%H:%M:%S')}\n")
                f.flush()
                return f
        f.close()
    raise OutDirError(f"--out {path.parent}: could not take {path} (it keeps changing); try again")


def _unlock(f, path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    f.close()


# --------------------------------------------------------------------------- failure reports


def _short(filename: str) -> str:
    p = Path(filename)
    with contextlib.suppress(ValueError):
        return str(p.resolve().relative_to(_REPO))
    parts = p.parts
    return "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else p.name


def _frames(frames, n: int = 3) -> list[str]:
    return [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in frames[-n:]]


def write_report(out, rank: int, kind: str, step: int, reason: str, where: list[str], details: str) -> bool:
    """Write ``error_rank{rank}.txt`` if the run directory is visible from here; True when written."""
    p = error_file(out, rank)
    if not (p.parent / LOCK).exists() and not (p.parent / "config.json").exists():
        return False  # another node without a shared filesystem: rank 0 cannot read it
    lines = [f"rank: {rank}", f"kind: {kind}", f"time: {time.time():.6f}", f"step: {step}",
             f"host: {socket.gethostname()}", f"pid: {os.getpid()}", "reason: " + " ".join(reason.split()),
             *[f"where: {w}" for w in where], "---", details]
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, p)
    return True


def read_report(path: Path) -> dict | None:
    try:
        head, _, details = path.read_text().partition("\n---\n")
    except OSError:
        return None
    rep: dict = {"where": [], "details": details.rstrip()}
    for line in head.splitlines():
        key, _, value = line.partition(": ")
        if key == "where":
            rep["where"].append(value)
        else:
            rep[key] = value
    if not {"rank", "kind", "time", "reason"} <= set(rep):
        return None  # half-written
    rep.update(rank=int(rep["rank"]), time=float(rep["time"]), step=int(rep.get("step", -1)))
    return rep


def _dead(pid: int) -> bool:
    """True when a process on this host is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


# --------------------------------------------------------------------------- the guard


class JobGuard:
    """One per rank: fault hooks, watchdog, SIGTERM, and the single way out of a failed job."""

    def __init__(self, out: str, rank: int, world_size: int, timeout: float):
        self.out, self.rank, self.world_size, self.timeout = out, rank, world_size, timeout
        self.step = 0
        self.peers: dict[int, tuple[str, int]] = {}  # rank -> (host, pid)
        self._last = time.monotonic()
        self._abort = threading.Lock()
        self._closed = False
        self._retired = False  # finished, and a later job of this process has its own guard
        self._on_fail = None
        self._lockfile = None
        self.fault = fault_plan()
        self.fault_phase = os.environ.get("GUIDE_FAIL_PHASE", "step")
        if self.fault_phase not in ("step", "save"):
            raise ValueError(f"GUIDE_FAIL_PHASE = {self.fault_phase!r}: allowed values are step, save")

    # ---- set-up
    def claim(self) -> None:
        """Rank 0, before the process group: take --out (raises OutDirError)."""
        self._lockfile = claim_out_dir(self.out)

    def start(self, on_fail) -> None:
        """Install the SIGTERM route and start the watchdog; ``on_fail(rank, reason, message)`` writes the
        failed summary (rank 0)."""
        self._on_fail = on_fail
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.signal(signal.SIGTERM, lambda *_: None)  # the watchdog acts on it, even while main is in C
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="guide-watchdog", daemon=True).start()

    def connect(self) -> None:
        """After init_process_group: learn every rank's host and pid, to spot a rank that dies silently."""
        import torch.distributed as dist

        got: list = [None] * self.world_size
        dist.all_gather_object(got, (socket.gethostname(), os.getpid()))
        self.peers = dict(enumerate(got))

    # ---- during the job
    def progress(self, step: int) -> None:
        self.step, self._last = step, time.monotonic()

    def fault_hook(self, step: int, phase: str = "step") -> None:
        rank, at, mode = self.fault
        if rank != self.rank or step != at or phase != self.fault_phase:
            return
        if mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank} at step {step} "
                               "(test hook GUIDE_FAIL_RANK/GUIDE_FAIL_STEP)")
        print(f"[rank {rank}] test hook GUIDE_FAIL_MODE={mode} at step {step}", file=sys.stderr, flush=True)
        if mode == "exit":
            os._exit(1)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)

    def finish(self, write, last: bool = True) -> None:
        """Main thread, the job completed: ``write()`` the summary, release --out; SIGTERM kills again. Not
        ``last`` (another job of this process follows, the family sweep): the watchdog stops here."""
        with self._abort:
            write()
            self._closed, self._last = True, time.monotonic()
            self._release()
            self._retired = not last
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # ---- the way out
    def fail(self, exc: BaseException):
        """Main thread: this rank raised. Report, let rank 0 write the summary, exit 1."""
        where = _frames(traceback.extract_tb(exc.__traceback__))
        if isinstance(exc, JobStop):
            self._die("stop", str(exc), where, "")
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._die("error", f"{type(exc).__name__}: {exc}", where, tb)

    def _watch(self, rfd: int) -> None:
        while not self._retired:
            ready, _, _ = select.select([rfd], [], [], 0.5)
            if ready and signal.SIGTERM in os.read(rfd, 512):
                self._die("signal", "stopped by SIGTERM (torchrun stops every rank when one fails; or the "
                          "job was interrupted)", self._main_where(), "")
            if time.monotonic() - self._last > self.timeout:
                self._die("timeout", f"timed out: no training step finished for {self.timeout:g} s "
                          f"(--timeout {self.timeout:g}) at step {self.step}; a rank is stuck or waiting "
                          "for a peer", self._main_where(), "")
        os.close(rfd)  # retired: this job's SIGTERM pipe is no longer read

    def _main_where(self) -> list[str]:
        frame = sys._current_frames().get(threading.main_thread().ident)
        return _frames(traceback.extract_stack(frame)) if frame else []

    def _die(self, kind: str, reason: str, where: list[str], details: str):
        """Report and exit 1, once per process, whichever thread gets here first."""
        with self._abort:
            code = 1
            try:
                if self._closed:  # completed and written: only teardown is left (stuck, or stopped)
                    code = 0 if kind == "timeout" else 1
                    return
                self._report(kind, reason, where, details)
            except BaseException as e:  # noqa: BLE001 - whatever happens, the process must end
                print(f"error: rank {self.rank}: while reporting a failure: {type(e).__name__}: {e}",
                      file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def _report(self, kind: str, reason: str, where: list[str], details: str) -> None:
        # only into our own job's directory: rank 0 holds its lock; the others once they met rank 0
        ours = self._lockfile is not None if self.rank == 0 else bool(self.peers)
        written = ours and write_report(self.out, self.rank, kind, self.step, reason, where, details)
        if self.rank != 0:
            if not written and kind != "signal":  # rank 0 cannot see our report (another node): say it here
                print(f"error: rank {self.rank} failed at step {self.step}: {reason}", file=sys.stderr)
            return
        own = {"rank": 0, "kind": kind, "time": time.time(), "step": self.step, "reason": reason,
               "where": where, "details": details}
        failed_rank, why, message = self._verdict(own)
        print(message, file=sys.stderr, flush=True)
        try:
            if self._on_fail is not None:
                self._on_fail(failed_rank, why, message)
        finally:
            self._release()

    def _release(self) -> None:
        if self._lockfile is not None:
            _unlock(self._lockfile, Path(self.out) / LOCK)
            self._lockfile = None

    # ---- rank 0: who failed?
    def _verdict(self, own: dict) -> tuple[int | None, str, str]:
        """(failed_rank, reason, message): a rank that died silently, else the first error or timeout."""
        reports, silent = self._gather(own)
        if silent:
            r = silent[0]
            why = (f"rank {r} (pid {self.peers[r][1]}) died without reporting an error: killed by a signal "
                   "(SIGKILL, out of memory?) or crashed")
            return r, why, self._message([f"error: {why}", f"  rank 0 then saw: {own['reason']}"], r)
        causes = sorted((r for r in reports.values() if r["kind"] in ("error", "stop", "timeout")),
                        key=lambda r: r["time"])
        first = causes[0] if causes else own
        if first["kind"] == "error":
            r = first["rank"]
            lines = [f"error: rank {r} failed at step {first['step']}: {first['reason']}"]
            tail = [ln for ln in first["details"].splitlines()[:-1]  # the last line is the reason above
                    if ln.strip() and not ln.startswith("Traceback") and ln.strip(" ^~") != ""][-6:]
            if tail:
                lines += [f"  last lines of rank {r}'s traceback:"] + [f"  {ln}" for ln in tail]
            return r, first["reason"], self._message(lines, r)
        lines = [f"error: {first['reason']}"]
        if first["kind"] == "stop":  # JobStop: the reason says it all
            return first["rank"], first["reason"], self._message(lines, None)
        if first["kind"] == "timeout":
            lines.append("  where each rank was (innermost call first):")
            lines += [f"    rank {r}: {' <- '.join(reversed(rep['where'])) or '?'}"
                      for r, rep in sorted(reports.items())]
        return None, first["reason"], self._message(lines, None)

    def _gather(self, own: dict) -> tuple[dict[int, dict], list[int]]:
        """Reports from every rank (own included) and the ranks on this host that died without one."""
        deadline = time.monotonic() + GRACE_S
        host = socket.gethostname()
        while True:
            reports = {0: own}
            for r in range(1, self.world_size):
                rep = read_report(error_file(self.out, r))
                if rep is not None:
                    reports[r] = rep
            dead = [r for r, (h, pid) in sorted(self.peers.items())
                    if r != 0 and r not in reports and h == host and _dead(pid)]
            for r in dead:  # it may have written its report and exited since we read: a dead rank's file is final
                rep = read_report(error_file(self.out, r))
                if rep is not None:
                    reports[r] = rep
            silent = [r for r in dead if r not in reports]
            peer_cause = any(rep["kind"] in ("error", "stop") for r, rep in reports.items() if r != 0)
            if silent or peer_cause or len(reports) == self.world_size or time.monotonic() > deadline:
                return reports, silent
            time.sleep(0.1)

    def _message(self, lines: list[str], rank: int | None) -> str:
        err = error_file(self.out, rank) if rank is not None else None
        files = f"{err}, " if err is not None and err.exists() else ""
        return "\n".join(lines + [f"  details: {files}{Path(self.out) / 'summary.json'} (status failed)"])


def fault_plan() -> tuple[int | None, int, str]:
    """(rank, step, mode) from the GUIDE_FAIL_* test hooks; raises ValueError on a bad value."""
    rank, step = os.environ.get("GUIDE_FAIL_RANK"), os.environ.get("GUIDE_FAIL_STEP", "0")
    mode = os.environ.get("GUIDE_FAIL_MODE", "raise")
    if mode not in FAIL_MODES:
        raise ValueError(f"GUIDE_FAIL_MODE = {mode!r}: allowed values are {', '.join(FAIL_MODES)}")
    for name, v in (("GUIDE_FAIL_RANK", rank), ("GUIDE_FAIL_STEP", step)):
        if v is not None and not v.isdigit():
            raise ValueError(f"{name} = {v!r}: expected a rank/step number >= 0")
    return (int(rank) if rank is not None else None), int(step), mode
