"""Every private API of torch, DeepSpeed, Accelerate and transformers that ``helpers`` uses, in one place.

A private name (an underscore, a private module, the inside of an object a library builds such as ZeRO's
optimizer state) can change in any release without notice. Each one is wrapped here in a small function or
constant that says what for; the rest of ``helpers`` calls these. Each declares what it reads (``@reads``),
filling ``PRIVATE_APIS``; ``tests/test_internals.py`` fails, naming the API, when one is gone. All read from
torch 2.13.0, deepspeed 0.19.8, accelerate 1.15.0 and transformers 5.23.0.

Not here: ``helpers/facts/`` (reads library sources on purpose); Python's documented ``sys._getframe``, ``os._exit``;
ZeRO-3's ``ds_*`` attributes on every parameter (``ds_numel``, ``ds_tensor``...), which other libraries read too
(transformers' Trainer: ``ds_numel``). Nothing here imports a library when this module is imported."""

from __future__ import annotations

from typing import Any, NamedTuple

PRIVATE_APIS: list[tuple[str, str, str]] = []  # (library, where, the name here that reads it)


def reads(library: str, *where: str, name: str | None = None):
    """Record in ``PRIVATE_APIS`` what the decorated wrapper (or constant ``name``) reads: ``"module:Name.attr"``
    (getattr; for what a class sets on its objects, its annotations or source) or ``"module#text in its source"``."""
    def mark(fn):
        PRIVATE_APIS.extend((library, w, name or fn.__name__) for w in where)
        return fn
    return mark(None) if name else mark


def on(prefix: str, *attrs: str) -> list[str]:
    return [prefix + a for a in attrs]


# --------------------------------------------------------------------------- torch: FSDP2, DTensor
_FS = "torch.distributed.fsdp._fully_shard._fsdp_"


class FsdpParam(NamedTuple):
    """One FSDP2 parameter, read from torch's private FSDPParam and FSDPParamGroup."""
    param: Any  # the sharded DTensor parameter the optimizer updates (FSDPParam.sharded_param)
    compute_dtype: Any  # the unit's MixedPrecisionPolicy.param_dtype, else the parameter's own dtype
    reduce_dtype: Any  # its gradient's reduce dtype (FSDPParam.reduce_dtype, else param_dtype, else orig_dtype)
    offloaded: bool  # kept on the host by CPUOffloadPolicy (FSDPParam.offload_to_cpu)


@reads("torch", "torch.distributed.fsdp:FSDPModule._get_fsdp_state", f"{_FS}state:FSDPState._fsdp_param_groups",
       *on(f"{_FS}param_group:FSDPParamGroup.", "fsdp_params", "mp_policy"),
       *on(f"{_FS}param:FSDPParam.", "sharded_param", "reduce_dtype", "param_dtype", "orig_dtype", "offload_to_cpu"))
def fsdp_params(model):
    """Every FSDP2 parameter as an ``FsdpParam``, each group once (norm + lm_head share one; ``reduce_dtype`` is
    None until FSDP2's lazy init, at the first forward). For the precision probe, update tracker, offload."""
    from torch.distributed.fsdp import FSDPModule
    seen = set()
    for m in model.modules():
        for group in m._get_fsdp_state()._fsdp_param_groups if isinstance(m, FSDPModule) else []:
            for f in group.fsdp_params if id(group) not in seen else []:
                late = [getattr(f, a, None) for a in ("reduce_dtype", "param_dtype", "orig_dtype")]
                yield FsdpParam(f.sharded_param, group.mp_policy.param_dtype or f.sharded_param.dtype,
                                late[0] or late[1] or late[2], f.offload_to_cpu)
            seen.add(id(group))


@reads("torch", "torch.distributed.fsdp:FSDPModule._get_fsdp_state")
def fsdp_unit_count(model) -> int:
    """FSDP units: one per ``fully_shard`` call (modules sharded together, the norm + lm_head tail, share one
    state), as ``helpers.job.wrap.units`` plans them."""
    from torch.distributed.fsdp import FSDPModule
    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


