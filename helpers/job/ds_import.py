"""A consolidated fp32 checkpoint (``full.pt``: weights, Adam's moments and step) imported into a live
DeepSpeed engine at any ZeRO stage, through DeepSpeed's own accessors (helpers.job.checkpoint's resume,
helpers.convert's DeepSpeed side)."""

from __future__ import annotations

import torch

from helpers.core.internals import torch_optimizer, zero0_masters, zero_flat_masters, zero_param_groups


class CheckpointError(ValueError):
    """A directory that cannot be resumed or converted; the message says why and what to do (raised here and
    by helpers.job.checkpoint, which re-exports it)."""


def import_deepspeed(engine, state: dict) -> None:
    """Consolidated fp32 state -> a live DeepSpeed engine, any ZeRO stage (weights were loaded before
    initialize). Each value is written into the engine's own fp32 master and Adam state, then read back:
    a stage whose tensors we cannot reach is an error, never a silent restart of Adam."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model_sd, optim_sd = state["model"], state["optim"]
    steps = {float(s["step"]) for s in optim_sd["state"].values()}
    if len(steps) != 1:
        raise CheckpointError(f"optimizer state has several step counts {sorted(steps)}; cannot import")
    step = steps.pop()
    zopt = engine.engine.optimizer
    stage = engine.engine.zero_optimization_stage()
    inner = torch_optimizer(zopt)  # the torch AdamW over fp32 masters
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]  # frozen: weights only
    if stage == 0:
        _import_stage0(zopt, inner, named, model_sd, optim_sd)
    else:
        _import_zero(zopt, inner, stage, named, model_sd, optim_sd)
    for s in inner.state.values():  # torch Adam: a tensor (on the host); DeepSpeed's FusedAdam: a number
        if torch.is_tensor(s["step"]):
            s["step"].fill_(step)
        else:
            s["step"] = int(step)
    groups = optim_sd["param_groups"]
    for g_live in inner.param_groups:  # lr, betas, eps, weight_decay as saved
        for k in ("lr", "betas", "eps", "weight_decay"):
            if k in groups[0]:
                g_live[k] = groups[0][k]
    name, prm = named[-1]  # read one back through DeepSpeed's own accessors (on the GPU there; the file: CPU)
    if stage and not (torch.equal(safe_get_full_fp32_param(prm).cpu(), model_sd[name].float())
                      and torch.equal(safe_get_full_optimizer_state(prm, "exp_avg").cpu(),
                                      optim_sd["state"][name]["exp_avg"].float())):
        raise CheckpointError(f"importing into ZeRO-{stage}: {name} did not take the checkpoint's values")


def _import_zero(zopt, inner, stage: int, named, model_sd: dict, optim_sd: dict) -> None:
    """ZeRO 1-3: DeepSpeed maps each parameter to its fragment of the flat fp32 partitions."""
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    # Torch Adam creates its state at the first step, so a fresh engine has none: create it (zeros), then
    # overwrite it. ZeRO 1-2 also link each parameter to its slice of that state only after the first step.
    flats = zero_flat_masters(zopt)
    for flat in flats:
        if not inner.state.get(flat):
            inner.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                 "exp_avg_sq": torch.zeros_like(flat)}
    if stage < 3:
        for lp_group, flat in zip(zero_param_groups(zopt), flats, strict=True):
            lazy_init_hp_params_optimizer_state(lp_group, flat, inner.state)
    for name, prm in named:
        safe_set_full_fp32_param(prm, model_sd[name].float())
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(prm, optim_sd["state"][name][key].float(), key)


def _import_stage0(zopt, inner, named, model_sd: dict, optim_sd: dict) -> None:
    """ZeRO-0: no partitions. In bf16/fp16 DeepSpeed's wrapper keeps one fp32 master per parameter
    (``fp32_groups``), in fp32 the module's parameters are the masters; Adam's state is keyed by them."""
    masters = zero0_masters(zopt) or [p for _, p in named]
    stepped = {id(p) for g in inner.param_groups for p in g["params"]}  # what the optimizer really updates
    if len(masters) != len(named) or any(id(m) not in stepped for m in masters):
        raise CheckpointError(f"importing into ZeRO-0: the {len(masters)} fp32 masters found for {len(named)} "
                              "parameters are not the tensors the optimizer steps")
    for (name, _), m in zip(named, masters, strict=True):
        m.data.copy_(model_sd[name])
        s = optim_sd["state"][name]
        inner.state[m] = {"step": torch.tensor(0.0), "exp_avg": s["exp_avg"].to(m.device, torch.float32).clone(),
                          "exp_avg_sq": s["exp_avg_sq"].to(m.device, torch.float32).clone()}
