"""Which modules get their own FSDP unit: Accelerate's ``fsdp_auto_wrap_policy`` on FSDP2.

An FSDP unit is one ``fully_shard`` call: its parameters are all-gathered
together before its forward (and again before its backward when it reshards
after forward) and its gradients reduce-scattered together. The root
(the whole model) is always a unit and takes every parameter no inner unit took.

``TRANSFORMER_BASED_WRAP``
    every module whose class name is in ``fsdp_transformer_layer_cls_to_wrap``
    (comma-separated; default: the transformers model's ``_no_split_modules``,
    e.g. ``LlamaDecoderLayer``) - one unit per transformer block.
``SIZE_BASED_WRAP``
    bottom-up, every module holding at least ``fsdp_min_num_params``
    parameters that no inner unit already took (FSDP1's
    ``size_based_auto_wrap_policy``). Accelerate's default, 1e8, wraps nothing
    in a small model: one unit, the root.
``NO_WRAP``
    only the root: one all-gather of the whole model, the peak of no sharding
    during forward and backward.

DeepSpeed ZeRO-3 has no such choice: it gathers parameter by parameter, in
buckets of ``stage3_prefetch_bucket_size`` elements, and keeps parameters
below ``stage3_param_persistence_threshold`` elements whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Unit:
    name: str  # module path ("" = root)
    cls: str  # module class name
    num_params: int  # parameters this unit shards (not those of inner units)


def layer_classes(model: torch.nn.Module, setting: str | None) -> list[str]:
    """The class names TRANSFORMER_BASED_WRAP wraps: the setting, else ``_no_split_modules``."""
    if setting:
        return [c.strip() for c in setting.split(",") if c.strip()]
    return list(getattr(model, "_no_split_modules", None) or [])


class WrapError(ValueError):
    """A wrap setting that names nothing in this model; the message lists what it has."""


def wrap_modules(model: torch.nn.Module, fsdp) -> list[tuple[str, torch.nn.Module]]:
    """Modules that get their own ``fully_shard`` besides the root, in forward (registration) order.

    ``fsdp`` is ``helpers.config.FSDPOptions``. Raises WrapError when a class to wrap is not in the model.
    """
    policy = fsdp.auto_wrap_policy
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    if policy == "NO_WRAP":
        return []
    if policy == "TRANSFORMER_BASED_WRAP":
        want = layer_classes(model, fsdp.transformer_layer_cls_to_wrap)
        present = sorted({type(m).__name__ for _, m in model.named_modules()})
        missing = [c for c in want if c not in present]
        if not want or missing:
            given = fsdp.transformer_layer_cls_to_wrap
            what = (f"fsdp_config.fsdp_transformer_layer_cls_to_wrap = {given!r}: no module of class "
                    f"{', '.join(missing)} in {type(model).__name__}" if given else
                    f"fsdp_config.fsdp_auto_wrap_policy = TRANSFORMER_BASED_WRAP: {type(model).__name__} names "
                    "no layer class (_no_split_modules); set fsdp_transformer_layer_cls_to_wrap")
            raise WrapError(f"{what}; classes in the model: {', '.join(present)}")
        return [(n, m) for n, m in named if type(m).__name__ in want]
    # SIZE_BASED_WRAP: post-order, a module wraps what its wrapped descendants left over
    left: dict[int, int] = {}
    chosen: set[int] = set()
    for _, m in reversed(named):  # reversed pre-order: every child before its parent
        own = sum(p.numel() for p in m.parameters(recurse=False))
        total = own + sum(left[id(c)] for c in m.children())
        if total >= fsdp.min_num_params and total > 0:
            chosen.add(id(m))
            total = 0
        left[id(m)] = total
    return [(n, m) for n, m in named if id(m) in chosen]


def units(model: torch.nn.Module, fsdp) -> list[Unit]:
    """Every FSDP unit with the parameters it shards, inner units first in forward order, root last."""
    mods = wrap_modules(model, fsdp)
    taken: set[int] = set()
    out = []
    for name, m in reversed(mods):  # inner before outer: an outer unit excludes its inner units' params
        ps = [p for p in m.parameters() if id(p) not in taken]
        taken.update(id(p) for p in ps)
        out.append(Unit(name, type(m).__name__, sum(p.numel() for p in ps)))
    out.reverse()
    rest = sum(p.numel() for p in model.parameters() if id(p) not in taken)
    return out + [Unit("", type(model).__name__, rest)]


def expected_collectives(unit_list: list[Unit], reshard_after_forward: bool, grad_accum: int = 1,
                         param_bytes: int = 2) -> dict:
    """FSDP2 collectives per optimizer step for these units (a unit without parameters has none).

    Forward gathers every unit once; backward gathers again every inner unit that resharded after
    forward (the root never does: its parameters are needed again at once); that per micro-batch.
    Gradients are reduce-scattered once per unit, after the last micro-batch. Bytes: the unsharded
    parameters in the dtype they are gathered in (``param_bytes``; bf16 under mixed precision).
    """
    groups = [u for u in unit_list if u.num_params > 0]
    inner = [u for u in groups if u.name != ""]
    again = inner if reshard_after_forward else []
    return {
        "all_gathers": grad_accum * (len(groups) + len(again)),
        "all_gather_bytes": grad_accum * param_bytes * (sum(u.num_params for u in groups)
                                                         + sum(u.num_params for u in again)),
        "reduce_scatters": len(groups),
    }


def meta_model(spec):
    """The model's module tree on the meta device (no memory, no weights): for checks before launch."""
    from transformers import AutoModelForCausalLM

    from .models import model_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(spec))


def check_wrap_policy(job, spec) -> list[Unit]:
    """Resolve the wrap policy on a meta copy of the model; ConfigError (one line) when it cannot apply."""
    from .config import ConfigError

    try:
        return units(meta_model(spec), job.fsdp)
    except WrapError as e:
        raise ConfigError(f"{job.source}: {e}") from None
