"""The family sweep: every model of helpers.core.families trained under one launch config, in one process group.

    torchrun --standalone --nproc_per_node 2 -m helpers.families \\
        --config launch_configs/deepspeed/zero3.yaml --out runs/families_zero3 --steps 3

Each family is one job through the job's own phases (helpers.job.run: validate, start, the guard and its
``--timeout``, the observers, ``--trace-tensors``), at tiny width (micro-batch 2, sequence 16), writing
``OUT/NAME`` like any job (config.json, metrics.jsonl, summary.json, tensor_trace.jsonl), so
``python -m helpers.compare`` reads them. Only the process group is shared: a job per family would pay
torchrun's and DeepSpeed's start-up ten times. Rank 0 prints one line per family (its losses). Other
``helpers.train`` flags (``--timeout``, ``--model-dtype``, ...) pass through to every family's job.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from helpers.core.cli import OneLineParser
from helpers.core.families import FAMILIES, write_config


def family_args(config: str, out: Path, name: str, steps: int, extra: list[str]) -> list[str]:
    """The helpers.train command line of one family's job."""
    return ["--config", config, "--out", str(out / name), "--model", str(out / "configs" / f"{name}.json"),
            "--steps", str(steps), "--micro-batch", "2", "--seq-len", "16", "--trace-tensors", *extra]


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m helpers.families", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names (default: all)")
    args, extra = ap.parse_known_args(argv)
    names = [n for n in args.families.split(",") if n]
    bad = [n for n in names if n not in FAMILIES] or ([] if names else ["(none)"])
    if bad:
        print(f"error: --families {','.join(bad)}: allowed {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    from helpers.job.run import parse_args, run, start, validate

    out = Path(args.out)
    for name in names:  # every rank writes the same file (atomically): no process group exists yet
        tmp = write_config(name, out / "configs" / f".{name}.{os.getpid()}")
        os.replace(tmp, out / "configs" / f"{name}.json")
        tmp.parent.rmdir()
    for i, name in enumerate(names):
        s = validate(parse_args(family_args(args.config, out, name, args.steps, extra)))
        start(s)
        with contextlib.redirect_stdout(io.StringIO()):  # each job's lines are in its log.txt; errors still show
            run(s, join=i == 0, leave=i == len(names) - 1)
        if s.rank == 0:
            print(f"{name}: losses {s.summary['losses']}", flush=True)
    return 0
