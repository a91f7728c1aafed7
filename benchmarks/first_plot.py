"""Fresh clone to notebook 00's side-by-side plot, timed (goal: <= 5 minutes on a 2-core box).

    python benchmarks/first_plot.py                 # clones this checkout's HEAD into a temp dir
    python benchmarks/first_plot.py --keep /tmp/fp  # ... into /tmp/fp, left there afterwards

What a learner does, step by step: ``git clone``; ``make setup`` (what ``make lab`` runs first);
the working copy ``make lab`` serves (``python -m helpers.workcopy``); then notebook 00's cells in
order, in a python3 kernel of the clone's .venv (as JupyterLab's kernel runs them; no browser here:
``make test-browser`` drives the real JupyterLab), until a cell shows a figure. Prints each step's
wall time and the total. Not a test: run it on an idle box (pip's cache as a learner's first
install would find it; DeepSpeed's ops build from scratch, into the clone).
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
NOTEBOOK = "work/notebooks/00_launching.ipynb"

# run in the clone's own Python: executes the notebook cell by cell, stops at the first figure
RUN_TO_FIRST_FIGURE = r"""
import sys, time, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": sys.argv[2]}})
with client.setup_kernel():
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        client.execute_cell(cell, i)
        if any("image/png" in out.get("data", {}) for out in cell.outputs):
            print(f"first figure: code cell {i} of {len(nb.cells)}")
            sys.exit(0)
sys.exit("no figure in notebook 00")
"""


def step(name: str, cmd: list[str], cwd: Path, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"error: {name} ({' '.join(cmd)}) failed after {took:.0f} s:\n{(proc.stdout + proc.stderr)[-3000:]}")
    print(f"{name:<28} {took:6.1f} s", flush=True)
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="clone here and leave it (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    base = args.keep or Path(tempfile.mkdtemp(prefix="first_plot_"))
    clone = base / "fsdp-deepspeed-guide"
    if clone.exists():
        sys.exit(f"error: --keep {base}: {clone} exists already; name an empty or new directory")
    # a learner's shell: not this checkout's venv, nor its DeepSpeed op builds
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(str(REPO)))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "PYTHONPATH")}
    env["PATH"] = path
    try:
        times = [step("git clone", ["git", "clone", "-q", str(REPO), str(clone)], base, env),
                 step("make setup", ["make", "setup"], clone, env),
                 step("working copy (make lab)", [".venv/bin/python", "-m", "helpers.workcopy"], clone, env),
                 step("notebook 00 to its figure", [".venv/bin/python", "-c", RUN_TO_FIRST_FIGURE, NOTEBOOK,
                                                    str(clone / "work/notebooks")], clone, env)]
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'fresh clone -> first plot':<28} {sum(times):6.1f} s ({sum(times) / 60:.1f} min; goal <= 5 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
