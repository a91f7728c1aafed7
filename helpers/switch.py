"""Does my job train the same under the other backend? ``python -m helpers.switch``

    python -m helpers.switch --config launch_configs/fsdp/full_shard.yaml --model tiny
    python -m helpers.switch --config my_fsdp.yaml --model my_model/config.json --shrink
    python -m helpers.switch --config a.yaml --to b.yaml --model tiny --nproc 4 --steps 4
    python -m helpers.switch --config launch_configs/fsdp/full_shard.yaml --families all

Translates A to the other backend (``helpers.translate``; ``--to B`` takes B as given), runs both jobs in one
``torchrun`` launch (one process group, every job through ``helpers.train``'s phases, on the GPUs if there are
any, else on the CPU with gloo), each with ``--trace-activations`` and, where both configs can be traced,
``--trace-tensors`` (helpers.job.observe.tensor_trace.check); then prints

1. the settings the two runs used, side by side, differences first, read from their ``summary.json``
   (``effective``, ``dtypes``, the bytes rank 0 held): what the config files asked for is not enough;
2. the verdict: identical (losses, gradient norms and every traced tensor, bit for bit), or the first
   differing step and tensor (``helpers.compare``);
3. when they part, the first module whose output (forward) or output gradient (backward) differs, and the
   known cause where the guide knows one (``helpers.core.causes``, each with the test that checks it).

``--shrink`` keeps the architecture of a config.json and scales its sizes down (helpers.core.shrink), so a
7B config is checked on a laptop. ``--families NAMES|all`` checks the guide's model families instead of one
model. Other ``helpers.train`` flags (``--peft``, ``--seq-len``, ...) go to both jobs. Everything is written to
``--out`` (runs, configs, and ``switch.json``, which notebooks read). Exit status: 0 identical, 1 the runs
differ, 2 bad input or a job that could not run (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.core.cli import OneLineParser, first_line

SIZE = ["--micro-batch", "2", "--seq-len", "16"]  # the sweeps' size; a later --seq-len etc. overrides it


class SwitchError(ValueError):
    """Bad input or a job that could not run; the message is the one line to print."""


# --------------------------------------------------------------------------- the two configs and the models


def configs(a: str, to: str | None, out: Path) -> tuple[str, str, list[str]]:
    """(A, B, translation warnings): B is --to, or A translated to the other backend and written to OUT/configs."""
    from helpers.core.config import ConfigError, load_job_config
    from helpers.translate import translate

    try:
        job = load_job_config(a)
        if to:
            load_job_config(to)
            return a, to, []
        t = translate(a, "deepspeed" if job.backend == "fsdp" else "fsdp")
        path = out / "configs" / f"{Path(a).stem}_as_{t.to}.yaml"
        t.write(str(path))
        load_job_config(str(path))
    except ConfigError as e:
        raise SwitchError(str(e)) from None
    return a, str(path), t.warnings


def models(model: str | None, families: str | None, shrink_it: bool, out: Path) -> tuple[dict[str, str], list]:
    """({label: --model value}, shrink changes): one model, or the guide's families (helpers.core.families)."""
    from helpers.core.families import FAMILIES, write_config

    if families:
        names = list(FAMILIES) if families == "all" else [n for n in families.split(",") if n]
        bad = [n for n in names if n not in FAMILIES]
        if bad or not names:
            raise SwitchError(f"--families {families}: allowed all or a comma-separated list of {', '.join(FAMILIES)}")
        return {n: str(write_config(n, out / "models")) for n in names}, []
    from helpers.core.models import ModelSpecError, model_config, resolve_model

    try:
        spec = resolve_model(model)
        if not shrink_it:
            model_config(spec)
            return {Path(model).stem if spec.kind != "preset" else model: model}, []
        if spec.kind == "preset":
            raise SwitchError(f"--shrink: --model {model} is a preset, already small; pass a config.json")
        from helpers.core.shrink import shrink

        path = spec.path if spec.kind == "config" else os.path.join(spec.path, "config.json")
        small, changes = shrink(json.loads(Path(path).read_text()))
        label = Path(path).parent.name if Path(path).name == "config.json" else Path(path).stem
        dest = out / "models" / f"{label}_shrunk.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(small, indent=2))
        _builds(model_config(resolve_model(str(dest))), model)
        return {label: str(dest)}, changes
    except ModelSpecError as e:
        raise SwitchError(str(e)) from None