@reads("torch", "torch.distributed.tensor._utils:compute_local_shape_and_global_offset")
def dtensor_global_offset(p) -> tuple[int, ...]:
    """Where this rank's piece of DTensor ``p`` starts in the whole, per dimension. For the tensor tracer."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    return tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])


# --------------------------------------------------------------------------- torch: profiler, c10d, extensions
@reads("torch", *on("torch._C._autograd:", "_prepare_profiler", "_enable_profiler"),
       *on("torch._C._profiler:", "ProfilerConfig", "ProfilerState.KINETO", "_ExperimentalConfig"))
def cpu_memory_profiler_start() -> None:
    """Start torch's profiler on this thread: ops, and each CPU allocation and free with the allocator's running
    total, without ``torch.profiler.profile``'s per-step Python. For the CPU tensor peak (job.observe.tensor_peak)."""
    from torch._C._autograd import _enable_profiler, _prepare_profiler
    from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig
    from torch.profiler import ProfilerActivity
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU})


@reads("torch", *on("torch._C._autograd:", "_disable_profiler", "_ProfilerResult.experimental_event_tree"))
def cpu_memory_profiler_stop(read: bool = True) -> list | None:
    """Stop it; with ``read``, the root events of what it recorded, for ``profiler_events``."""
    from torch._C._autograd import _disable_profiler
    result = _disable_profiler()
    return list(result.experimental_event_tree()) if read else None


@reads("torch", *on("torch._C._profiler:_ProfilerEvent.", "children", "name", "start_time_ns", "end_time_ns",
                    "extra_fields"), *on("torch._C._profiler:_ExtraFields_Allocation.", "total_allocated", "device"))
def profiler_events(roots):
    """Every event under ``roots`` (any order) as ``(event, name, start_ns, end_ns, total)``, ``total`` the CPU
    allocator's running total at a CPU allocation or free, else None."""
    stack = list(roots)
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        f = e.extra_fields
        total = f.total_allocated if hasattr(f, "total_allocated") and f.device.type == "cpu" else None
        yield e, e.name, e.start_time_ns, e.end_time_ns, total


@reads("torch", "torch.distributed.distributed_c10d:_device_capability")
def group_device_types(group=None) -> list[str]:
    """Device types a process group has a backend for (gloo: ['cpu', 'cuda'], nccl: ['cuda']). For job.comm."""
    from torch.distributed.distributed_c10d import _device_capability
    return _device_capability(group)


@reads("torch", "torch.utils.cpp_extension:_get_build_directory")
def extension_build_dir(name: str) -> str:
    """Where torch's JIT extension builder builds op ``name``. For job.ops: DeepSpeed's op builds."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, verbose=False)


# --------------------------------------------------------------------------- torch: modules, checkpoints
_CW = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"  # checkpoint_wrapper keeps the block in this attribute (memory)
CHECKPOINT_PREFIX = CHECKPOINT_WRAPPED + "."  # ... and adds to parameter names (core.models.clean_fqn drops it)
reads("torch", f'{_CW}#_CHECKPOINT_WRAPPED_MODULE = "{CHECKPOINT_WRAPPED}"', name="CHECKPOINT_WRAPPED")


@reads("torch", *on(f"{_CW}:", "checkpoint_wrapper", "offload_wrapper"))
def checkpoint_wrappers():
    """(checkpoint_wrapper, offload_wrapper), torch's activation checkpointing for FSDP. For job.recompute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper
    return checkpoint_wrapper, offload_wrapper


@reads("torch", "torch.nn:Module._non_persistent_buffers_set")
def non_persistent_buffers(m) -> set[str]:
    """Names of ``m``'s buffers left out of its state dict (RoPE's ``inv_freq``). For job.loading.fix_rotary."""
    return set(m._non_persistent_buffers_set)


@reads("torch", "torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING",
       "torch.distributed.checkpoint.filesystem:_StorageInfo", "torch.serialization:_get_layout")
def dcp_pickled_private() -> dict[tuple[str, str], Any]:
    """Private names DCP pickles into ``.metadata``, keyed (module, name), for core.safeload's allow-list."""
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    out = {(c.__module__, c.__qualname__): c for c in (md._MEM_FORMAT_ENCODING, fs._StorageInfo)}
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> layout lookup
    return out


