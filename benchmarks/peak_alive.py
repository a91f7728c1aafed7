"""What is alive at a job's peak: the tensors behind ``peak_tensor_bytes``, grouped by the op that made them.

    python benchmarks/peak_alive.py --nproc 2 -- --config launch_configs/deepspeed/zero3.yaml \\
        --model small --steps 3 --micro-batch 8 --seq-len 64 --out runs/peak_alive
    python benchmarks/peak_alive.py --nproc 2 --within guide::backward -- ...   # the peak inside backward

Runs one real ``helpers.train`` job under torchrun (everything after ``--`` is its arguments). Each rank
reads the same profiler events as ``helpers.job.observe.tensor_peak`` (CPU: every allocation and free of the CPU
allocator, with the running total), finds the peak of the window (or, with ``--within NAME``, the
largest total reached by an allocation made inside a region of that name, e.g. ``guide::backward``,
``guide::optimizer_step``), and lists the allocations still alive at that instant, matched to their
frees by address, grouped by the chain of ops that made them (``aten::cat < guide::forward``: a
tensor made by a ``cat`` in forward). Writes ``OUT/peak_alive.rank{R}.json`` and prints each rank's
largest groups. On a GPU the job's peak comes from the allocator, not from these events: CPU only.
This is how the estimator's ZeRO-3 terms were found (``helpers/estimate.py``). Not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = "PEAK_ALIVE_WITHIN"  # set for the ranks: the region to look in ("" for the window's peak)


def chain(event, depth: int = 4) -> str:
    names, p = [], event.parent
    while p is not None and len(names) < depth:
        names.append(p.name)
        p = p.parent
    return " < ".join(names) or "(outside any op)"


def alive_at_peak(roots, within: str | None) -> dict:
    """The window's peak (or the largest total reached inside ``within``) and what is alive there."""
    from helpers.job.observe.tensor_peak import cpu_allocations

    start, allocs = cpu_allocations(roots)
    if start is None:
        raise SystemExit("peak_alive: the job never reached its measured window (did it run 2 steps?)")
    events = [(t, total, e.extra_fields.alloc_size, e.extra_fields.ptr, e) for t, total, e in allocs]
    window = [i for i, x in enumerate(events) if x[0] >= start]
    if within:
        window = [i for i in window if within in chain(events[i][4], depth=64)]
        if not window:
            raise SystemExit(f"peak_alive: no allocation inside {within!r} in the window")
    peak = max(window, key=lambda i: events[i][1])
    live: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    freed_first: dict[int, int] = {}  # a free recorded before its allocation at the same nanosecond
    for t, _, size, ptr, e in events[: peak + 1]:
        if size > 0:
            if freed_first.get(ptr) == t:
                del freed_first[ptr]
            else:
                live[ptr].append((size, e))
        elif live[ptr]:
            live[ptr].popleft()
        else:
            freed_first[ptr] = t  # or a tensor made before the profiler started
    groups, counts = collections.Counter(), collections.Counter()
    for q in live.values():
        for size, e in q:
            groups[chain(e)] += size
            counts[chain(e)] += 1
    return {"peak_bytes": events[peak][1], "alive_bytes": sum(groups.values()), "at": chain(events[peak][4]),
            "within": within, "groups": [{"ops": k, "bytes": v, "tensors": counts[k]} for k, v in groups.most_common()]}


def worker(out: Path, within: str | None, job_args: list[str]) -> int:
    """One rank: the job itself, with job.observe.tensor_peak's window reader wrapped to also write the listing."""
    import helpers.job.observe.tensor_peak as tp
    import helpers.job.run as train

    read = tp.window_peak

    def window_peak(roots):
        roots = list(roots)
        listing = alive_at_peak(roots, within)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"peak_alive.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(listing, indent=1))
        return read(roots)

    tp.window_peak = window_peak
    code = train.main(job_args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # as the job entry does (gloo's threads at interpreter exit)


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("usage: python benchmarks/peak_alive.py [--nproc N] [--within NAME] [--top K] -- "
                 "JOB ARGS (with --out)")
    ours, job_args = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--within", help="the peak inside regions of this name (default: the window's peak)")
    ap.add_argument("--top", type=int, default=12, help="groups printed per rank")
    a = ap.parse_args(ours)
    if "--out" not in job_args:
        sys.exit("peak_alive: the job's arguments need --out DIR (the listing is written there)")
    out = Path(job_args[job_args.index("--out") + 1])
    if WORKER in os.environ:  # a rank, started by the torchrun below
        return worker(out, os.environ[WORKER] or None, job_args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO),
           WORKER: a.within or ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           "--no-python", sys.executable, __file__, "--", *job_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env)
    if proc.returncode:
        return proc.returncode
    mib = 2**20
    for r in range(a.nproc):
        d = json.loads((out / f"peak_alive.rank{r}.json").read_text())
        print(f"rank {r}: peak {d['peak_bytes'] / mib:.1f} MiB{' inside ' + a.within if a.within else ''} "
              f"(at {d['at'][:90]}); alive and matched to an allocation: {d['alive_bytes'] / mib:.1f} MiB")
        for g in d["groups"][: a.top]:
            print(f"  {g['bytes'] / mib:9.1f} MiB {g['tensors']:5d} tensors  {g['ops'][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
