"""Activation checkpointing: at most one mechanism per job, chosen by the launch config.

With checkpointing, forward keeps only each decoder block's inputs; backward recomputes the
block's insides from them (non-reentrant ``torch.utils.checkpoint``: the same operations on the
same inputs, so losses and gradients are bit-identical to the run without it).

FSDP
    ``fsdp_activation_checkpointing: true``: torch's ``checkpoint_wrapper`` (non-reentrant,
    ``preserve_rng_state=False``) around every module of the transformer layer class
    (``fsdp_transformer_layer_cls_to_wrap``, default the model's ``_no_split_modules``), before
    ``fully_shard``, as Accelerate 1.15's ``fsdp2_apply_ac`` does. With
    ``fsdp_activation_checkpointing_offload: true`` also ``offload_wrapper`` (the held block inputs
    in pinned host memory), on a GPU; on a CPU they are in host memory already (a note says so).
DeepSpeed
    an ``activation_checkpointing`` object in the DeepSpeed JSON (present, even empty, is the
    trigger): the model's own checkpointing, transformers' ``activation_checkpointing_enable``
    with ``use_reentrant=False`` (what the HF Trainer's ``gradient_checkpointing=True`` calls).
    DeepSpeed itself only reads the section inside ``deepspeed.checkpointing.checkpoint``, which
    transformers' models never call, so of its sub-keys only ``cpu_checkpointing`` applies (as
    transformers' ``offload=True``, on a GPU); each other sub-key that asks for something gets one
    ``note:`` line (helpers.config).

A model whose config.json says ``"gradient_checkpointing": true`` comes out of transformers with
its own checkpointing on. Under ``fsdp_activation_checkpointing`` that is turned off first (one
note), so a block is never checkpointed twice (each recompute would recompute again).
"""

from __future__ import annotations

import torch

from helpers.core.config import JobConfig
from helpers.core.internals import checkpoint_wrappers
from helpers.job.wrap import layer_classes


def requested(job: JobConfig) -> bool:
    """Does the launch config ask for activation checkpointing?"""
    if job.backend == "fsdp":
        return job.fsdp.activation_checkpointing
    return isinstance(job.deepspeed.json.get("activation_checkpointing"), dict)


def offload_requested(job: JobConfig) -> bool:
    """fsdp_activation_checkpointing_offload / the JSON's cpu_checkpointing (with checkpointing on)."""
    if not requested(job):
        return False
    if job.backend == "fsdp":
        return job.fsdp.activation_checkpointing_offload
    return job.deepspeed.json["activation_checkpointing"].get("cpu_checkpointing") in (True, "true")


def notes(job: JobConfig, accelerator: bool, model_checkpoints: bool) -> list[str]:
    """The job's ``note:`` lines about checkpointing: an offload with no device memory to free, and the
    model's own checkpointing (``model_checkpoints``: from its config.json) under the FSDP mechanism."""
    out = []
    if offload_requested(job) and not accelerator:
        key = ("fsdp_config.fsdp_activation_checkpointing_offload" if job.backend == "fsdp"
               else "activation_checkpointing.cpu_checkpointing")
        out.append(f"{key} = true: no effect here: the device is the CPU, so the block inputs checkpointing "
                   "holds are in host memory already (on a GPU they move to pinned host memory)")
    if job.backend == "fsdp" and requested(job) and model_checkpoints:
        out.append("the model's config.json turns on transformers' own gradient checkpointing; turned off, so "
                   "that only fsdp_activation_checkpointing's checkpoint_wrapper recomputes each block (both would "
                   "recompute every block twice)")
    if job.backend == "fsdp" and requested(job) and job.fsdp.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
        out.append(f"fsdp_activation_checkpointing with fsdp_auto_wrap_policy {job.fsdp.auto_wrap_policy}: "
                   "accelerate launch checkpoints the modules that policy picks (NO_WRAP: it fails); this guide "
                   "checkpoints each decoder block (fsdp_transformer_layer_cls_to_wrap, or the model's "
                   "_no_split_modules) whatever the wrap policy")
    return out


def model_checkpoints(model: torch.nn.Module) -> int:
    """How many of the model's blocks transformers' own checkpointing covers (0: off)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def apply(model: torch.nn.Module, job: JobConfig, device: torch.device) -> str | None:
    """Turn on the job's one mechanism (before the backend shards the model); returns what is active, for
    log.txt and summary.json (``activation_checkpointing``), or None."""
    offload = offload_requested(job) and device.type != "cpu"
    if job.backend == "fsdp" and requested(job):

        checkpoint_wrapper, offload_wrapper = checkpoint_wrappers()

        if model_checkpoints(model):
            model.activation_checkpointing_disable()
        want = set(layer_classes(model, job.fsdp.transformer_layer_cls_to_wrap))
        blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in want]
        for name, block in blocks:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)  # non-reentrant is its default
            model.set_submodule(name, offload_wrapper(wrapped) if offload else wrapped)
        kinds = ", ".join(sorted({type(m).__name__ for _, m in blocks}))
        return (f"fsdp checkpoint_wrapper per {kinds} ({len(blocks)} blocks)"
                + (", inputs offloaded to pinned host memory" if offload else ""))
    if job.backend == "deepspeed" and requested(job):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              offload=offload)
        return (f"transformers gradient_checkpointing ({model_checkpoints(model)} blocks)"
                + (", inputs offloaded to pinned host memory" if offload else ""))
    n = model_checkpoints(model)
    return f"transformers gradient_checkpointing ({n} blocks), from the model's config.json" if n else None
