"""``--reuse DIR``: a completed run of the same job in DIR is copied to ``--out`` instead of training again.

    torchrun --standalone --nproc_per_node 2 -m helpers.train --config launch_configs/fsdp/full_shard.yaml \\
        --out notebooks/runs/10_fsdp --model tiny --steps 40 --reuse notebooks/runs/00_fsdp

A deep-dive notebook runs its core notebook's jobs again so that it can be opened alone; with ``--reuse``
it takes the core notebook's run instead, when that run is the same job. "The same job" is ``job_key``:
every flag but ``--out`` and ``--reuse``, the bytes of every file a flag names (the launch config, a model
config.json), the number of ranks and nodes, the host, and every file under ``helpers/`` and
``launch_configs/``. Every job records its key in ``summary.json``. Anything else (no run in DIR, a failed
or running one, another key) and the job runs as usual, with a ``note:`` saying why it did not reuse.

Each rank decides alone, before any process group, from DIR's ``summary.json`` (written last by a job);
only rank 0 copies and prints. DIR must not be a job that is running or about to start: a job that starts
there empties it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository: helpers/ and launch_configs/
CODE = ("helpers", "launch_configs")
NOT_FLAGS = ("out", "reuse")


def code_files(root: Path) -> list[Path]:
    """Every file under helpers/ and launch_configs/ (no caches), in a fixed order."""
    files = [p for top in CODE for p in (root / top).rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def job_key(args, world_size: int) -> str:
    """sha256 of what decides a job's result: its flags (not --out, --reuse), the files they name, ranks,
    nodes, host and the guide's code."""
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in NOT_FLAGS}
    h = hashlib.sha256(json.dumps({"flags": flags, "world_size": world_size,
                                   "nodes": os.environ.get("GROUP_WORLD_SIZE", "1"),
                                   "host": socket.gethostname()}, sort_keys=True, default=str).encode())
    for k, v in flags.items():
        if isinstance(v, str) and os.path.isfile(v):
            h.update(f"\0{k}\0".encode() + Path(v).read_bytes())
    for p in code_files(ROOT):
        h.update(b"\0" + p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def why_not(args, world_size: int, key: str | None = None) -> str | None:
    """None when ``args.reuse`` holds a completed run of this same job; else why not (one phrase).
    ``key``: this job's ``job_key``, when the caller has it already."""
    src, out = Path(args.reuse), Path(args.out)
    if src.resolve() == out.resolve():
        return "it is --out itself"
    try:
        summary = json.loads((src / "summary.json").read_text())
    except (OSError, ValueError):
        return "no finished run there"
    if summary.get("status") != "completed":
        return f"its run did not complete: status {summary.get('status')!r}"
    if summary.get("job_key") != (key or job_key(args, world_size)):
        return "its run is another job: its flags, the files they name, ranks, host or code differ"
    return None


def try_reuse(args) -> str | None:
    """Copy DIR to --out (rank 0) when it holds this same job; return None then. Else the ``note:`` to log.
    The copy's summary says where it came from (``reused_from``) and the key this job computed for itself
    (``reuse_key``), which a reader can compare with the ``job_key`` DIR's own job recorded."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mine = job_key(args, world_size)  # hashes the guide's code: once
    why = why_not(args, world_size, mine)
    if why is not None:
        return f"--reuse {args.reuse}: not reused, {why}; the job runs"
    if int(os.environ.get("RANK", "0")) == 0:
        from helpers.job.guard import LOCK, _unlock, claim_out_dir

        src, out = Path(args.reuse), Path(args.out)
        try:
            lock = claim_out_dir(out)  # --out: refused if another job holds it; an earlier run there is replaced
        except ValueError as e:  # OutDirError: one line, exit 2, as a job's bad --out
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        try:
            for e in src.iterdir():
                if e.name != LOCK:
                    (shutil.copytree if e.is_dir() else shutil.copy2)(e, out / e.name)
            for name, new in (("config.json", {"out": str(out)}),  # say where it came from, and what asked
                              ("summary.json", {"reused_from": str(src), "reuse_key": mine})):
                d = json.loads((out / name).read_text())
                (out / name).write_text(json.dumps({**d, **new}, indent=2))
            line = f"reused {src}: the same job, completed; copied to {out}"
            with open(out / "log.txt", "a") as f:
                f.write(line + "\n")
        finally:
            _unlock(lock, out / LOCK)
        done = [ln for ln in (src / "log.txt").read_text().splitlines() if ln.startswith("done:")]
        print(f"{done[-1].rsplit('; wrote', 1)[0]}; {line}" if done else line, flush=True)
    return None