@reads("torch", "torch.distributed.checkpoint.default_planner:_EmptyStateDictLoadPlanner")
def dcp_empty_load_planner():
    """DCP's planner that builds the state dict from the checkpoint. For core.safeload (no model at hand)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    return _EmptyStateDictLoadPlanner


# --------------------------------------------------------------------------- transformers, Accelerate
@reads("transformers", *on("transformers:PreTrainedConfig.", "_attn_implementation",
                           "_attn_implementation_internal"), "transformers:PreTrainedModel._supports_sdpa",
       "transformers.models.auto.modeling_auto:MODEL_FOR_CAUSAL_LM_MAPPING")
def default_attn_implementation(cfg) -> str:
    """Set ``cfg``'s attention implementation unless its config.json chose one: sdpa where the model class supports
    it, else eager (transformers refuses sdpa for a class whose ``_supports_sdpa`` is False: fact
    transformers.sdpa_needs_class_support). Returns the implementation the model will use. For core.models."""
    if getattr(cfg, "_attn_implementation_internal", None) is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
        cfg._attn_implementation = "sdpa" if cls is None or cls._supports_sdpa else "eager"
    return cfg._attn_implementation


@reads("transformers", "transformers:PreTrainedConfig._attn_implementation")
def attn_implementation(model) -> str | None:
    """The attention implementation a built model runs. For job.observe.settings."""
    return getattr(model.config, "_attn_implementation", None)


@reads("transformers", "transformers:PreTrainedModel._no_split_modules")
def no_split_modules(model) -> list[str]:
    """Block classes the model says must stay whole. For job.wrap: TRANSFORMER_BASED_WRAP's default classes."""
    return list(getattr(model, "_no_split_modules", None) or [])


@reads("accelerate", "accelerate.utils.fsdp_utils:_find_final_norm")
def final_norm(model):
    """The final norm, which Accelerate's ``fsdp2_prepare_model`` shards in one unit with lm_head. For job.wrap."""
    from accelerate.utils.fsdp_utils import _find_final_norm
    return _find_final_norm(model)


# --------------------------------------------------------------------------- DeepSpeed: ops, start-up
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"  # ZeRO imports it to ask "is this a Muon?"
reads("deepspeed", f"{MUON_MODULE}:MuonWithAuxAdam", name="MUON_MODULE")


