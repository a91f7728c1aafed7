"""Which modules get their own FSDP unit: what ``accelerate launch`` does with ``fsdp_version: 2``.

An FSDP unit is one ``fully_shard`` call (on one module or a list of them): its parameters are
all-gathered together before its forward (and again before its backward when it reshards after
forward) and its gradients reduce-scattered together. The root (the whole model) is always a unit
and takes every parameter no other unit took.

The units are chosen as Accelerate 1.15's ``fsdp2_prepare_model`` chooses them, in its order:

1. the auto wrap policy, bottom-up over every module but the root, with Accelerate's own policy
   function (``fsdp2_prepare_auto_wrap_policy``, called here):

   ``TRANSFORMER_BASED_WRAP``
       every module whose class is in ``fsdp_transformer_layer_cls_to_wrap`` (comma-separated;
       default: the transformers model's ``_no_split_modules``, e.g. ``LlamaDecoderLayer``).
   ``SIZE_BASED_WRAP``
       every module holding *more than* ``fsdp_min_num_params`` parameters in total, its own and
       its children's (so a parent of wrapped blocks, e.g. ``model.model``, is wrapped too; this
       is not FSDP1's rule, which counts only what no inner unit took). 0 turns the policy off.
   ``NO_WRAP``
       no policy.
2. the input embedding, unless a unit has it already (or it is tied to the output embedding);
3. the "tail": the final norm and the output embedding (``lm_head``; with tied weights also the
   input embedding), together in one unit that stays gathered from forward to backward
   (``reshard_after_forward=False``: the loss is computed right after it, and re-gathering it for
   backward could not be hidden behind any compute);
4. the root, with FSDP2's default for a root: not resharded after forward.

So even ``NO_WRAP`` gives three units under ``accelerate launch`` (embedding, tail, root), and the
root of a transformer often holds no parameters at all.

DeepSpeed ZeRO-3 has no such choice: it gathers parameter by parameter, in buckets of
``stage3_prefetch_bucket_size`` elements, and keeps parameters of at most
``stage3_param_persistence_threshold`` elements whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from helpers.core.config import ConfigError
from helpers.core.internals import final_norm, no_split_modules
from helpers.core.models import model_config


@dataclass
class Unit:
    name: str  # module path ("" = root; "a+b" for modules sharded together in one unit)
    cls: str  # module class name(s)
    num_params: int  # parameters this unit shards (not those of units applied before it)
    reshard: bool = True  # follows fsdp_reshard_after_forward; False: the tail and the root never reshard


def layer_classes(model: torch.nn.Module, setting: str | None) -> list[str]:
    """The class names TRANSFORMER_BASED_WRAP wraps: the setting, else ``_no_split_modules``."""
    if setting:
        return [c.strip() for c in setting.split(",") if c.strip()]
    return no_split_modules(model)


class WrapError(ValueError):
    """A wrap setting that names nothing in this model; the message lists what it has."""


def _policy(model: torch.nn.Module, fsdp):
    """Accelerate's FSDP2 auto wrap policy (a ``module -> bool``) for these settings, or None (no policy)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    if fsdp.auto_wrap_policy == "NO_WRAP":
        return None
    if fsdp.auto_wrap_policy == "SIZE_BASED_WRAP":
        if fsdp.min_num_params == 0:  # FullyShardedDataParallelPlugin.set_auto_wrap_policy: 0 means no policy
            return None
        fn = size_based_auto_wrap_policy
    else:
        want = layer_classes(model, fsdp.transformer_layer_cls_to_wrap)
        present = sorted({type(m).__name__ for _, m in model.named_modules()})
        missing = [c for c in want if c not in present]
        if not want or missing:  # Accelerate would raise a ValueError mid-launch; say it before, in one line
            given = fsdp.transformer_layer_cls_to_wrap
            what = (f"fsdp_config.fsdp_transformer_layer_cls_to_wrap = {given!r}: no module of class "
                    f"{', '.join(missing)} in {type(model).__name__}" if given else
                    f"fsdp_config.fsdp_auto_wrap_policy = TRANSFORMER_BASED_WRAP: {type(model).__name__} names "
                    "no layer class (_no_split_modules); set fsdp_transformer_layer_cls_to_wrap")
            raise WrapError(f"{what}; classes in the model: {', '.join(present)}")
        fn = transformer_auto_wrap_policy
    # the plugin's three attributes the policy function reads; the real plugin needs a launched Accelerator
    plugin = SimpleNamespace(auto_wrap_policy=fn, min_num_params=fsdp.min_num_params,
                             transformer_cls_names_to_wrap=layer_classes(model, fsdp.transformer_layer_cls_to_wrap))
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


def _container(m: torch.nn.Module) -> bool:
    """A ModuleList / ModuleDict without a forward of its own: torch 2.13's fully_shard refuses it."""
    return isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) and type(m).forward is torch.nn.Module.forward


