"""Sweeps in one process group: every model family under one launch config, or every launch config of a directory.

    torchrun --standalone --nproc_per_node 2 -m helpers.families \\
        --config launch_configs/deepspeed/zero3.yaml --out runs/families_zero3 --steps 3

Each family is one job through the job's own phases (helpers.job.run: validate, start, the guard and its
``--timeout``, the observers, ``--trace-tensors``), at tiny width (micro-batch 2, sequence 16), writing
``OUT/NAME`` like any job (config.json, metrics.jsonl, summary.json, tensor_trace.jsonl, activation_trace.jsonl), so
``python -m helpers.compare`` reads them. Only the process group is shared: a job per family would pay
torchrun's and DeepSpeed's start-up ten times. Rank 0 prints one line per family (its losses). Other
``helpers.train`` flags (``--timeout``, ``--model-dtype``, ...) pass through to every family's job.

    torchrun --standalone --nproc_per_node 2 -m helpers.variants DIR --out runs/variants --steps 2

The config sweep: every ``DIR/*.yaml`` is one job (``tiny``, micro-batch 2, sequence 16), through the same
phases. A config the job refuses (one ``error:`` line when run alone) is skipped before the group starts;
rank 0 prints ``NAME: trained ...`` or ``NAME: refused: WHY`` per config, and writes ``OUT/variants.json``.
A config that starts and then fails ends the sweep as it ends a job (status 1, naming the config).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
from pathlib import Path

from helpers.core.cli import OneLineParser
from helpers.core.families import FAMILIES, write_config
from helpers.job.state import env_int


def family_args(config: str, out: Path, name: str, steps: int, extra: list[str]) -> list[str]:
    """The helpers.train command line of one family's job."""
    return ["--config", config, "--out", str(out / name), "--model", str(out / "configs" / f"{name}.json"),
            "--steps", str(steps), "--micro-batch", "2", "--seq-len", "16", "--trace-tensors", "--trace-activations",
            *extra]


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
        with contextlib.redirect_stdout(io.StringIO()), one_job_only():  # each job's lines are in its log.txt
            run(s, join=i == 0, leave=i == len(names) - 1)
        if s.rank == 0:
            print(f"{name}: losses {s.summary['losses']}", flush=True)
    return 0


@contextlib.contextmanager
def one_job_only():
    """Undo, after a job, what it changed process-wide: ZeRO-3 with memory_efficient_linear replaces
    torch.nn.functional.linear for the whole process (fact deepspeed.zero3_swaps_linear), and the next job of a
    sweep, FSDP's included, would compute with DeepSpeed's linear."""
    import torch

    linear = torch.nn.functional.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


class Refused(ValueError):
    """A config the job would refuse with one ``error:`` line (exit 2) when run alone."""


def _refuse(rank: int, msg: str) -> None:
    raise Refused(msg)


def run_jobs(jobs: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """Each (name, helpers.train argv) checked first (a refused one costs no start-up and is skipped), then run
    one after the other in one process group. Returns {name: {"verdict": "trained", "losses", "notes"} or
    {"verdict": "refused", "why"}}. A job that starts and then fails ends the sweep as it ends a job."""
    from helpers.job.run import parse_args, run, start, validate

    verdicts, ready = {}, []
    for name, argv_job in jobs:  # every check before the process group
        try:
            ready.append((name, validate(parse_args(argv_job), refuse=_refuse)))
        except Refused as e:
            verdicts[name] = {"verdict": "refused", "why": str(e)}
    for i in range(len(ready)):
        name, s = ready[i]
        ready[i] = None  # this job's model and engine go once it ends: the next job's peaks are its own
        start(s)
        if s.rank == 0:
            print(f"{name}: starting", flush=True)  # a job that then fails is the last one named
        with contextlib.redirect_stdout(io.StringIO()), one_job_only():  # each job's lines are in its log.txt
            run(s, join=i == 0, leave=i == len(ready) - 1)
        verdicts[name] = {"verdict": "trained", "losses": s.summary["losses"], "notes": s.job.notes}
        del s
        gc.collect()
    return verdicts


def variants_main(argv=None) -> int:
    import json

    ap = OneLineParser(prog="python -m helpers.variants", description="Every launch config of DIR trained (or "
                                                                      "refused) in one process group")
    ap.add_argument("dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    args, extra = ap.parse_known_args(argv)
    configs = sorted(Path(args.dir).glob("*.yaml"))
    if not configs:
        print(f"error: {args.dir}: no *.yaml launch configs there", file=sys.stderr)
        return 2
    out = Path(args.out)
    verdicts = run_jobs([(cfg.stem, ["--config", str(cfg), "--out", str(out / cfg.stem), "--model", args.model,
                                     "--steps", str(args.steps), "--micro-batch", "2", "--seq-len", "16", *extra])
                         for cfg in configs])
    if env_int("RANK", 0) == 0:
        for name in sorted(verdicts):
            v = verdicts[name]
            print(f"{name}: trained, losses {v['losses']}" if v["verdict"] == "trained" else
                  f"{name}: refused: {v['why']}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "variants.json").write_text(json.dumps(verdicts, indent=1))
    return 0