@reads("deepspeed", "deepspeed.ops.op_builder.builder:OpBuilder._loaded_ops")
def register_loaded_op(name: str, module) -> None:
    """Make ``module`` what ``OpBuilder.load()`` returns for op ``name``. For job.ops (the faster async_io build)."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    OpBuilder._loaded_ops[name] = module


@reads("deepspeed", *on("deepspeed.runtime.compiler:", "compile", "dummy_decorator"))
def import_without_compile(module: str) -> None:
    """Import a DeepSpeed module with DeepSpeed's ``compiler.compile`` swapped for its no-op fallback meanwhile.
    For backends.deepspeed: ``MUON_MODULE`` calls torch.compile at import (~1 s of every job's start-up)."""
    import importlib

    from deepspeed.runtime import compiler
    compile_ = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator
    try:
        importlib.import_module(module)
    except ImportError:  # another DeepSpeed version: nothing to spare
        pass
    finally:
        compiler.compile = compile_


# --------------------------------------------------------------------------- DeepSpeed: inside the ZeRO optimizers
# For job.observe.memory, offload, precision, tensor_trace (what each rank holds, and where) and job.checkpoint
# (importing a checkpoint into a live engine). ZeRO-0 under bf16 is FP16_UnfusedOptimizer.
_S3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3."
_S12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
_S0 = "deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer."
_SW = "deepspeed.runtime.swap_tensor."


@reads("deepspeed", _S3 + "optimizer", _S12 + "optimizer", _S0 + "optimizer")
def torch_optimizer(optimizer):
    """The torch optimizer that does the update: ZeRO's wrapper's ``.optimizer``; any other as it is."""
    return getattr(optimizer, "optimizer", optimizer)


@reads("deepspeed", _S3 + "fp32_partitioned_groups_flat", _S12 + "single_partition_of_fp32_groups")
def zero_flat_masters(zopt) -> list:
    """ZeRO 1-3's fp32 master partitions, one flat tensor per group (ZeRO-3: sub-group); [] otherwise."""
    return getattr(zopt, "fp32_partitioned_groups_flat", None) or getattr(zopt, "single_partition_of_fp32_groups", [])


@reads("deepspeed", _S3 + "fp16_groups", _S12 + "bit16_groups")
def zero_param_groups(zopt) -> list:
    """ZeRO 1-3: the module's parameters per group, in the order of ``zero_flat_masters``."""
    return zopt.fp16_groups if hasattr(zopt, "fp32_partitioned_groups_flat") else zopt.bit16_groups


@reads("deepspeed", _S0 + "fp32_groups")
def zero0_masters(zopt) -> list | None:
    """ZeRO-0 under bf16/fp16: one fp32 master per parameter; None when there is none (fp32)."""
    return [p for g in zopt.fp32_groups for p in g] if hasattr(zopt, "fp32_groups") else None


@reads("deepspeed", _S12 + "bit16_groups_flat")
def zero12_flat_params(zopt) -> list:
    """ZeRO-1/2: the flat buffers the module's parameters are views of."""
    return list(zopt.bit16_groups_flat)


@reads("deepspeed", _S3 + "grad_partitions_flat_buffer", _S12 + "averaged_gradients")
def zero_grads(zopt) -> list:
    """ZeRO 1-3: the reduced gradient partitions kept for the step (ZeRO-3: one flat buffer)."""
    if hasattr(zopt, "grad_partitions_flat_buffer"):
        return [zopt.grad_partitions_flat_buffer]
    return [g for gs in zopt.averaged_gradients.values() for g in (gs or [])]


@reads("deepspeed", _S3 + "grad_position", _S3 + "get_param_id")
def zero3_grad_position(zopt, p) -> tuple[int, int, int]:
    """ZeRO-3: (sub-group, offset in its flat master, partition size) of parameter ``p`` on this rank."""
    g, offset, part = zopt.grad_position[zopt.get_param_id(p)]
    return g, offset, part


@reads("deepspeed", *on(_S3, "offload_optimizer", "offload_param", "swap_optimizer"), _S12 + "cpu_offload")
def zero_offload(zopt) -> dict[str, bool]:
    """What a ZeRO optimizer offloads: ``optimizer`` (master, states, gradients), ``params`` (ZeRO-3's
    partitions), ``optimizer_on_nvme`` (ZeRO-3: master and states swapped to NVMe)."""
    flag = lambda name: bool(getattr(zopt, name, False))  # noqa: E731
    return {"optimizer": flag("offload_optimizer") or flag("cpu_offload"), "params": flag("offload_param"),
            "optimizer_on_nvme": flag("swap_optimizer")}


@reads("deepspeed", _S3 + "master_weights_and_grads_dtype", _S12 + "master_weights_and_grads_dtype")
def zero_master_dtype(zopt):
    """The dtype of the masters and of the gradients the optimizer reads."""
    return zopt.master_weights_and_grads_dtype


@reads("deepspeed", _S3 + "optimizer_swapper",
       *on(f"{_SW}optimizer_utils:", "OptimizerSwapper.swap_params_info", "OptimizerStateSwapInfo.unswapped_gradients"))
def zero3_unswapped_grads(zopt) -> list:
    """ZeRO-3, optimizer on NVMe: fp32 gradient pieces too small to swap, held in host memory for the step."""
    swap_info = getattr(getattr(zopt, "optimizer_swapper", None), "swap_params_info", {})
    return [t for info in swap_info.values() for t in info.unswapped_gradients.values()]


@reads("deepspeed", "deepspeed.runtime.zero.partition_parameters#ds_tensor.final_location = ")
def zero3_partition_on_nvme(p) -> bool:
    """ZeRO-3: does parameter ``p``'s partition live in an NVMe swap file?"""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    return getattr(p.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme


@reads("deepspeed", "deepspeed.runtime.zero.partition_parameters#param.nvme_swapper = ",
       f"{_SW}partitioned_param_swapper:AsyncPartitionedParameterSwapper.buffers", _S3 + "optimizer_swapper",
       f"{_SW}optimizer_utils:OptimizerSwapper.swap_buffer_manager", f"{_SW}utils:SwapBufferManager.all_buffers")
def zero3_swap_buffers(zopt, params) -> dict[str, list]:
    """ZeRO-3 with NVMe: the page-locked host buffers of the parameter swapper and of the optimizer swapper."""
    swappers = {id(s): s for p in params if (s := getattr(p, "nvme_swapper", None)) is not None}
    manager = getattr(getattr(zopt, "optimizer_swapper", None), "swap_buffer_manager", None)
    return {"params": [s.buffers for s in swappers.values()], "optimizer": list(getattr(manager, "all_buffers", []))}