def plan(model: torch.nn.Module, fsdp, notes: list[str] | None = None) -> list[tuple[Unit, list[torch.nn.Module]]]:
    """Each ``fully_shard`` call ``fsdp2_prepare_model`` makes, in its order (the root last): (unit, modules).

    ``fsdp`` is ``helpers.core.config.FSDPOptions``. Raises WrapError when a class to wrap is not in the model.
    Where this guide deliberately differs from Accelerate, one line saying so goes to ``notes``.
    """
    from accelerate.utils.other import get_module_children_bottom_up

    names = {id(m): n for n, m in model.named_modules()}
    wrapped: set[int] = set()  # modules already in a unit (Accelerate: isinstance(m, FSDPModule))
    calls: list[tuple[list[torch.nn.Module], bool]] = []
    policy = _policy(model, fsdp)
    if policy is not None:
        for m in get_module_children_bottom_up(model)[:-1]:
            if policy(m) and id(m) not in wrapped:
                if _container(m):  # SIZE_BASED_WRAP picks e.g. model.layers; accelerate launch stops there
                    if notes is not None:
                        notes.append(f"fsdp_auto_wrap_policy {fsdp.auto_wrap_policy}: {names[id(m)]} "
                                     f"({type(m).__name__}) passes Accelerate's policy, but fully_shard refuses "
                                     "a container without forward (accelerate launch would stop with a "
                                     "ValueError); this guide leaves its parameters to the unit above it")
                    continue
                calls.append(([m], True))
                wrapped.add(id(m))
    covered = {id(p) for mods, _ in calls for m in mods for p in m.parameters()}

    def free(m) -> bool:  # Accelerate checks only that m itself is no unit yet; torch then fails at forward
        if m is None or id(m) in wrapped:
            return False
        if any(id(p) in covered for p in m.parameters()):
            if notes is not None:
                notes.append(f"fsdp_auto_wrap_policy {fsdp.auto_wrap_policy}: {names[id(m)]} is inside a unit "
                             "the policy made, so this guide gives it no unit of its own (accelerate launch "
                             "would, and its forward would fail mixing DTensor and Tensor)")
            return False
        return True

    inp = getattr(model, "get_input_embeddings", lambda: None)()
    out = getattr(model, "get_output_embeddings", lambda: None)()
    tied = getattr(inp, "weight", None) is not None and getattr(inp, "weight", None) is getattr(out, "weight", None)
    if not tied and free(inp):
        calls.append(([inp], True))
        wrapped.add(id(inp))
    tail = [m for m in ((final_norm(model), inp, out) if tied else (final_norm(model), out)) if free(m)]
    if tail:
        calls.append((tail, False))
        wrapped.update(id(m) for m in tail)
    calls.append(([model], False))
    taken: set[int] = set()
    steps = []
    for mods, reshard in calls:  # a later call shards only what earlier (inner) calls left
        ps = {id(p): p for m in mods for p in m.parameters() if id(p) not in taken}
        taken.update(ps)
        unit = Unit("+".join(names[id(m)] for m in mods), "+".join(type(m).__name__ for m in mods),
                    sum(p.numel() for p in ps.values()), reshard)
        steps.append((unit, mods))
    return steps


def forward_order(model: torch.nn.Module, steps) -> list:
    """The non-root steps of ``plan`` in the order their modules are registered (= run, for a decoder)."""
    pos = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(steps[:-1], key=lambda s: min(pos[id(m)] for m in s[1]))


def units(model: torch.nn.Module, fsdp) -> list[Unit]:
    """Every FSDP unit with the parameters it shards, in forward order, root last."""
    steps = plan(model, fsdp)
    return [u for u, _ in forward_order(model, steps)] + [steps[-1][0]]


def expected_collectives(unit_list: list[Unit], reshard_after_forward: bool, grad_accum: int = 1,
                         param_bytes: int = 2) -> dict:
    """FSDP2 collectives per optimizer step for these units (a unit without parameters has none).

    Forward gathers every unit once; backward gathers again every unit that resharded after forward
    (those that follow ``reshard_after_forward``: never the tail nor the root, which stay gathered);
    that per micro-batch. Gradients are reduce-scattered once per unit, after the last micro-batch.
    Bytes: the unsharded parameters in the dtype they are gathered in (``param_bytes``; bf16 under
    mixed precision).
    """
    groups = [u for u in unit_list if u.num_params > 0]
    again = [u for u in groups if u.reshard and u.name != ""] if reshard_after_forward else []
    return {
        "all_gathers": grad_accum * (len(groups) + len(again)),
        "all_gather_bytes": grad_accum * param_bytes * (sum(u.num_params for u in groups)
                                                         + sum(u.num_params for u in again)),
        "reduce_scatters": len(groups),
    }


def meta_model(spec):
    """The model's module tree on the meta device (no memory, no weights): for checks before launch."""
    from transformers import AutoModelForCausalLM


    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(spec))


def check_wrap_policy(job, spec) -> list[Unit]:
    """Resolve the wrap policy on a meta copy of the model; ConfigError (one line) when it cannot apply."""

    try:
        model = meta_model(spec)
        plan(model, job.fsdp, notes=job.notes)  # the notes of where the guide differs, logged by the job
        return units(model, job.fsdp)
    except WrapError as e:
        raise ConfigError(f"{job.source}: {e}") from None
