"""Committed outputs that cannot go stale: each executed .ipynb records a hash of what it ran on.

    python -m helpers.nb.freshness stale            # the notebooks whose outputs are stale, one stem a line
    python -m helpers.nb.freshness finish NB.ipynb  # after an execution: tidy the outputs, record the hash
    python -m helpers.nb.freshness prose NB.py      # prose-only edit: copy the .py's markdown into the .ipynb
    python -m helpers.nb.freshness minutes          # words, cells, minutes to read and to run, per notebook

What a notebook ran on is its code cells (as the .py source holds them) and every file under helpers/
and launch_configs/. A markdown edit does not make outputs stale (no markdown cell runs); `make
notebooks` copies it over with `prose`. `finish` also merges each cell's stream outputs into whole lines
(the kernel sends them in pieces cut mid-word) and drops the saved widget state (tens of KB a notebook,
redrawn when the cell runs).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from helpers.job.reuse import code_files

REPO = Path(__file__).resolve().parent.parent.parent
KEY = "guide"  # notebook metadata: {"guide": {"ran_on": HASH}}


def _code_cells(py: Path) -> list[str]:
    import jupytext

    return [c.source.strip() for c in jupytext.read(py).cells if c.cell_type == "code"]


def tree_hash(py: Path) -> str:
    """sha256 over the notebook's code cells and every file under helpers/ and launch_configs/ (of the
    repository the notebook sits in)."""
    root = py.resolve().parent.parent
    h = hashlib.sha256()
    for src in _code_cells(py):
        h.update(b"cell\0" + src.encode() + b"\0")
    for p in code_files(root):
        h.update(b"file\0" + p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def recorded_hash(ipynb: Path) -> str | None:
    if not ipynb.is_file():
        return None
    return json.loads(ipynb.read_text()).get("metadata", {}).get(KEY, {}).get("ran_on")


def stale(notebooks: list[Path] | None = None) -> list[Path]:
    """The .py sources whose .ipynb is missing or was executed on another tree."""
    sources = notebooks or sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py"))
    return [py for py in sources if recorded_hash(py.with_suffix(".ipynb")) != tree_hash(py)]


def merge_streams(outputs: list[dict]) -> list[dict]:
    """Consecutive outputs of one stream become one; a line cut by the other stream's output is finished
    where it was cut (its tail moves up to it), so every stored stream output ends in whole lines."""
    merged: list[dict] = []
    for o in outputs:
        if o.get("output_type") != "stream":
            merged.append(o)
            continue
        text = "".join(o["text"]) if isinstance(o["text"], list) else o["text"]
        same = [m for m in merged if m.get("output_type") == "stream" and m["name"] == o["name"]]
        if same and not same[-1]["text"].endswith("\n"):  # finish the cut line where it started
            head, nl, text = text.partition("\n")
            same[-1]["text"] += head + nl
        if not text:
            continue
        if merged and merged[-1].get("output_type") == "stream" and merged[-1]["name"] == o["name"]:
            merged[-1]["text"] += text
        else:
            merged.append({**o, "text": text})
    return merged


def finish(ipynb: Path) -> None:
    """Merge streams, drop widget state, record the hash of the tree the outputs came from."""
    nb = json.loads(ipynb.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = merge_streams(cell.get("outputs", []))
    nb["metadata"].pop("widgets", None)
    nb["metadata"][KEY] = {"ran_on": tree_hash(ipynb.with_suffix(".py"))}
    import nbformat

    nbformat.write(nbformat.from_dict(nb), str(ipynb))


def prose(py: Path) -> bool:
    """Copy the .py's markdown cells into the fresh .ipynb (outputs and hash kept). False if the code differs."""
    import jupytext
    import nbformat

    ipynb = py.with_suffix(".ipynb")
    src, nb = jupytext.read(py), nbformat.read(str(ipynb), as_version=4)
    if [(c.cell_type, c.source.strip()) for c in src.cells if c.cell_type == "code"] != \
            [(c.cell_type, c.source.strip()) for c in nb.cells if c.cell_type == "code"]:
        return False
    if [c.source.strip() for c in src.cells] == [c.source.strip() for c in nb.cells]:
        return True  # nothing to copy: leave the file (and its time stamp) alone
    code = iter([c for c in nb.cells if c.cell_type == "code"])
    nb.cells = [next(code) if c.cell_type == "code" else nbformat.v4.new_markdown_cell(c.source) for c in src.cells]
    nbformat.write(nb, str(ipynb))
    return True


def size(ipynb: Path) -> dict:
    """Words of prose, cells, and minutes to read (200 words a minute) and to run (the sum of the code cells'
    execution times in the committed outputs: the full-size pass that made them)."""
    import datetime as dt
    import re

    nb = json.loads(ipynb.read_text())
    words = sum(len(re.findall(r"\w+", "".join(c["source"]))) for c in nb["cells"] if c["cell_type"] == "markdown")
    run_s = 0.0
    for c in nb["cells"]:
        ex = c.get("metadata", {}).get("execution", {})
        a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
        if c["cell_type"] == "code" and a and b:
            run_s += (dt.datetime.fromisoformat(b.replace("Z", "+00:00"))
                      - dt.datetime.fromisoformat(a.replace("Z", "+00:00"))).total_seconds()
    return {"words": words, "cells": len(nb["cells"]), "read_min": words / 200, "run_min": run_s / 60}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stale"]:
        for py in stale([Path(a).resolve() for a in argv[1:]] or None):
            print(py.relative_to(Path.cwd()).as_posix() if py.is_relative_to(Path.cwd()) else py)
        return 0
    if argv == ["minutes"]:
        totals = {"core path (00-09)": [0.0, 0.0], "whole guide": [0.0, 0.0]}
        for ipynb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
            z = size(ipynb)
            print(f"{ipynb.stem:20s} {z['words']:5d} words {z['cells']:3d} cells  read {z['read_min']:4.1f} min  "
                  f"run {z['run_min']:4.1f} min")
            for key in totals if int(ipynb.stem[:2]) < 10 else ["whole guide"]:
                totals[key][0] += z["read_min"]
                totals[key][1] += z["run_min"]
        for key, (read, run) in totals.items():
            print(f"{key:20s} read {read:5.1f} min  run {run:5.1f} min  together {read + run:5.1f} min")
        return 0
    if len(argv) == 2 and argv[0] == "finish":
        finish(Path(argv[1]).resolve())
        return 0
    if len(argv) == 2 and argv[0] == "prose":
        if not prose(Path(argv[1]).resolve()):
            print(f"error: {argv[1]}: its code cells differ from the .ipynb's: execute it (make notebooks)",
                  file=sys.stderr)
            return 1
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
