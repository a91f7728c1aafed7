"""Wall time of each notebook at its committed (full) size, as `make notebooks` runs it.

    python benchmarks/notebooks.py                   # every notebooks/NN_*.py, full size
    python benchmarks/notebooks.py 00 03 --size quick

Executes each notebook's source in a fresh kernel (jupytext --execute into a scratch copy,
so the committed .ipynb is left alone) and prints one line per notebook and the totals,
against the budgets: the core path (00-09) 4 minutes a notebook and 20 in all, the whole
guide (core and the deep dives, 10 and up) 30. Not a test: the numbers depend on the
machine and its load; run it on an idle box.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUDGET_S, CORE_BUDGET_S, GUIDE_BUDGET_S = 240, 1200, 1800  # a core notebook, the core path, the whole guide


def is_core(stem: str) -> bool:
    """The core path is 00-09; 10 and up are deep dives (1N goes deeper into notebook 0N)."""
    return int(stem[:2]) < 10


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="notebook numbers (e.g. 00 03); default: all")
    ap.add_argument("--size", default="full", choices=["full", "quick"], help="GUIDE_SIZE for the run")
    args = ap.parse_args(argv)
    sources = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py"))
    sources = [p for p in sources if not args.only or p.name[:2] in args.only]
    if not sources:
        print(f"error: no notebook matches {args.only}", file=sys.stderr)
        return 2
    env = {**os.environ, "GUIDE_SIZE": args.size, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": "ignore::FutureWarning", "GUIDE_PROGRESS": "0"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    total, core, failed = 0.0, 0.0, []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            scratch = REPO / "notebooks" / f".bench_{src.stem}.py"  # next to the others: same relative paths
            shutil.copy(src, scratch)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "jupytext", "--to", "ipynb", "--set-kernel", "python3",
                                   "--execute", str(scratch), "-o", str(Path(tmp) / f"{src.stem}.ipynb")],
                                  cwd=REPO, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            scratch.unlink(missing_ok=True)
            total += seconds
            core += seconds if is_core(src.stem) else 0.0
            verdict = "ok" if proc.returncode == 0 else "FAILED"
            if proc.returncode:
                failed.append(src.stem)
            over = "  over a core notebook's 4 minutes" if is_core(src.stem) and seconds > BUDGET_S else ""
            print(f"{src.stem:<20} {seconds / 60:5.1f} min  {verdict}{over}", flush=True)
            if proc.returncode:
                print("  " + "\n  ".join(proc.stderr.strip().splitlines()[-5:]))
    print(f"{'core path':<20} {core / 60:5.1f} min  (budget {CORE_BUDGET_S // 60} min, size {args.size})")
    print(f"{'total':<20} {total / 60:5.1f} min  (budget {GUIDE_BUDGET_S // 60} min for the guide, "
          f"size {args.size})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
