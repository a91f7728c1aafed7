"""DeepSpeed (0.19.8) facts the guide states about throughput (07) and memory and batch size (08).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import functools
import inspect
import os

from .. import fact
from .._tools import ds_engine, field_default, resolve, source_has

V = "0.19.8"
Z3 = "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3"


@functools.lru_cache(maxsize=1)
def _z3() -> dict:
    """One ZeRO-3 bf16 engine (one rank) on Linear(320, 320) + Linear(320, 16): what it holds right after
    deepspeed.initialize, then after one step."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(320, 320), torch.nn.Linear(320, 16))
    engine = ds_engine({"stage": 3}, model=model)
    o = engine.optimizer
    n = sum(p.ds_numel for p in model.parameters())
    grad_buf = o.grad_partitions_flat_buffer
    seen = {
        "params": n,
        "state_at_init": len(o.optimizer.state),
        "buckets": {str(k).removeprefix("torch."): b.buffer.numel() for k, b in o.ipg_buckets.items()},
        "bucket_bytes": sum(b.buffer.numel() * b.buffer.element_size() for b in o.ipg_buckets.values()),
        "grad_buffer": (str(grad_buf.dtype).removeprefix("torch."), grad_buf.numel()),
        "shard_dtype": str(o.fp16_partitioned_groups_flat[0].dtype).removeprefix("torch."),
        "master_dtype": str(o.fp32_partitioned_groups_flat[0].dtype).removeprefix("torch."),
        "persist": {name: (p.ds_numel, p.ds_persist) for name, p in model.named_parameters()},
    }
    loss = engine(torch.ones(2, 320, dtype=torch.bfloat16)).float().sum()
    engine.backward(loss)
    engine.step()
    states = [(k, s) for k, s in o.optimizer.state.items()]
    seen["stepped_tensors"] = [k.numel() for k, _ in states]
    bytes_ = (sum(t.numel() * t.element_size() for t in o.fp16_partitioned_groups_flat)
              + sum(t.numel() * t.element_size() for t in o.fp32_partitioned_groups_flat)
              + grad_buf.numel() * grad_buf.element_size()
              + sum(v.numel() * v.element_size() for _, s in states for k, v in s.items() if k != "step"))
    seen["bytes_per_param"] = bytes_ / n
    seen["grad_buffer_kept"] = o.grad_partitions_flat_buffer is grad_buf
    return seen


@fact("deepspeed.zero3_optimizer_state_lazy",
      "Under ZeRO-3 the wrapped torch optimizer has no state after deepspeed.initialize: it is created at the "
      "first step.",
      "deepspeed", V, f"{Z3}.initialize_optimizer_states", runs=True)
def _lazy():
    z = _z3()
    return z["state_at_init"] == 0 and z["stepped_tensors"], {"state after initialize": z["state_at_init"],
                                                               "state tensors after a step": len(z["stepped_tensors"])}


@fact("deepspeed.zero3_16_bytes_per_param",
      "ZeRO-3 with bf16 holds 16 bytes per parameter at rest after a step: bf16 shard (2), fp32 master (4), bf16 "
      "gradient partition (2), Adam's two fp32 states (8).",
      "deepspeed", V, f"{Z3}._create_fp32_partitions, _setup_for_real_optimizer", runs=True)
def _bytes():
    z = _z3()
    return z["bytes_per_param"] == 16, {"bytes per parameter": z["bytes_per_param"], "grad buffer": z["grad_buffer"]}


@fact("deepspeed.zero3_steps_one_flat_partition",
      "ZeRO-3 steps the torch optimizer on one flat fp32 partition (per sub-group), not parameter by parameter.",
      "deepspeed", V, f"{Z3}._optimizer_step", runs=True)
def _flat():
    z = _z3()
    return z["stepped_tensors"] == [z["params"]], {"optimizer state tensors (numel)": z["stepped_tensors"],
                                                   "model parameters": z["params"]}


