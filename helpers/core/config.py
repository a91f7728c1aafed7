"""Accelerate-format launch configs -> one validated, typed JobConfig.

The YAML files in ``launch_configs/`` use Accelerate's own keys, so a learner
can take them unchanged to ``accelerate launch --config_file``. This module
reads them, checks every key and value, and refuses bad input *before* any
rank starts, with one line naming the file, the key, the value and what is
allowed.

Check a file without launching anything::

    python -m helpers.config launch_configs/fsdp/full_shard.yaml --world-size 2

Exit status 0 and a summary when the file is good, 2 and one ``error:`` line
when it is not.

This module reads a file top to bottom (``load_job_config``), applies the CLI's
overrides and is where callers import from. The parts live next to it:
``config_types`` (JobConfig and its option dataclasses), ``config_keys`` (which
keys exist, the rule each follows or why it has no effect here, and the checker),
``config_fsdp`` and ``config_deepspeed`` (each backend's section).
"""

from __future__ import annotations

import argparse
import sys
from typing import Literal

from helpers.core.config_deepspeed import LINEAR_NOTE, _deepspeed_options
from helpers.core.config_fsdp import _fsdp_options
from helpers.core.config_keys import (
    _SECTIONS,
    _TOP_READ,
    LAUNCHER_ONLY,
    _Checker,
    _read_yaml,
    accelerate_keys,
    no_effect_reason,
)
from helpers.core.config_types import (
    Backend,
    ConfigError,
    DeepSpeedOptions,
    FSDPOptions,
    JobConfig,
    ModelDtype,
    OptimizerImpl,
    Precision,
    Sharding,
    TrainOptions,
)

# What callers import from here (some of it defined in the modules above).
__all__ = [
    "LAUNCHER_ONLY", "LINEAR_NOTE", "Backend", "ConfigError", "DeepSpeedOptions", "FSDPOptions", "JobConfig",
    "ModelDtype", "OptimizerImpl", "Precision", "Sharding", "TrainOptions", "accelerate_keys", "adamw_kwargs",
    "load_job_config", "main", "no_effect_reason", "optimizer_impl_notes", "resolve_model_dtype", "unapplied_notes",
]


def unapplied_notes(job: JobConfig) -> list[str]:
    """One `note:` line per key in the file that Accelerate accepts and this guide cannot apply (train.py logs
    them)."""
    return [f"{key} = {value!r}: no effect here: {why}" for key, (value, why) in job.unapplied.items()]


def load_job_config(path: str, overrides: dict | None = None, world_size: int | None = None) -> JobConfig:
    """Read and validate a launch config, then apply CLI overrides.

    ``world_size`` (when known) lets the check refuse layouts that cannot run.
    Raises ConfigError with a one-line message.
    """
    c = _Checker(path)
    raw = _read_yaml(path)
    top = accelerate_keys()[""]
    for k, v in raw.items():
        if k not in top:
            c.unknown("", k, top)
        if k in _SECTIONS and k not in _TOP_READ:
            c.section(raw, k, {})  # fp8_config, megatron_lm_config, ...: keys checked, each noted
        elif k not in _TOP_READ:
            c.no_effect("", k, v)
    dt = c.value("distributed_type", raw.get("distributed_type"), ["FSDP", "DEEPSPEED"])
    for other in ("fsdp_config", "deepspeed_config"):
        if raw.get(other) and other != {"FSDP": "fsdp_config", "DEEPSPEED": "deepspeed_config"}[dt]:
            c.fail(f"{other} is given but distributed_type is {dt}")
    train = _train_options(c, overrides or {})
    if dt == "FSDP":
        fsdp, notes = _fsdp_options(c, raw, world_size)
        mp = c.value("mixed_precision", raw.get("mixed_precision") or "no", ["no", "bf16"])
        job = JobConfig(path, "fsdp", mp, train, fsdp=fsdp, notes=notes)
    else:
        if raw.get("parallelism_config"):
            c.fail("parallelism_config is an FSDP2 setting; for DeepSpeed hybrid sharding "
                   "set zero_optimization.zero_hpz_partition_size in the JSON")
        ds, mp, notes = _deepspeed_options(c, raw)
        job = JobConfig(path, "deepspeed", mp, train, deepspeed=ds, notes=notes)
        _merge_ds_training(c, job, overrides or {})
        if (ds.json.get("bf16") or {}).get("enabled") == "auto" and job.train.model_dtype == "fp32":
            job.mixed_precision = "no"  # bf16.enabled "auto": an fp32 model trains in fp32
        hpz = ds.json.get("zero_optimization", {}).get("zero_hpz_partition_size", 1)
        if not isinstance(hpz, int) or hpz < 1:
            c.fail(f"zero_optimization.zero_hpz_partition_size = {hpz!r}: expected an integer >= 1")
        if hpz > 1 and world_size is not None and (world_size % hpz or hpz == world_size):
            c.fail(f"zero_optimization.zero_hpz_partition_size = {hpz}: must divide the world size "
                   f"({world_size}) into 2 or more groups (hpZ needs {2 * hpz} ranks here); run it on "
                   f"{2 * hpz} ranks (--nproc_per_node {2 * hpz}), or on {world_size} use deepspeed/zero3.yaml "
                   "(no secondary groups)")
    if world_size is not None and world_size < 1:
        c.fail(f"world size {world_size}: must be >= 1")
    job.train.model_dtype = resolve_model_dtype(c, job)
    job.notes += optimizer_impl_notes(job)
    job.unapplied = c.unapplied
    return job


