"""Translate an Accelerate FSDP config into the DeepSpeed one that trains the same way, and back.

    python -m helpers.translate launch_configs/fsdp/full_shard.yaml --to deepspeed -o runs/ds.yaml
    python -m helpers.translate launch_configs/deepspeed/zero3.yaml --to fsdp

The mapping comes from ``helpers.core.mapping`` (``MODES``/``COUNTERPARTS`` for
sharding, ``SETTINGS`` for the rest: offload, loading, checkpoint format,
prefetch, mixed precision, accumulation, clipping). Every key of the input is
either translated or reported: a ``warning:`` line names the key, the value,
why there is no exact counterpart and the nearest choice that was written; a
``note:`` line reports keys that only matter to logging or the launcher.
Nothing is dropped silently. No warnings means the translation is exact.

A DeepSpeed translation is a YAML plus a DeepSpeed JSON (``OUT.json`` next to
``OUT.yaml``): the JSON carries what Accelerate's inline keys cannot
(``gradient_clipping: "auto"``, hpZ, prefetch buckets). Without ``-o`` both
are printed. The output is checked with ``helpers.config`` before it is
written; bad input exits 2 with one ``error:`` line.

The rules of each direction are ``helpers.core.fsdp_to_deepspeed`` and
``helpers.core.deepspeed_to_fsdp`` (what they fill in: ``helpers.core.translation``);
this module runs them, checks the result and writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

from helpers.core.config import ConfigError, JobConfig, load_job_config
from helpers.core.config_keys import _read_yaml
from helpers.core.deepspeed_to_fsdp import _deepspeed_to_fsdp
from helpers.core.fsdp_to_deepspeed import _fsdp_to_deepspeed
from helpers.core.translation import Translation

# --------------------------------------------------------------------------- entry points


def translate(path: str, to: str) -> Translation:
    """Translate one launch config; raises ConfigError (one line) on bad input."""
    if to not in ("deepspeed", "fsdp"):
        raise ConfigError(f"--to = {to!r}: allowed values are deepspeed, fsdp")
    job = load_job_config(path)
    if job.backend == to:
        raise ConfigError(f"{path}: already a {to} config (distributed_type "
                          f"{'FSDP' if to == 'fsdp' else 'DEEPSPEED'}); translate it --to "
                          f"{'deepspeed' if to == 'fsdp' else 'fsdp'}")
    raw = _read_yaml(path)
    t = Translation(path, to, {})
    (_fsdp_to_deepspeed if to == "deepspeed" else _deepspeed_to_fsdp)(raw, job, t)
    return t


def check(t: Translation, out: str | None = None) -> JobConfig:
    """Validate the translation with helpers.config (written to ``out``, or to a temporary directory)."""
    if out:
        t.write(out)
        return load_job_config(out)
    with tempfile.TemporaryDirectory() as tmp:
        p = t.write(os.path.join(tmp, Path(t.source).stem + f"_{t.to}.yaml"))[0]
        return load_job_config(str(p))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.translate", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--to", required=True, choices=["deepspeed", "fsdp"])
    ap.add_argument("-o", "--out", help="write OUT.yaml (+ OUT.json for DeepSpeed); default: print them")
    args = ap.parse_args(argv)
    try:
        t = translate(args.config, args.to)
        if args.out and Path(args.out).suffix not in (".yaml", ".yml"):
            raise ConfigError(f"-o {args.out}: expected a .yaml or .yml file name")
        check(t, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in t.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for n in t.notes:
        print(f"note: {n}", file=sys.stderr)
    if args.out:
        print(f"wrote {args.out}" + (f" and {Path(args.out).with_suffix('.json')}" if t.json else "")
              + (" (exact)" if t.exact else f" ({len(t.warnings)} warning{'s' if len(t.warnings) != 1 else ''})"))
    else:
        name = Path(args.config).stem + f"_{args.to}"
        data = dict(t.yaml)
        if t.json is not None:
            data["deepspeed_config"] = {"deepspeed_config_file": f"{name}.json", **data["deepspeed_config"]}
        sys.stdout.write(t.header() + yaml.safe_dump(data, sort_keys=False))
        if t.json is not None:
            sys.stdout.write(f"# ---- {name}.json\n" + json.dumps(t.json, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
