"""FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the guide's engine interface.

``apply_fsdp(model, job, device)`` shards the units ``accelerate launch`` makes
(helpers.wrap: the policy's modules, the embedding, norm + head, then the root)
and returns an engine with ``train_step(batches) -> (loss, grad_norm)``
- the same shape as ``helpers.backends.deepspeed.apply_deepspeed``.

Precision follows Accelerate: with ``mixed_precision: bf16`` the model
(loaded in bf16) is upcast to fp32 before sharding, so the sharded params and
the optimizer are fp32 while forward/backward run in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``). With
``mixed_precision: no`` nothing is upcast: a bf16 model trains in bf16 end to
end (the memory-constrained mode).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from .. import comm
from ..config import JobConfig
from ..models import decoder_layers
from ..wrap import forward_order, plan


def fsdp_mesh(job: JobConfig, world_size: int, device_type: str):
    """1-D mesh for FULL/SHARD_GRAD_OP; 2-D (replicate, shard) for NO_SHARD and HYBRID_*."""
    o = job.fsdp
    if o.sharding == "NO_SHARD":
        shape = (world_size, 1)
    elif o.sharding.startswith("HYBRID"):
        shape = (world_size // o.hybrid_shard_size, o.hybrid_shard_size)
    else:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: torch.nn.Module, job: JobConfig, device: torch.device) -> FSDPEngine:
    o = job.fsdp
    world_size = dist.get_world_size()
    mesh = fsdp_mesh(job, world_size, device.type)
    mp_policy = MixedPrecisionPolicy()
    if job.mixed_precision == "bf16":
        if not next(model.parameters()).is_meta:  # a meta model (RAM-efficient loading) is filled later
            model.to(device)
        for p in model.parameters():  # Accelerate's upcast: fp32 shards, bf16 compute
            p.data = p.data.float()
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    offload: OffloadPolicy = OffloadPolicy()
    if o.offload_params:
        # pinned host memory needs an accelerator; on a CPU-only box offload moves nothing
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    kw = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    if job.train.compile:
        for block in decoder_layers(model):
            block.compile()  # in place, before sharding; FSDP2's hooks run eagerly around the graph
    steps = plan(model, o)  # the units accelerate launch makes, in its order (helpers.wrap)
    for unit, mods in steps[:-1]:
        fully_shard(mods[0] if len(mods) == 1 else mods,
                    reshard_after_forward=o.reshard_after_forward and unit.reshard, **kw)
    # the root: FSDP2's default (None) keeps a root gathered after forward, as Accelerate leaves it
    fully_shard(model, **kw)
    inner = [mods[0] for _, mods in forward_order(model, steps)]  # a list-unit's state is on its first module
    set_prefetch(model, inner, o)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=job.train.lr, weight_decay=job.train.weight_decay, foreach=False
    )
    return FSDPEngine(model, optimizer, mesh, job.train.grad_clip)


def set_prefetch(model, inner: list, o) -> None:
    """Accelerate's prefetch keys on FSDP2's explicit prefetch (Accelerate itself ignores them for FSDP2).

    ``fsdp_forward_prefetch: true``: each unit, as its forward starts, also issues the all-gather of
    the next unit in forward order (the root starts the first). Without it, a unit is gathered when
    its own forward starts.
    ``fsdp_backward_prefetch``: ``BACKWARD_PRE`` (and ``BACKWARD_POST``, which FSDP2 does not
    distinguish) is FSDP2's default: as a unit's backward starts, it gathers the unit that runs next.
    ``NO_PREFETCH``: each unit's explicit backward-prefetch list names only itself (already gathered),
    which turns the default off: a unit is gathered when its own backward starts.
    """
    if o.forward_prefetch:
        chain = [model, *inner]
        for unit, nxt in zip(chain[:-1], chain[1:], strict=True):
            unit.set_modules_to_forward_prefetch([nxt])
    if o.backward_prefetch == "NO_PREFETCH":
        for unit in [model, *inner]:
            unit.set_modules_to_backward_prefetch([unit])


class FSDPEngine:
    """One optimizer step over a list of micro-batches, FSDP2 style."""

    backend = "fsdp"

    def __init__(self, model, optimizer, mesh, grad_clip: float):
        self.model, self.optimizer, self.mesh, self.grad_clip = model, optimizer, mesh, grad_clip

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def train_step(self, batches: list[torch.Tensor], probe=None) -> tuple[torch.Tensor, float]:
        """Forward/backward every micro-batch, then one optimizer step. ``probe``: see helpers.memory."""
        n = len(batches)
        total = torch.zeros((), dtype=torch.float32, device=batches[0].device)
        for i, ids in enumerate(batches):
            # gradients are reduce-scattered only after the last micro-batch
            self.model.set_requires_gradient_sync(i == n - 1)
            with probe.forward(i) if probe else nullcontext(), record_function("guide::forward"):
                loss = self.model(input_ids=ids, labels=ids).loss
            with record_function("guide::backward"):
                (loss / n).backward()
            total += loss.detach().float()
        if probe:
            probe.after_backward(self)
        with record_function("guide::optimizer_step"):
            norm = self._grad_norm()
            if self.grad_clip > 0:
                self._clip(norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total / n, float(norm)

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm in fp64 over the local grad shards, as DeepSpeed computes it."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=params[0].grad.device)
        for p in params:
            sq += p.grad.to_local().double().norm(2) ** 2
        shard_dim = self.mesh["shard"] if self.mesh.ndim > 1 else self.mesh
        if shard_dim.size() > 1:  # on the host under CPU offload: comm moves it to the group's device
            comm.all_reduce(sq, group=shard_dim.get_group())
        return sq.sqrt()

    def _clip(self, norm: torch.Tensor) -> None:
        # DeepSpeed's formula: scale = max((norm + 1e-6) / max_norm, 1), grads *= 1/scale
        scale = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.to_local().mul_(1.0 / scale)
