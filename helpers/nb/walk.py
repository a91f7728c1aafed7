"""The batch walk of notebooks 08 and 18: per row, the largest micro-batch whose job fits a memory budget.

    python -m helpers.nb.walk --prefix 08 --nproc 2 --budget 0.015 KEY:CONFIG:START ... -- --model tiny ...

Each row starts at START (at least 1) and runs one real job per micro-batch (``torchrun -m helpers.train
... --micro-batch B --memory-budget-gib BUDGET``, into ``RUNS/PREFIX_KEY_bB``): up one sequence at a time
while the batch fits, down while it does not, until a batch that fits sits next to one that does not (or
1 does not fit). It prints each job's last line. ``--reuse P``: a job that ``RUNS/P_KEY_bB`` already ran
(same flags, ranks and code) is copied from there (``helpers.train --reuse``).

``read(prefix, keys)`` reads the runs back ({key: {batch: summary}}); ``largest`` is a row's answer and
``failures`` lists the runs that ended for another reason than the budget.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

RUNS = Path("notebooks/runs")


def _row_dirs(prefix: str, key: str) -> dict[int, Path]:
    """{micro-batch: run directory} of one row of a walk (``RUNS/PREFIX_KEY_bB``)."""
    return {int(d.name.rsplit("_b", 1)[1]): d for d in RUNS.glob(f"{prefix}_{key}_b*")
            if re.fullmatch(rf"{re.escape(prefix)}_{re.escape(key)}_b\d+", d.name)}


def _job(out: Path, config: str, batch: int, a: argparse.Namespace, extra: list[str]) -> bool:
    """One job into ``out``; prints its last line; True when it completed (fit the budget)."""
    shutil.rmtree(out, ignore_errors=True)
    reuse = ["--reuse", str(RUNS / f"{a.reuse}_{out.name.split('_', 1)[1]}")] if a.reuse else []
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node", str(a.nproc), "-m", "helpers.train",
                    "--config", config, "--out", str(out), *extra, "--micro-batch", str(batch),
                    "--memory-budget-gib", str(a.budget), *reuse], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    log = (out / "log.txt").read_text().splitlines() if (out / "log.txt").exists() else []
    last = [ln for ln in log if ln.startswith(("done:", "error:", "reused "))]
    print(f"{out.name[len(a.prefix) + 1:]}: {last[-1] if last else 'no log: the job did not start'}", flush=True)
    return any(ln.startswith("done:") for ln in log)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m helpers.nb.walk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--budget", type=float, required=True)
    ap.add_argument("--reuse", help="the prefix of an earlier walk whose identical jobs are copied")
    ap.add_argument("rows", nargs="+", metavar="KEY:CONFIG:START")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    for row in a.rows:
        key, config, start = row.split(":")
        for old in _row_dirs(a.prefix, key).values():  # this row's runs from an earlier execution
            shutil.rmtree(old)
        b = max(1, int(start))
        if _job(RUNS / f"{a.prefix}_{key}_b{b}", config, b, a, extra):
            while _job(RUNS / f"{a.prefix}_{key}_b{b + 1}", config, b + 1, a, extra):
                b += 1
        else:
            while b > 1 and not _job(RUNS / f"{a.prefix}_{key}_b{b - 1}", config, b - 1, a, extra):
                b -= 1
    return 0


def read(prefix: str, keys) -> dict[str, dict[int, dict]]:
    """{key: {micro-batch: summary.json}} of a walk's runs, from the run directories."""
    return {key: {b: json.loads((d / "summary.json").read_text()) for b, d in _row_dirs(prefix, key).items()}
            for key in keys}


def largest(runs: dict[int, dict]) -> int:
    """The largest batch that fit below the smallest one that did not (0: none)."""
    first_over = min((b for b, s in runs.items() if not s["memory_budget_fits"]), default=max(runs) + 1)
    return max((b for b, s in runs.items() if s["memory_budget_fits"] and b < first_over), default=0)


def walked(runs: dict[int, dict], start: int) -> bool:
    """Whether a row's runs are a finished walk from ``start``: it began there, moved one sequence a
    job, and ended with a batch that fits next to one that does not."""
    bs, top = sorted(runs), largest(runs)
    return (max(start, 1) in runs and bs == [*range(bs[0], bs[-1] + 1)] and top + 1 in runs
            and not runs[top + 1]["memory_budget_fits"])


def order(runs: dict[int, dict]) -> list[int]:
    """A row's batches in the order its jobs started (each summary's ``started_at``)."""
    return sorted(runs, key=lambda b: runs[b]["started_at"])


def in_order(runs: dict[int, dict], start: int) -> bool:
    """Whether a row's jobs ran ``start`` first, then one sequence up or down a job (by start time)."""
    o = order(runs)
    return bool(o) and o[0] == max(start, 1) and all(abs(b - a) == 1 for a, b in zip(o, o[1:], strict=False))


def failures(walked: dict[str, dict[int, dict]]) -> dict[str, str]:
    """The runs that ended for another reason than the budget: {"KEY bB": reason}."""
    return {f"{k} b{b}": s["reason"] for k, runs in walked.items() for b, s in runs.items()
            if s["status"] != "completed" and "--memory-budget-gib" not in (s.get("reason") or "")}


if __name__ == "__main__":
    sys.exit(main())