@fact("deepspeed.zero3_bucket_allocated_whole",
      "ZeRO-3 allocates its gradient bucket at start-up, reduce_bucket_size elements (default 5e8: 1e9 bytes in "
      "bf16) whatever the model's size; a lower reduce_bucket_size shrinks it.",
      "deepspeed", V, f"{Z3}.__init__ (ipg_buckets); runtime/zero/config.py: DeepSpeedZeroConfig.reduce_bucket_size",
      runs=True)
def _bucket():
    import torch

    z = _z3()
    small = ds_engine({"stage": 3, "reduce_bucket_size": 1000}, model=torch.nn.Linear(16, 16)).optimizer
    small_b = {str(k).removeprefix("torch."): b.buffer.numel() for k, b in small.ipg_buckets.items()}
    ok = z["buckets"] == {"bfloat16": 500_000_000} and z["bucket_bytes"] == 10**9 and small_b == {"bfloat16": 1000}
    return ok, {"model params": z["params"], "bucket": z["buckets"], "bucket bytes": z["bucket_bytes"],
                "with reduce_bucket_size=1000": small_b}


@fact("deepspeed.zero_bucket_defaults",
      "DeepSpeed's ZeRO defaults: reduce_bucket_size 5e8 elements (every stage), a ZeRO-3 prefetch bucket of 5e7 "
      "elements, contiguous gradients on.",
      "deepspeed", V, "runtime/zero/config.py: DeepSpeedZeroConfig")
def _defaults():
    cls = "deepspeed.runtime.zero.config.DeepSpeedZeroConfig"
    d = {k: field_default(cls, k) for k in ("reduce_bucket_size", "prefetch_bucket_size", "contiguous_gradients")}
    return d == {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                 "contiguous_gradients": True}, d


@fact("deepspeed.zero3_grad_partition_kept",
      "ZeRO-3 keeps its gradient partition in one flat buffer made at start-up; zero_grad does not free it.",
      "deepspeed", V, f"{Z3}._setup_for_real_optimizer (grad_partitions_flat_buffer), zero_grad", runs=True)
def _grad_buffer():
    z = _z3()
    ok = z["grad_buffer"] == ("bfloat16", z["params"]) and z["grad_buffer_kept"]
    return ok, {"buffer (dtype, numel)": z["grad_buffer"], "same buffer after a step": z["grad_buffer_kept"]}


@fact("deepspeed.zero3_reuse_distance",
      "From its second step (its trace complete), ZeRO-3 does not release a gathered parameter that the step uses "
      "again within stage3_max_reuse_distance elements (default 1e9); backward fetches every module's parameters "
      "again; a smaller distance frees them sooner and gathers them again.",
      "deepspeed", V, "runtime/zero/partitioned_param_coordinator.py: PartitionedParameterCoordinator.reset_step, "
      "__params_to_release; parameter_offload.py: pre_sub_module_backward_function")
def _reuse():
    coord = "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator"
    a, ea = source_has(coord,  # the class: __params_to_release is wrapped by instrument_w_nvtx (no __wrapped__)
                       "if params_traversed >= self.__max_reuse_dist_in_numel: break",
                       "params_to_release.discard(param.ds_id) params_traversed += param.ds_numel")
    b, eb = source_has(f"{coord}.reset_step", "self.__trace_mode = ZeRoTraceMode.COMPLETE",
                       "self.__trace_mode = ZeRoTraceMode.RECORD")
    c, ec = source_has("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload.pre_sub_module_backward_function",
                       "param_coordinator.fetch_sub_module(sub_module, forward=False)")
    default = field_default("deepspeed.runtime.zero.config.DeepSpeedZeroConfig", "max_reuse_distance")
    missing = [m for e in (ea, eb, ec) for m in e.get("missing", [])]
    return a and b and c and default == 10**9, {"max_reuse_distance default": default,
                                                **({"missing": missing} if missing else {"source": "release, trace, "
                                                                                          "backward fetch found"})}


