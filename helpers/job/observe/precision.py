"""Which dtype each stage of a training step really uses, read from the live job.

Two probes, both run inside ``helpers.train`` on every rank (rank 0 writes):

``DtypeProbe``  follows one named parameter (the first weight matrix of the first
    decoder layer) through one step and records, from the live FSDP2 or DeepSpeed
    objects - never from the config - the dtype of

    ``loaded``              the parameter as the script loaded it, before the backend;
    ``stored_param``        the shard each rank keeps between steps (FSDP ``p.to_local()``,
                            DeepSpeed ZeRO-3 ``p.ds_tensor``);
    ``master_param``        a separate fp32 copy kept for the optimizer (DeepSpeed's fp32
                            partition), or ``None`` when there is none (FSDP: the optimizer
                            updates the stored shard itself);
    ``optimizer_param``     the tensor ``optimizer.step()`` writes to;
    ``forward_weight``      the gathered weight the layer multiplies with (forward hook);
    ``grad_before_reduce``  the gradient autograd produces, before any reduction (tensor hook);
    ``reduce_dtype``        the dtype gradients are reduced in (FSDP ``FSDPParam.reduce_dtype``,
                            else the gradient's own; DeepSpeed ``engine.communication_data_type``);
    ``stored_grad``         the reduced gradient shard kept for the step (FSDP ``p.grad.to_local()``,
                            DeepSpeed ``grad_partitions_flat_buffer``);
    ``optimizer_grad``      the gradient ``optimizer.step()`` reads;
    ``optimizer_states``    Adam's ``exp_avg`` and ``exp_avg_sq``.

    The readings are taken during the step after ``arm()`` (the job arms step 1, when
    Adam's states exist) and end up in ``summary.json`` as ``dtypes``.

``UpdateTracker``  the per-step ``updated_fraction`` in ``metrics.jsonl``: the share of
    parameter elements whose value changed in the optimizer step, counted over every
    rank's local shard (all ranks summed, padding excluded), for the tensor the optimizer
    updates and for the same values rounded to the compute dtype. It keeps a copy of the
    shards, so it is opt-in (``helpers.train --track-updates``; only the precision notebook
    reads it), and above ``UpdateTracker.MAX_PARAMS`` parameters (and for DeepSpeed stages
    below 3) it records ``None``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.core.dtypes import short
from helpers.core.internals import (
    fsdp_params,
    torch_optimizer,
    zero_grads,
    zero_master_dtype,
    zero_offload,
)
from helpers.core.mapping import zero3_local_numel
from helpers.core.models import clean_fqn, decoder_layers

PROBE_KEYS = ("loaded", "stored_param", "master_param", "optimizer_param", "forward_weight",
              "grad_before_reduce", "reduce_dtype", "stored_grad", "optimizer_grad", "optimizer_states")


def probe_target(model) -> tuple[str, torch.nn.Module, str]:
    """(fully qualified name, owning module, attribute) of the first 2-D weight in the first block that the
    optimizer steps (with --peft: the first adapter matrix; the frozen base has no gradient to follow)."""

    block = decoder_layers(model)[0]
    prefix = next(n for n, m in model.named_modules() if m is block)
    found = [(f"{prefix}.{mod_name}.{leaf}".replace("..", "."), module, leaf, p.requires_grad)
             for mod_name, module in block.named_modules() for leaf, p in module.named_parameters(recurse=False)
             if len(getattr(p, "ds_shape", p.shape)) == 2]  # ZeRO-3 init: p itself is empty
    if found:  # trainable first, else in order (sorted is stable)
        name, module, leaf, _ = sorted(found, key=lambda f: not f[3])[0]
        return name, module, leaf
    raise ValueError(f"no 2-D weight in {prefix}")


def _inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer that does the update (DeepSpeed wraps it in its ZeRO optimizer)."""
    return engine.optimizer if engine.backend == "fsdp" else torch_optimizer(engine.engine.optimizer)