def _builds(cfg, model: str) -> None:
    """The shrunk model builds (on the meta device: no memory), or one line saying it does not."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # transformers' own check of the shrunk sizes: shown in one line
        raise SwitchError(f"--shrink: the shrunk config of {model} does not build ({first_line(e)}); "
                          "shrink it by hand and pass it without --shrink") from None


# --------------------------------------------------------------------------- running both jobs


def plan(a: str, b: str, labels: dict[str, str], out: Path, steps: int, extra: list[str]) -> tuple[list, str | None]:
    """([(name, helpers.train argv)]: for every model, A then B; why there are no tensor traces, or None)."""
    from helpers.core.config import load_job_config
    from helpers.job.observe.tensor_trace import check

    if "--compile" in extra:
        raise SwitchError("--compile: the switch traces every module eagerly (--trace-activations); drop --compile")
    why = check(load_job_config(a)) or check(load_job_config(b))
    tensors = [] if why else ["--trace-tensors"]
    jobs = [(f"{label}/{side}", ["--config", cfg, "--out", str(out / "runs" / label / side), "--model", m,
                                 "--steps", str(steps), *SIZE, "--trace-activations", *tensors, *extra])
            for label, m in labels.items() for side, cfg in (("a", a), ("b", b))]
    return jobs, why


def launch(jobs: list, out: Path, nproc: int) -> dict:
    """Run every job in one torchrun launch (helpers.job.sweep.run_jobs); returns the verdicts."""
    (out / "plan.json").write_text(json.dumps(jobs, indent=1))
    result = out / "plan_result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "helpers.switch", "--plan", str(out / "plan.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not result.is_file():
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        raise SwitchError((errors[0][len("error: "):] if errors else f"the jobs failed (exit {proc.returncode}): "
                           + " | ".join(proc.stderr.strip().splitlines()[-3:])) + f" (logs: {out / 'runs'})")
    verdicts = json.loads(result.read_text())
    refused = {n: v["why"] for n, v in verdicts.items() if v["verdict"] == "refused"}
    if refused:
        name, why = next(iter(refused.items()))
        raise SwitchError(f"{name} ({'A' if name.endswith('/a') else 'B'}): {why}")
    return verdicts


def worker(plan_file: str) -> int:
    """Under torchrun: run the plan's jobs in one process group; rank 0 writes the verdicts."""
    from helpers.job.state import env_int
    from helpers.job.sweep import run_jobs

    jobs = json.loads(Path(plan_file).read_text())
    verdicts = run_jobs([(n, argv) for n, argv in jobs])
    if env_int("RANK", 0) == 0:
        Path(plan_file).with_name("plan_result.json").write_text(json.dumps(verdicts, indent=1))
    return 0


# --------------------------------------------------------------------------- reading the two runs


def main(argv=None) -> int:
    ap = OneLineParser(prog="python -m helpers.switch", description="Does my job train the same under the other "
                       "backend? Runs both, prints the settings side by side, the verdict, the first differing module "
                       "and the known cause; other helpers.train flags go to both jobs (docs/switching.md)")
    ap.add_argument("--plan", help=argparse.SUPPRESS)  # the worker's entry, under torchrun
    ap.add_argument("--config", help="launch config A (FSDP or DeepSpeed)")
    ap.add_argument("--to", help="the other config (default: --config translated to the other backend)")
    ap.add_argument("--model", help="a preset, a config.json, or a directory holding one")
    ap.add_argument("--families", help="all, or a comma-separated list of the guide's model families (instead "
                    "of --model)")
    ap.add_argument("--shrink", action="store_true", help="keep --model's architecture, scale its sizes down")
    ap.add_argument("--nproc", type=int, help="ranks (default: the GPUs, else 2)")
    ap.add_argument("--steps", type=int, default=3, help="steps each job trains (default 3)")
    ap.add_argument("--out", help="run directory (default: runs/switch/NAME)")
    args, extra = ap.parse_known_args(argv)
    if args.plan:
        return worker(args.plan)
    from helpers.switch_report import report

    try:
        if not args.config or bool(args.model) == bool(args.families):
            raise SwitchError("pass --config and one of --model or --families")
        if args.steps < 1:
            raise SwitchError(f"--steps = {args.steps}: must be >= 1")
        nproc = args.nproc if args.nproc is not None else _default_nproc()
        if nproc < 1:
            raise SwitchError(f"--nproc = {nproc}: must be >= 1")
        if not Path(args.config).is_file():
            raise SwitchError(f"--config {args.config}: no such file")
        out = Path(args.out or Path("runs/switch") / f"{Path(args.config).stem}_{Path(args.model or 'families').stem}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "switch.json").unlink(missing_ok=True)  # a stale verdict never outlives a failed run
        a, b, warnings = configs(args.config, args.to, out)
        labels, changes = models(args.model, args.families, args.shrink, out)
        if changes:
            print(f"shrunk: {'; '.join(changes)}", flush=True)
        for w in warnings:
            print(f"translation warning: {w}", flush=True)
        jobs, untraced = plan(a, b, labels, out, args.steps, extra)
        launch(jobs, out, nproc)
    except SwitchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(out, a, b, list(labels), warnings, untraced)


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as helpers.train: skip a teardown that gloo's threads can abort
