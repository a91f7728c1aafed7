"""The post-wrap audit, in every job: did wrapping keep the model the config describes?

Before the backend wraps the model (``before``) the job notes every parameter's name, ``requires_grad``,
dtype and element count, and which names share one parameter (tied weights: ``named_parameters
(remove_duplicate=False)`` giving one object under two names, e.g. a tied ``lm_head.weight``). After
``fully_shard`` or ``deepspeed.initialize`` (``after``) it checks, by name:

* tied names are still one parameter object (one storage, so one gradient and one update);
* each parameter's dtype is the one the config asks for at this stage (``expected_dtype``);
* ``requires_grad`` is unchanged, and so is every element count (FSDP's DTensor and ZeRO-3's ``ds_numel``
  give the whole parameter's count), hence the model's total.

The result goes to ``summary.json`` (``audit``) and the log; a failed audit ends the job with one line naming
the parameter (``AuditError``, reported as a JobStop). ``GUIDE_FAIL_AUDIT=requires_grad`` (a test hook)
flips the first parameter's flag after wrapping, to show that line.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import torch

from helpers.core.models import clean_fqn
from helpers.job.guard import JobStop


@dataclass
class Snapshot:
    requires_grad: dict[str, bool] = field(default_factory=dict)
    dtype: dict[str, torch.dtype] = field(default_factory=dict)
    numel: dict[str, int] = field(default_factory=dict)
    obj: dict[str, int] = field(default_factory=dict)  # id() of the parameter object under each name

    def tied(self) -> list[list[str]]:
        groups: dict[int, list[str]] = {}
        for name, i in self.obj.items():
            groups.setdefault(i, []).append(name)
        return [sorted(g) for g in groups.values() if len(g) > 1]


def snapshot(module: torch.nn.Module) -> Snapshot:
    """Every parameter under every name it has (tied ones twice), whole counts (FSDP2, ZeRO-3 or plain)."""
    s = Snapshot()
    for name, p in module.named_parameters(remove_duplicate=False):
        n = clean_fqn(name)
        s.requires_grad[n], s.dtype[n], s.obj[n] = p.requires_grad, p.dtype, id(p)
        s.numel[n] = int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 leaves p empty; DTensor: the whole
    return s


def expected_dtype(job, ds_json: dict | None, built: torch.dtype, trainable: bool) -> torch.dtype:
    """The dtype a parameter is stored in once wrapped, as the config asks.

    FSDP (Accelerate's rule): under ``mixed_precision: bf16`` trainable parameters are upcast to fp32 (the
    optimizer steps them), frozen ones stay as built; under ``no`` nothing changes. DeepSpeed: with
    ``bf16.enabled`` (or ``fp16.enabled``) the engine casts every parameter of the module to it (the fp32
    copy is the optimizer's master, apart); otherwise nothing changes."""
    if job.backend == "fsdp":
        return torch.float32 if job.mixed_precision == "bf16" and trainable else built
    js = ds_json or {}
    if (js.get("bf16") or {}).get("enabled") is True:
        return torch.bfloat16
    if (js.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    return built


class AuditError(JobStop):
    """Wrapping changed the model: the message names the parameter."""


def compare(before: Snapshot, after: Snapshot, want) -> list[str]:
    """Every difference, one line each (``want(name) -> dtype``); [] when the audit passes."""
    problems = []
    missing = sorted(set(before.numel) - set(after.numel))
    if missing:
        problems.append(f"{missing[0]} is gone after wrapping ({len(missing)} names missing)")
    for group in before.tied():
        if len({after.obj.get(n) for n in group}) != 1:
            problems.append(f"{group[0]} is no longer tied to {', '.join(group[1:])}: two parameters now, "
                            "each with its own gradient and update")
    for name in before.numel:
        if name not in after.numel:
            continue
        if after.requires_grad[name] != before.requires_grad[name]:
            problems.append(f"{name}: requires_grad was {before.requires_grad[name]}, is "
                            f"{after.requires_grad[name]} after wrapping")
        if after.numel[name] != before.numel[name]:
            problems.append(f"{name}: {before.numel[name]} elements before wrapping, {after.numel[name]} after")
        if after.dtype[name] != want(name):
            problems.append(f"{name}: dtype {_short(after.dtype[name])} after wrapping, the config asks for "
                            f"{_short(want(name))}")
    return problems


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def audit(module: torch.nn.Module, before: Snapshot, job, ds_json: dict | None) -> dict:
    """The audit of a wrapped ``module`` against ``before``: the summary's ``audit``; AuditError when it fails."""
    if os.environ.get("GUIDE_FAIL_AUDIT") == "requires_grad":  # test hook: one flag flipped by "the backend"
        p = next(module.parameters())
        p.requires_grad_(not p.requires_grad)
    after = snapshot(module)

    def want(name):
        return expected_dtype(job, ds_json, before.dtype[name], before.requires_grad[name])

    problems = compare(before, after, want)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise AuditError(f"audit after wrapping: {problems[0]}{more}")
    unique = {after.obj[n]: n for n in after.obj}.values()
    return {"passed": True, "parameters": len(unique), "numel": sum(after.numel[n] for n in unique),
            "trainable_numel": sum(after.numel[n] for n in unique if after.requires_grad[n]),
            "tied": before.tied(),
            "dtypes": dict(sorted(Counter(_short(after.dtype[n]) for n in unique).items()))}


def log_line(result: dict) -> str:
    tied = result["tied"]
    ties = f"{len(tied)} tied group{'s' * (len(tied) != 1)} still one parameter" if tied else "no tied weights"
    dtypes = ", ".join(f"{k} x {v}" for k, v in result["dtypes"].items())
    return (f"audit after wrapping: {result['parameters']} parameters ({result['trainable_numel']:,} of "
            f"{result['numel']:,} elements trainable), {ties}, dtypes as the config asks ({dtypes}), "
            "requires_grad and element counts unchanged")
