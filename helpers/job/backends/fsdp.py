"""FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the guide's engine interface.

``apply_fsdp(model, job, device)`` shards the units ``accelerate launch`` makes
(helpers.job.wrap: the policy's modules, the embedding, norm + head, then the root)
and returns an engine with ``train_step(batches) -> loss`` (this rank's),
``step_sums()`` and ``grad_norm(sums)`` - the same shape as
``helpers.job.backends.deepspeed.apply_deepspeed``. Without clipping, the gradient norm's
all-reduce waits for the job's one all-reduce of the step's numbers (helpers.train);
with clipping, the clip needs it at once and the engine reduces it itself.

Precision follows Accelerate: with ``mixed_precision: bf16`` the model
(loaded in bf16) is upcast to fp32 before sharding, so the sharded params and
the optimizer are fp32 while forward/backward run in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``). With
``mixed_precision: no`` nothing is upcast: a bf16 model trains in bf16 end to
end (the memory-constrained mode).

``fsdp_activation_checkpointing: true`` wraps each decoder block in torch's
``checkpoint_wrapper`` before anything is sharded (helpers.job.recompute).
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

from helpers.core.config import JobConfig, adamw_kwargs
from helpers.core.models import decoder_layers
from helpers.job import comm, recompute
from helpers.job.wrap import forward_order, plan


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
        # Accelerate's upcast (fp32 shards, bf16 compute), on the host where the model was built, as Accelerate does
        # it: fully_shard then moves one unit at a time to the device and keeps only its shard there, instead of
        # the whole fp32 model on every rank's device first (4 bytes a parameter before any sharding)
        for p in model.parameters():
            if p.requires_grad:  # Accelerate's rule (fsdp2_prepare_model): a frozen parameter stays as loaded
                p.data = p.data.float()
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    offload: OffloadPolicy = OffloadPolicy()
    if o.offload_params:
        # pinned host memory needs an accelerator; on a CPU-only box offload moves nothing
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    kw = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    checkpointing = recompute.apply(model, job, device)  # per decoder block, before compile and fully_shard
    if job.train.compile:
        for block in decoder_layers(model):
            block.compile()  # in place, before sharding; FSDP2's hooks run eagerly around the graph
    steps = plan(model, o)  # the units accelerate launch makes, in its order (helpers.job.wrap)
    for unit, mods in steps[:-1]:
        fully_shard(mods[0] if len(mods) == 1 else mods,
                    reshard_after_forward=o.reshard_after_forward and unit.reshard, **kw)
    # the root: FSDP2's default (None) keeps a root gathered after forward, as Accelerate leaves it
    fully_shard(model, **kw)
    inner = [mods[0] for _, mods in forward_order(model, steps)]  # a list-unit's state is on its first module
    set_prefetch(model, inner, o)
    optimizer = torch.optim.AdamW(trainable(model), **adamw_kwargs(job.train))  # --optimizer-impl
    engine = FSDPEngine(model, optimizer, mesh, job.train.grad_clip)
    engine.activation_checkpointing = checkpointing
    return engine


def trainable(model: torch.nn.Module) -> list:
    """The parameters the optimizer steps: those that require a gradient (all of them, unless --peft froze the
    base), as transformers' Trainer hands them to its optimizer."""
    return [p for p in model.parameters() if p.requires_grad]


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
    activation_checkpointing: str | None = None  # what recomputes activations (helpers.job.recompute), or None

    def __init__(self, model, optimizer, mesh, grad_clip: float):
        self.model, self.optimizer, self.mesh, self.grad_clip = model, optimizer, mesh, grad_clip
        self._norm = self._sq = None  # the last step's global norm (clipping) or local sum of squares

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def train_step(self, batches: list[torch.Tensor], probe=None) -> torch.Tensor:
        """Forward/backward every micro-batch, then one optimizer step; this rank's mean loss (not reduced).
        ``probe``: see helpers.job.observe.memory."""
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
            if self.grad_clip > 0:
                self._norm, self._sq = self._grad_norm(), None  # the clip needs the global norm now
                self._clip(self._norm)
            else:
                self._norm, self._sq = None, self._grad_norm(reduce=False)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total / n

    def step_sums(self) -> dict:
        """This rank's part of the squared gradient norm, when not reduced yet: one replica's shards count
        (NO_SHARD and HYBRID replicas hold the same reduced gradients), the others add 0."""
        if self._sq is None:
            return {}
        first_replica = self.mesh.ndim == 1 or self.mesh.get_local_rank("replicate") == 0
        return {"grad_norm_sq": self._sq if first_replica else torch.zeros_like(self._sq)}

    def grad_norm(self, sums: dict[str, float]) -> float:
        """The step's global gradient norm (before clipping), given the summed ``step_sums``."""
        if self._sq is None:
            return float(self._norm)
        return float(self._finish_norm(torch.tensor(sums["grad_norm_sq"], dtype=torch.float64)))

    @staticmethod
    def _finish_norm(sq: torch.Tensor) -> torch.Tensor:
        """The summed squares -> the norm, as ``combine_grad_norm_groups`` does (a vector norm over the one
        group of ``sq ** 0.5``): bit for bit what DeepSpeed reports."""
        return torch.linalg.vector_norm(torch.stack([sq ** (1.0 / 2.0)]), ord=2.0)

    def _grad_norm(self, reduce: bool = True) -> torch.Tensor:
        """Global L2 norm in fp64 over the local grad shards, in DeepSpeed ZeRO-3's arithmetic
        (``reduce=False``: this rank's sum of squares, left for the caller to sum).

        ``get_grad_norm_direct``: one fp64 norm per local shard, stacked, squared and summed with
        ``torch.sum``, all-reduced, raised to 1/2, then ``combine_grad_norm_groups`` (a vector norm
        over the one group). Summing the squares one by one instead parts in the last bit.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        norms = torch.stack([p.grad.to_local().double().norm(2) for p in params])
        sq = torch.sum(torch.pow(norms, 2.0))
        if not reduce:
            return sq
        shard_dim = self.mesh["shard"] if self.mesh.ndim > 1 else self.mesh
        if shard_dim.size() > 1:  # on the host under CPU offload: comm moves it to the group's device
            comm.all_reduce(sq, group=shard_dim.get_group())
        return self._finish_norm(sq)

    def _clip(self, norm: torch.Tensor) -> None:
        # DeepSpeed's formula: scale = max((norm + 1e-6) / max_norm, 1), grads *= 1/scale
        scale = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.to_local().mul_(1.0 / scale)
