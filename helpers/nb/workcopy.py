"""The learner's working copy of the notebooks: runs and autosaves never touch the repo's files.

    python -m helpers.workcopy            # make work/ on first use (make lab does this)
    python -m helpers.workcopy --refresh  # fresh copies from the repo; your edited ones move aside

``work/`` (ignored by git) holds ``notebooks/NN_topic.ipynb`` (copies of the repo's notebooks,
committed outputs included, unpaired, so JupyterLab's autosave writes only the copy) and links to
the repo's ``helpers``, ``launch_configs``, ``benchmarks`` and ``tests``. A notebook opened there
runs from ``work/`` (``nb.setup`` changes into it), so its relative paths work unchanged:
``launch_configs/...`` is read through the link and ``notebooks/runs/...`` lands in
``work/notebooks/runs``. ``--refresh`` keeps the runs and moves the copies it replaces to
``work/notebooks/previous/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from helpers import CHECKOUT

REPO = CHECKOUT
MARKER = ".guide-workcopy"  # nb.setup looks for it next to the notebooks' folder
LINKS = ("helpers", "launch_configs", "benchmarks", "tests")


def notebooks() -> list[Path]:
    return sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb"))


def copy_notebook(src: Path, dst: Path) -> None:
    """The notebook with its outputs, minus jupytext's pairing (a paired copy would write a .py beside it)."""
    nb = json.loads(src.read_text())
    nb.get("metadata", {}).pop("jupytext", None)
    dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def make(root: Path, refresh: bool = False) -> list[str]:
    """Create (or refresh) the working copy at ``root``; return one line per thing done."""
    done = []
    nbdir = root / "notebooks"
    nbdir.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("a working copy of the notebooks; python -m helpers.workcopy --refresh\n")
    for name in LINKS:
        link = root / name
        if not link.is_symlink() and not link.exists():
            link.symlink_to(os.path.relpath(REPO / name, root), target_is_directory=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for src in notebooks():
        dst = nbdir / src.name
        if dst.exists() and not refresh:
            continue
        if dst.exists():
            old = nbdir / "previous" / stamp
            old.mkdir(parents=True, exist_ok=True)
            shutil.move(dst, old / dst.name)
            done.append(f"moved your {dst.name} to {old.relative_to(root.parent)}/")
        copy_notebook(src, dst)
        done.append(f"copied {src.relative_to(REPO)} -> {dst.relative_to(root.parent)}")
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.workcopy", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(REPO / "work"), help="where the working copy lives (default: work/)")
    ap.add_argument("--refresh", action="store_true", help="copy the repo's notebooks again (yours move aside)")
    args = ap.parse_args(argv)
    root = Path(args.dir).resolve()
    if root.exists() and any(root.iterdir()) and not (root / MARKER).exists():
        print(f"error: --dir {args.dir}: exists and is not a working copy (no {MARKER}); "
              "name an empty or new directory", file=sys.stderr)
        return 2
    for line in make(root, args.refresh):
        print(f"workcopy: {line}")
    return 0