def adamw_kwargs(t: TrainOptions) -> dict:
    """The torch AdamW both backends step: lr, weight decay and --optimizer-impl (for-loop, foreach, fused)."""
    return dict(lr=t.lr, weight_decay=t.weight_decay, foreach=t.optimizer_impl == "foreach",
                fused=t.optimizer_impl == "fused")


def optimizer_impl_notes(job: JobConfig) -> list[str]:
    """What --optimizer-impl does here, when it is not the parity mode (for-loop)."""
    impl = job.train.optimizer_impl
    if job.backend == "deepspeed" and "optimizer" in job.deepspeed.json:
        if impl == "for-loop":
            return []
        return [f"--optimizer-impl {impl}: no effect, the DeepSpeed config's optimizer section builds the "
                "optimizer (torch's own foreach/fused default then applies)"]
    if impl == "for-loop":
        return []
    return [f"--optimizer-impl {impl}: AdamW steps with {impl}=True, for throughput; FSDP and DeepSpeed then "
            "group the update differently (per parameter tensor vs flat partitions), so bit-identical losses "
            "across backends are not promised (the parity mode is for-loop, the default)"]


def resolve_model_dtype(c: _Checker, job: JobConfig) -> Literal["bf16", "fp32"]:
    """The dtype the model is loaded in ("auto" resolved); the backend then decides what to upcast.

    ``auto`` is bf16 - the seeds' setup, a checkpoint loaded in bf16 - so the FSDP
    config's ``mixed_precision`` alone picks the mode: ``bf16`` upcasts to fp32 shards
    (aligned with DeepSpeed), ``no`` trains in bf16 end to end (memory-constrained).
    DeepSpeed with bf16 disabled trains in fp32, so there ``auto`` is fp32 and bf16 is refused.
    """
    want = job.train.model_dtype
    ds_fp32 = job.backend == "deepspeed" and job.mixed_precision == "no"
    if want == "auto":
        return "fp32" if ds_fp32 else "bf16"
    if want == "bf16" and ds_fp32:
        c.fail("--model-dtype = 'bf16' needs bf16.enabled = true in the DeepSpeed config (with it off, "
               "DeepSpeed expects an fp32 model); allowed here: fp32, auto")
    return want


def _train_options(c: _Checker, overrides: dict) -> TrainOptions:
    t = TrainOptions()
    rules = {"model": str, "steps": int, "lr": float, "seed": int, "micro_batch": int,
             "seq_len": int, "grad_accum": int, "grad_clip": float, "weight_decay": float, "timeout": float,
             "model_dtype": ["auto", "bf16", "fp32"], "compile": bool,
             "optimizer_impl": ["for-loop", "foreach", "fused"]}
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in rules:
            c.unknown("override ", k, rules)
        setattr(t, k, c.value(f"--{k.replace('_', '-')}", v, rules[k]))
    for k in ("steps", "micro_batch", "seq_len", "grad_accum"):
        if getattr(t, k) < 1:
            c.fail(f"--{k.replace('_', '-')} = {getattr(t, k)}: must be >= 1")
    for k in ("lr", "grad_clip", "weight_decay"):
        if getattr(t, k) < 0:
            c.fail(f"--{k.replace('_', '-')} = {getattr(t, k)}: must be >= 0")
    if not 0 < t.timeout < float("inf"):
        c.fail(f"--timeout = {t.timeout}: must be a number of seconds > 0 (default 600)")
    if t.seq_len < 2:
        c.fail(f"--seq-len = {t.seq_len}: must be >= 2 (a causal LM predicts the next token)")
    return t


def _merge_ds_training(c: _Checker, job: JobConfig, overrides: dict) -> None:
    """Accumulation and clipping: one value, from the CLI or the DeepSpeed config, never two."""
    js = job.deepspeed.json
    for ds_key, attr, rule in (("gradient_accumulation_steps", "grad_accum", int),
                               ("gradient_clipping", "grad_clip", float)):
        v = js.get(ds_key, "auto")
        if v == "auto":
            continue
        v = c.value(ds_key, v, rule)
        cli = overrides.get(attr)
        if cli is not None and cli != v:
            c.fail(f"--{attr.replace('_', '-')} {cli} conflicts with {ds_key} = {v} in the DeepSpeed "
                   "config; change one of them or write \"auto\" there")
        setattr(job.train, attr, v)
    if "gradient_clipping" not in js:
        job.train.grad_clip = 1.0  # DeepSpeed's own default
        if overrides.get("grad_clip") is not None and overrides["grad_clip"] != 1.0:
            c.fail(f"--grad-clip {overrides['grad_clip']}: the DeepSpeed config does not set "
                   "gradient_clipping, so DeepSpeed clips at 1.0; set it there")


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.config", description="Validate a launch config.")
    ap.add_argument("config")
    ap.add_argument("--world-size", type=int, default=None, help="check the layout against N ranks")
    args = ap.parse_args(argv)
    try:
        job = load_job_config(args.config, world_size=args.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = job.backend.upper()
    if job.fsdp:
        what += f" {job.fsdp.sharding} (reshard_after_forward={job.fsdp.reshard_after_forward})"
    if job.deepspeed:
        what += f" ZeRO-{job.deepspeed.zero_stage}"
    print(f"ok: {args.config}: {what}, mixed_precision={job.mixed_precision}")
    for n in job.notes + unapplied_notes(job):
        print(f"note: {n}")
    return 0