@fact("deepspeed.activation_checkpointing_section_inert",
      "DeepSpeed's activation_checkpointing config section turns nothing on by itself: the engine only parses it; "
      "it configures deepspeed.checkpointing, which a model must call.",
      "deepspeed", V, "runtime/config.py: DeepSpeedConfig (activation_checkpointing_config); "
      "runtime/activation_checkpointing/checkpointing.py: configure, is_configured", runs=True)
def _ac_section():
    import torch
    from deepspeed.runtime.activation_checkpointing import checkpointing

    engine = ds_engine({"stage": 0}, model=torch.nn.Linear(16, 16),
                       activation_checkpointing={"partition_activations": True, "number_checkpoints": 1})
    parsed = engine._config.activation_checkpointing_config.partition_activations
    configured = checkpointing.is_configured()
    return parsed is True and configured is False, {"section parsed": parsed,
                                                     "deepspeed.checkpointing configured": configured}


@fact("deepspeed.allgather_bucket_no_buffer",
      "allgather_bucket_size allocates no buffer: with torch's all_gather_into_tensor, ZeRO-1/2 gather straight into "
      "their flat parameter groups.",
      "deepspeed", V, "runtime/utils.py: all_gather_dp_groups, all_gather_into_tensor_dp_groups; comm/torch.py: "
      "TorchBackend.get_all_gather_function")
def _allgather():
    from deepspeed.comm.torch import TorchBackend

    early, ev = source_has("deepspeed.runtime.utils.all_gather_dp_groups",
                           "if dist.has_all_gather_into_tensor(): return all_gather_into_tensor_dp_groups(")
    fn = TorchBackend.get_all_gather_function()
    srcs = [inspect.getsource(resolve(f"deepspeed.runtime.utils.{f}"))
            for f in ("all_gather_dp_groups", "all_gather_into_tensor_dp_groups")]
    allocs = [a for a in ("torch.empty", "torch.zeros", "new_empty", "new_zeros") if any(a in s for s in srcs)]
    ok = early and fn is not None and not allocs
    return ok, {"all_gather function": getattr(fn, "__name__", None), "early return": early,
                "allocations in the gather": allocs}


@fact("deepspeed.zero3_offload_keys",
      "Under ZeRO-3, offload_optimizer puts the fp32 master, Adam's states and the gradient partition on the host; "
      "the bf16 parameter partitions leave the GPU only with offload_param.",
      "deepspeed", V, f"{Z3}.__init__ (self.device), _setup_for_real_optimizer, "
      "_create_fp16_partitions_with_defragmentation")
def _offload():
    a, ea = source_has("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.__init__",
                       "self.device = get_accelerator().current_device_name() if not self.offload_optimizer "
                       "else OffloadDeviceEnum.cpu")
    b, eb = source_has("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer",
                       "dtype=self.gradient_accumulation_dtype, device=self.device)")
    c, ec = source_has("deepspeed.runtime.zero.stage3",
                       "if not self.offload_param: # partitioned params remain in GPU during training")
    missing = [m for e in (ea, eb, ec) for m in e.get("missing", [])]
    return a and b and c, ({"missing": missing} if missing else
                           {"source": "optimizer device cpu with offload_optimizer; grad partition on it; "
                                      "params stay on GPU unless offload_param"})


@fact("deepspeed.zero3_padding_last_rank",
      "ZeRO-3 pads each parameter to a multiple of the world size: up to world_size-1 elements, held on the last "
      "rank.",
      "deepspeed", V, "runtime/zero/partition_parameters.py: Init._padding_size; stage3.py: groups_padding")
def _padding():
    a, ea = source_has("deepspeed.runtime.zero.partition_parameters.Init._padding_size",
                       "remainder = param.ds_numel % partition_world_size",
                       "return (partition_world_size - remainder) if remainder else 0")
    b, eb = source_has("deepspeed.runtime.zero.stage3",
                       "rank_requires_padding = dist.get_rank(sub_group_process_group) == "
                       "sub_group_partition_count - 1")
    return a and b, {**ea, **{f"{k} (stage3)": v for k, v in eb.items()}}
