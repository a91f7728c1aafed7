"""``--trace-tensors``: an exact fingerprint of every parameter at every stage of every step.

``TensorTracer`` is an observer: the job calls ``on_train_begin(engine)``, ``on_step_begin(step)``,
``on_step_end(step)`` and ``on_train_end()``; the tracer registers its own forward, gradient and
optimizer-step hooks. Per step and per parameter it records four stages, each with its dtype:

``weight``        the tensor the optimizer updates, before the step (FSDP: the shard, fp32 in the
                  aligned mode, bf16 in the low-precision one; DeepSpeed ZeRO-3: the fp32 master);
``grad_local``    the gradient autograd produced on each rank, before any reduction (every rank's
                  and every micro-batch's, in order; a tensor hook on the weight forward used);
``grad_reduced``  the reduced gradient the optimizer reads (after clipping, when clipping is on);
``update``        what the step changed: the weight after the step minus the weight before, and how
                  many elements changed (``changed``; an update bf16 rounds away changes nothing).

The fingerprint is exact and independent of how the tensor is sharded: each element's value,
as the bit pattern of its fp32 form (exact for bf16, fp16 and fp32), is multiplied by a weight
that depends only on its index in the flattened full tensor, and summed modulo two primes. Every
rank folds its own shard at its global offset and one all-reduce per step adds the shards: FSDP's
dim-0 shards and ZeRO-3's flat partitions give the same fingerprint when the values are the same,
and any change of any element changes it (with probability ~1 - 2^-61). The same values in bf16
and fp32 fingerprint alike: the dtype is recorded next to it.

Rank 0 writes ``DIR/tensor_trace.jsonl``, one line per step:
``{"step": 0, "params": {"model.layers.0.self_attn.q_proj.weight": {"weight": ["1f..", "fp32"],
"grad_local": [..], "grad_reduced": [..], "update": ["..", "fp32", changed]}, ...}}``.
``python -m helpers.compare`` reads it. Supported: every FSDP mode (CPU offload too: the step's one
all-reduce runs on the process group's device, helpers.job.comm), DeepSpeed ZeRO-3 (not with the optimizer
on NVMe); not with ``--compile`` (see ``check``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from helpers.core.dtypes import short
from helpers.core.internals import (
    dtensor_global_offset,
    torch_optimizer,
    zero3_grad_position,
    zero_flat_masters,
    zero_param_groups,
)
from helpers.core.mapping import zero3_local_numel
from helpers.core.metrics import STAGES
from helpers.core.metrics import TRACE_FILE as FILE
from helpers.core.models import clean_fqn
from helpers.job import comm

_MODS = ((2_147_483_647, 48_271, 11), (2_147_483_629, 69_621, 7))  # (prime, a, b): weight (a*i + b) mod p


def fingerprint(values: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """int64 [2]: sum over elements of bits(value) * weight(offset + index), modulo two primes.

    Additive over pieces: fingerprint(t) == fingerprint(t[:k]) + fingerprint(t[k:], k) (mod p).
    """
    v = values.detach().reshape(-1)
    if v.dtype == torch.float64:
        bits = v.view(torch.int32)  # two 32-bit words per element
        offset *= 2
    else:
        bits = v.float().view(torch.int32)
    bits = bits.long() & 0xFFFFFFFF  # on the tensor's device; only the two sums come back
    idx = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) + offset
    out = []
    for p, a, b in _MODS:
        w = ((idx % p) * a + b) % p
        out.append(((bits % p) * w % p).sum() % p)
    return torch.stack(out).cpu()


def hex_of(fp: torch.Tensor) -> str:
    """A summed fingerprint (int64 [2], see ``fingerprint``) as the 16 hex digits the trace files hold."""
    p0, p1 = (int(x) % m[0] for x, m in zip(fp, _MODS, strict=True))
    return f"{p0:08x}{p1:08x}"


def check(job) -> str | None:
    """Why --trace-tensors cannot trace this job (None: it can)."""
    if job.train.compile:
        return "--trace-tensors hooks every module eagerly; drop --compile"
    if job.backend == "deepspeed":
        zo = job.deepspeed.json.get("zero_optimization", {})
        stage = int(zo.get("stage", 0))
        if stage != 3:
            return (f"zero_optimization.stage = {stage}: --trace-tensors reads ZeRO-3 partitions; "
                    "allowed: stage 3, or any FSDP config")
        if zo.get("offload_optimizer", {}).get("device") == "nvme":
            return "--trace-tensors: the optimizer is on NVMe (offload_optimizer.device = nvme): nothing to read"
    return None


class TensorTracer:
    """Observer: fingerprints of weight, local and reduced gradient, and update (see the module doc)."""

    def __init__(self, out_dir: str | Path, rank: int, world_size: int):
        self.path = Path(out_dir) / FILE
        self.rank, self.world_size = rank, world_size
        self.handles: list = []
        self.file = None

    # ---------------------------------------------------------------- observer interface

    def on_train_begin(self, engine) -> None:
        """Hook the model (forward: gradient hooks) and the optimizer (before/after its step)."""
        self.engine = engine
        model = engine.module
        self.names = [clean_fqn(n) for n, _ in model.named_parameters()]  # the same with activation checkpointing
        self.index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
        self.numel = [getattr(p, "ds_numel", None) or p.numel() for _, p in model.named_parameters()]  # DTensor: global
        leaves = {}  # module -> [(attribute, index)]: which parameter a module's attribute is
        for m in model.modules():
            own = [(leaf, self.index[id(p)]) for leaf, p in m.named_parameters(recurse=False, remove_duplicate=False)
                   if id(p) in self.index]
            if own:
                leaves[m] = own
        self.handles.append(model.register_forward_pre_hook(self._new_micro_batch))
        for m, own in leaves.items():
            # prepend: run before FSDP2's post-forward hook reshards a unit (its params are unsharded until then)
            self.handles.append(m.register_forward_hook(self._forward(own), prepend=True))
        opt = self._inner_optimizer()
        self.handles.append(opt.register_step_pre_hook(self._before_step))
        self.handles.append(opt.register_step_post_hook(self._after_step))
        if self.rank == 0:
            self.file = self.path.open("w")

    def on_step_begin(self, step: int) -> None:
        n = len(self.names)
        self.fp = torch.zeros(n, len(STAGES), 2, dtype=torch.int64)
        self.changed = torch.zeros(n, dtype=torch.int64)
        self.dtypes: list[dict] = [{} for _ in range(n)]
        self.micro = -1  # micro-batch counter: each forward of the whole model starts one
        self.hooked: set[int] = set()
        self.saved: dict[int, tuple[torch.Tensor, int]] = {}

    def on_step_end(self, step: int) -> None:
        """Add every rank's shards (one all-reduce) and write the step (rank 0)."""
        fp, changed = self.fp, self.changed
        if dist.is_initialized() and dist.get_world_size() > 1:
            # on the process group's device, not the parameters': FSDP2's CPU offload keeps the shards on the
            # host, and nccl serves no CPU tensor (helpers.job.comm places the sums where the group serves them)
            flat = comm.all_reduce(torch.cat([fp.reshape(-1), changed]))
            fp, changed = flat[:fp.numel()].reshape(fp.shape), flat[fp.numel():]
        if self.file is None:
            return
        params = {}
        for i, name in enumerate(self.names):
            rec = {}
            for s, stage in enumerate(STAGES):
                rec[stage] = [hex_of(fp[i, s]), self.dtypes[i].get(stage)]
            rec["update"].append(int(changed[i]))
            params[name] = rec
        self.file.write(json.dumps({"step": step, "params": params}) + "\n")
        self.file.flush()

    def on_train_end(self) -> None:
        for h in self.handles:
            h.remove()
        if self.file is not None:
            self.file.close()

    # ---------------------------------------------------------------- hooks

    def _add(self, i: int, stage: str, values: torch.Tensor, offset: int, dtype=None) -> None:
        self.fp[i, STAGES.index(stage)] += fingerprint(values, offset)
        self.dtypes[i][stage] = short(dtype or values.dtype)

    def _new_micro_batch(self, module, args) -> None:
        self.micro += 1
        self.hooked = set()

    def _forward(self, own):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            for leaf, i in own:
                w = getattr(module, leaf)  # FSDP: the unsharded param; ZeRO-3: the gathered param
                if i in self.hooked or not w.requires_grad:
                    continue
                self.hooked.add(i)  # once per micro-batch: a tied weight's hook gets the summed gradient
                micro = self.micro

                box = []

                def on_grad(grad, i=i, micro=micro, box=box):
                    slot = self.rank * 4096 + micro  # every rank's and micro-batch's gradient, in order
                    self._add(i, "grad_local", grad, slot * self.numel[i])
                    box[0].remove()  # registered again by the next forward

                box.append(w.register_hook(on_grad))
        return hook

    def _inner_optimizer(self):
        return self.engine.optimizer if self.engine.backend == "fsdp" else torch_optimizer(self.engine.engine.optimizer)

    def _shards(self):
        """(index, local weight, local reduced grad, global offset of both) on this rank."""
        if self.engine.backend == "fsdp":
            yield from self._fsdp_shards()
        else:
            yield from self._zero3_shards()

    def _fsdp_shards(self):

        for p in (t for g in self.engine.optimizer.param_groups for t in g["params"]):
            i = self.index[id(p)]
            coords = p.device_mesh.get_coordinate() or []
            if any(isinstance(pl, Replicate) and c != 0 for pl, c in zip(p.placements, coords, strict=True)):
                continue  # a replica (NO_SHARD, HSDP): its copy is counted once, by replica 0
            off = dtensor_global_offset(p)
            stride = p.numel() // p.shape[0] if p.dim() and p.shape[0] else 0
            offset = off[0] * stride if p.dim() else 0
            yield i, p.to_local(), p.grad.to_local() if p.grad is not None else None, offset

    def _zero3_shards(self):
        zopt = self.engine.engine.optimizer
        for group in zero_param_groups(zopt):
            for p in group:
                i = self.index[id(p)]
                g, dest, part = zero3_grad_position(zopt, p)
                flat = zero_flat_masters(zopt)[g]
                prank = dist.get_rank(group=p.ds_process_group)
                valid = zero3_local_numel(p.ds_numel, part, prank)
                grad = flat.grad.narrow(0, dest, valid) if flat.grad is not None else None
                yield i, flat.narrow(0, dest, valid), grad, prank * part

    def _before_step(self, optimizer, args, kwargs) -> None:
        ready = self._ready_params(optimizer)
        for i, weight, grad, offset in self._shards():
            if i not in ready:
                continue
            self._add(i, "weight", weight, offset)
            if grad is not None:
                self._add(i, "grad_reduced", grad, offset)
            self.saved[i] = (weight.detach().clone(), offset)

    def _after_step(self, optimizer, args, kwargs) -> None:
        ready = self._ready_params(optimizer)
        for i, weight, _, _ in self._shards():
            if i not in ready or i not in self.saved:
                continue
            old, offset = self.saved.pop(i)
            delta = weight.detach().float() - old.float()
            self._add(i, "update", delta, offset, weight.dtype)
            self.changed[i] += int(torch.count_nonzero(weight.detach() != old))

    def _ready_params(self, optimizer) -> set[int]:
        """Parameters this optimizer call steps (ZeRO-3 steps one sub-group per call)."""
        if self.engine.backend == "fsdp":
            return set(range(len(self.names)))
        zopt = self.engine.engine.optimizer
        stepped = {t.data_ptr() for g in optimizer.param_groups for t in g["params"]}
        out = set()
        for flat, params in zip(zero_flat_masters(zopt), zero_param_groups(zopt), strict=True):
            if flat.data_ptr() in stepped:
                out |= {self.index[id(p)] for p in params}
        return out