class DtypeProbe:
    """Dtypes of one parameter at every stage of a step (see the module doc). Build it before the backend."""

    def __init__(self, model: torch.nn.Module):
        self.name, module, self.leaf = probe_target(model)
        self.out: dict = dict.fromkeys(PROBE_KEYS)
        self.out["loaded"] = short(getattr(module, self.leaf).dtype)
        self.armed, self.engine = False, None
        module.register_forward_hook(self._forward)

    def attach(self, engine) -> None:
        """Call once the backend is applied: hooks the optimizer step."""
        self.engine = engine
        self.param = {clean_fqn(n): p for n, p in engine.module.named_parameters()}[clean_fqn(self.name)]
        _inner_optimizer(engine).register_step_pre_hook(self._before_step)

    def arm(self) -> None:
        """Read the dtypes during the next step."""
        self.armed = True

    def result(self) -> dict:
        return {"param": self.name, **self.out}

    def _forward(self, module, args, output) -> None:
        if not self.armed or self.out["forward_weight"] is not None:
            return
        w = getattr(module, self.leaf)  # FSDP: the unsharded param; DeepSpeed: the gathered param
        self.out["forward_weight"] = short(w.dtype)
        if w.requires_grad and torch.is_grad_enabled():
            handle = None

            def on_grad(grad):
                self.out["grad_before_reduce"] = short(grad.dtype)
                handle.remove()

            handle = w.register_hook(on_grad)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self.armed:
            return
        got = self._fsdp_stored() if self.engine.backend == "fsdp" else self._ds_stored()
        if got is None:  # ZeRO-3 steps its sub-groups one at a time: wait for the one that holds this param
            return
        self.armed = False
        self.out.update(got)

    def _fsdp_stored(self) -> dict:
        p, opt = self.param, self.engine.optimizer
        fp = next(f for f in fsdp_params(self.engine.module) if f.param is p)
        grad = p.grad.to_local() if p.grad is not None else None
        state = opt.state.get(p, {})
        return {
            "stored_param": short(p.to_local().dtype),
            "master_param": None,  # FSDP keeps no second copy: the optimizer updates the shard
            "optimizer_param": short(p.dtype),
            "reduce_dtype": short(fp.reduce_dtype),
            "stored_grad": short(grad.dtype) if grad is not None else None,
            "optimizer_grad": short(grad.dtype) if grad is not None else None,
            "optimizer_states": _states_dtype(state),
        }

    def _ds_stored(self) -> dict | None:
        from deepspeed.utils import safe_get_local_fp32_param

        p, ds = self.param, self.engine.engine
        zopt = ds.optimizer
        if not hasattr(p, "ds_tensor"):  # ZeRO 0-2: no per-param partitions to read
            return {"stored_param": short(p.dtype), "reduce_dtype": short(ds.communication_data_type)}
        if zero_offload(zopt)["optimizer_on_nvme"]:  # master and states are on disk during the step
            master_dtype = short(zero_master_dtype(zopt))
            return {"stored_param": short(p.ds_tensor.dtype), "master_param": master_dtype,
                    "optimizer_param": master_dtype, "reduce_dtype": short(ds.communication_data_type),
                    "stored_grad": short(zero_grads(zopt)[0].dtype), "optimizer_grad": master_dtype,
                    "optimizer_states": None}
        master = safe_get_local_fp32_param(p)
        inner = _inner_optimizer(self.engine)
        # the inner optimizer holds only the flat fp32 partition of the sub-group it is stepping now
        # (stage3.py _optimizer_step); with a small sub_group_size that may be another parameter's
        flat = next((t for g in inner.param_groups for t in g["params"] if _same_storage(t, master)), None)
        if flat is None:
            return None
        return {
            "stored_param": short(p.ds_tensor.dtype),
            "master_param": short(master.dtype),
            "optimizer_param": short(flat.dtype),
            "reduce_dtype": short(ds.communication_data_type),
            "stored_grad": short(zero_grads(zopt)[0].dtype),
            "optimizer_grad": short(flat.grad.dtype) if flat.grad is not None else None,
            "optimizer_states": _states_dtype(inner.state.get(flat, {})),
        }


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _states_dtype(state: dict) -> str | None:
    dts = sorted({short(state[k].dtype) for k in ("exp_avg", "exp_avg_sq") if k in state})
    return "/".join(dts) if dts else None


class UpdateTracker:
    """``updated_fraction`` and ``updated_fraction_compute`` of each step (see the module doc)."""

    MAX_PARAMS = 50_000_000  # above this, copying every shard each step costs too much: record None

    def __init__(self, engine, num_params: int):
        self.engine = engine
        zero3 = engine.backend == "fsdp" or hasattr(next(engine.module.parameters()), "ds_tensor")
        swapped = engine.backend == "deepspeed" and zero_offload(engine.engine.optimizer)["optimizer_on_nvme"]
        self.enabled = num_params <= self.MAX_PARAMS and zero3 and not swapped  # NVMe: the master is on disk
        self.why_not = None  # the reason it is off, for the job's log
        if num_params > self.MAX_PARAMS:
            self.why_not = f"{num_params / 1e6:.0f}M params, above {self.MAX_PARAMS / 1e6:.0f}M (it copies every shard)"
        elif not zero3:
            self.why_not = "DeepSpeed ZeRO 0-2 keeps no per-parameter shards to compare"
        elif swapped:
            self.why_not = "the optimizer's fp32 master is on NVMe during the step"
        self._before: list | None = None
        self._buffers: list | None = None

    def _shards(self) -> list[tuple[torch.Tensor, torch.dtype]]:
        """(local values the optimizer updates, compute dtype) per parameter on this rank."""
        if self.engine.backend == "fsdp":
            return [(f.param.to_local().reshape(-1), f.compute_dtype) for f in fsdp_params(self.engine.module)
                    if f.param.requires_grad]
        from deepspeed.utils import safe_get_local_fp32_param

        rank, out = dist.get_rank(), []
        for p in (p for p in self.engine.module.parameters() if p.requires_grad):  # --peft: the adapter only
            valid = zero3_local_numel(p.ds_numel, p.ds_tensor.numel(), rank)
            out.append((safe_get_local_fp32_param(p).reshape(-1)[:valid], p.ds_tensor.dtype))
        return out

    def before(self) -> None:
        """Copy the shards; call right before the step."""
        if not self.enabled:
            return
        shards = [t.detach() for t, _ in self._shards()]
        if self._buffers is None or [b.shape for b in self._buffers] != [t.shape for t in shards]:
            self._buffers = [torch.empty_like(t) for t in shards]  # once: a fresh clone per step page-faults
        for buf, t in zip(self._buffers, shards, strict=True):
            buf.copy_(t)
        self._before = self._buffers

    def counts(self) -> torch.Tensor:
        """This rank's [changed, changed in the compute dtype, elements] for the step just taken (fp64;
        no collective: helpers.train sums them over ranks with the step's other numbers)."""
        counts = torch.zeros(3, dtype=torch.float64)
        for old, (new, dtype) in zip(self._before, self._shards(), strict=True):
            # count_nonzero: several times faster than summing a bool tensor (which widens it to int64)
            changed = torch.count_nonzero(new != old).item()
            counts[0] += changed
            counts[1] += changed if dtype == new.dtype else torch.count_nonzero(new.to(dtype) != old.to(dtype)).item()
            counts[2] += new.numel()
        self._before = None
        return counts
