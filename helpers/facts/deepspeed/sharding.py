"""DeepSpeed (0.19.8) facts the guide states about launching (notebook 00) and sharding (01).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
from unittest import mock

from .. import fact
from .._tools import ds_engine, field_default, linear_stack, resolve, source_has

V = "0.19.8"
ZERO = "deepspeed.runtime.zero.config.DeepSpeedZeroConfig"


def _step(engine, width: int = 16):
    """One forward, backward and optimizer step of ``engine`` on a (1, width) batch."""
    import torch

    x = torch.ones(1, width, dtype=next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().sum())
    engine.step()


def _initialize(zero: dict, model=None, optimizer=None, **config):
    """``deepspeed.initialize`` with a config section (e.g. ``bf16``) or optimizer that ``ds_engine`` fixes."""
    import deepspeed
    import torch

    model = model if model is not None else linear_stack()
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "bf16": {"enabled": True},
           "zero_optimization": zero, "steps_per_print": 10**12, **config}
    return deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)[0]


def _stage3(**zero):
    return ds_engine({"stage": 3, "memory_efficient_linear": False, **zero})  # keep torch's F.linear in place


@fact("deepspeed.bf16_default_dtypes",
      "With bf16 on and default settings, DeepSpeed keeps the model's weights and gradients in bf16 and a separate "
      "fp32 master copy; Adam's two moments are fp32, on that master: 2 + 2 + 12 bytes per parameter.",
      "deepspeed", V, "runtime/engine.py: _configure_distributed_model, get_data_types; "
      "runtime/base_optimizer.py: _configure_master_weights", runs=True)
def _bf16_dtypes():
    e = ds_engine({"stage": 1})
    _step(e)
    opt = e.optimizer
    master = opt.single_partition_of_fp32_groups[0]
    state = opt.optimizer.state[master]
    ev = {"params": str(next(e.module.parameters()).dtype), "grad_buffer": str(e.get_data_types()[1]),
          "master": str(master.dtype), "exp_avg": str(state["exp_avg"].dtype),
          "exp_avg_sq": str(state["exp_avg_sq"].dtype)}
    want = {"params": "torch.bfloat16", "grad_buffer": "torch.bfloat16", "master": "torch.float32",
            "exp_avg": "torch.float32", "exp_avg_sq": "torch.float32"}
    return ev == want, ev


@fact("deepspeed.zero3_bf16_dtypes",
      "ZeRO-3 with bf16 shards a bf16 module: bf16 weight and gradient partitions, bf16 reductions, and a separate "
      "fp32 master partition for the optimizer.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions; "
      "runtime/engine.py: communication_data_type", runs=True)
def _zero3_dtypes():
    import torch

    e = _stage3()
    opt = e.optimizer
    p = next(e.module.parameters())
    ev = {"param_partition": str(p.ds_tensor.dtype), "grad_partitions": str(opt.grad_partitions_flat_buffer.dtype),
          "reduce": str(e.communication_data_type), "master": str(opt.fp32_partitioned_groups_flat[0].dtype)}
    ok = (p.ds_tensor.dtype == opt.grad_partitions_flat_buffer.dtype == e.communication_data_type == torch.bfloat16
          and opt.fp32_partitioned_groups_flat[0].dtype == torch.float32)
    return ok, ev


@fact("deepspeed.zero_stage_partitions",
      "ZeRO-1 shards the optimizer states (and fp32 master), ZeRO-2 the gradients too, ZeRO-3 the weights too.",
      "deepspeed", V, "runtime/engine.py: _configure_zero_optimizer (partition_grads = stage == 2); "
      "runtime/zero/partition_parameters.py", runs=True)
def _stages():
    e1, e2, e3 = ds_engine({"stage": 1}), ds_engine({"stage": 2}), _stage3()
    ev = {"stage1_partition_gradients": e1.optimizer.partition_gradients,
          "stage2_partition_gradients": e2.optimizer.partition_gradients,
          "stage2_params_partitioned": hasattr(next(e2.module.parameters()), "ds_tensor"),
          "stage3_params_partitioned": hasattr(next(e3.module.parameters()), "ds_tensor")}
    return ev == {"stage1_partition_gradients": False, "stage2_partition_gradients": True,
                  "stage2_params_partitioned": False, "stage3_params_partitioned": True}, ev


@fact("deepspeed.zero1_reduces_at_boundary",
      "ZeRO-1 keeps each rank's full gradients through backward and across accumulation micro-batches and reduces "
      "them into per-rank partitions at the accumulation boundary; ZeRO-2 reduces bucket by bucket during backward.",
      "deepspeed", V, "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.reduce_ready_partitions_and_remove_grads")
def _zero1_boundary():
    holds, ev = source_has(
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.reduce_ready_partitions_and_remove_grads",
        "if self.partition_gradients or self.is_gradient_accumulation_boundary() or self.zenflow: "
        "self.reduce_independent_p_g_buckets_and_remove_grads(param, i)")
    overlap = {s: resolve(ZERO)(stage=s).overlap_comm for s in (1, 3)}  # on: reduce from the backward hooks
    ev["overlap_comm default"] = f"stage 1: {overlap[1]}, stage 3: {overlap[3]}"
    return holds and not overlap[1] and overlap[3], ev


@fact("deepspeed.zero12_flat_buffer_per_group",
      "DeepSpeed's stage-1/2 optimizer flattens each optimizer param group, in the group's order, into one buffer "
      "and gives each rank a contiguous slice of it.",
      "deepspeed", V, "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.__init__ (bit16_groups_flat)", runs=True)
def _flat_buffers():
    import torch

    model = linear_stack(3)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}], lr=1e-3)
    e = _initialize({"stage": 1}, model=model, optimizer=opt)
    zo = e.optimizer
    in_order = [id(p) for g in zo.bit16_groups for p in g] == [id(p) for p in e.module.parameters()]
    ev = {"param_groups": len(opt.param_groups), "flat_buffers": len(zo.bit16_groups_flat),
          "same_order": in_order, "round_robin_gradients": zo.round_robin_gradients}
    return ev["flat_buffers"] == 2 and in_order and not zo.round_robin_gradients, ev


@fact("deepspeed.zero12_straddler_whole_grad",
      "With DeepSpeed's default bf16 gradient buffer, a ZeRO-1/2 rank sizes its gradient buffer by the whole of "
      "every parameter its slice touches, so a parameter straddling a slice edge keeps its whole gradient on each "
      "rank it touches until the step (an fp32 grad_accum_dtype switches to a slice-sized buffer).",
      "deepspeed", V, "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.copy_grads_in_partition, "
      "_use_compact_grad_partition_buffer")
def _straddler():
    cls = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
    a, ev = source_has(f"{cls}.copy_grads_in_partition",
                       "for group in self.params_in_partition: for param_in_partition in group: "
                       "total_size += param_in_partition.numel()")
    b, ev2 = source_has(f"{cls}._use_compact_grad_partition_buffer",
                        "if gradient_accumulation_dtype != torch.float32 or gradient_accumulation_dtype == "
                        "self.dtype: return False")
    return a and b, {**ev, "compact buffer only for": "fp32 grad_accum_dtype"} if a and b else {**ev, **ev2}


@fact("deepspeed.zero3_per_param_partitions",
      "ZeRO-3 partitions each parameter separately (a ds_tensor per parameter), with no flat buffer shared across "
      "parameters.",
      "deepspeed", V, "runtime/zero/partition_parameters.py: Init._partition_param", runs=True)
def _zero3_partitions():
    e = _stage3()
    ps = list(e.module.parameters())
    ok = all(p.ds_tensor.ds_numel == p.partition_numel() == p.ds_numel for p in ps)  # one rank: whole
    return ok, {"parameters": len(ps), "each with its own ds_tensor": ok}


@fact("deepspeed.zero3_persistent_small_params",
      "ZeRO-3 keeps parameters of at most stage3_param_persistence_threshold elements (default 100000) whole on "
      "every rank after their first gather.",
      "deepspeed", V, "runtime/zero/parameter_offload.py: mark_persistent_parameters", runs=True)
def _persistent():
    e = _stage3(stage3_param_persistence_threshold=16)  # Linear(16, 16): bias 16 (persists), weight 256 (not)
    persist = {n: p.ds_persist for n, p in e.module.named_parameters()}
    default = field_default(ZERO, "param_persistence_threshold")
    ok = default == 100000 and persist["0.bias"] and not persist["0.weight"]
    return ok, {"default threshold": default, "test threshold": 16, "bias(16) persists": persist["0.bias"],
                "weight(256) persists": persist["0.weight"]}


@fact("deepspeed.zero2_whole_params",
      "ZeRO-2 keeps the whole bf16 parameters on every rank (one flat buffer of all of them).",
      "deepspeed", V, "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.__init__ (bit16_groups_flat)", runs=True)
def _zero2_whole():
    e = ds_engine({"stage": 2})
    n = sum(p.numel() for p in e.module.parameters())
    flat = sum(f.numel() for f in e.optimizer.bit16_groups_flat)
    return flat >= n, {"model elements": n, "flat buffer elements on this rank": flat}


@fact("deepspeed.zero0_replicates",
      "ZeRO-0 shards nothing: no ZeRO optimizer, and whole gradients are all-reduced across ranks, as in DDP.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.zero_optimization, allreduce_gradients", runs=True)
def _zero0():
    e = ds_engine({"stage": 0})
    holds, ev = source_has("deepspeed.runtime.engine",  # allreduce_gradients (nvtx-wrapped: read the module)

                           "elif self.is_gradient_accumulation_boundary(): if self.zero_optimization_stage() == "
                           "ZeroStageEnum.optimizer_states and hasattr( self.optimizer, 'reduce_gradients'): "
                           "self.optimizer.reduce_gradients(pipeline_parallel=self.pipeline_parallelism) else: grads = "
                           "None self.buffered_allreduce_fallback(grads=grads, elements_per_buffer=bucket_size)")
    ev["zero_optimization()"] = e.zero_optimization()
    return holds and not e.zero_optimization(), ev


@fact("deepspeed.zero3_swaps_linear",
      "ZeRO-3 replaces torch.nn.functional.linear with its own function process-wide, unless "
      "zero_optimization.memory_efficient_linear is false (default true).",
      "deepspeed", V, "runtime/zero/partition_parameters.py: _enable_mem_efficient_linear", runs=True)
def _swap_linear():
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    torch_linear = F.linear
    try:
        ds_engine({"stage": 3})
        swapped = F.linear is zero3_linear_wrap
    finally:
        F.linear = torch_linear
    _stage3()
    kept = F.linear is torch_linear
    default = field_default(ZERO, "memory_efficient_linear")
    return swapped and kept and default is True, {"default": default, "swapped": swapped, "false keeps torch's": kept}


@fact("deepspeed.zero3_linear_rounds_bias",
      "ZeRO-3's linear computes a matmul and then adds the bias as a second bf16 operation for batch x sequence "
      "(3-D) inputs, so a layer with a bias rounds differently from torch's linear there (without a bias, or for "
      "2-D inputs, they agree).",
      "deepspeed", V, "runtime/zero/linear.py: LinearFunctionForZeroStage3.forward")
def _linear_rounding():
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g).bfloat16()
    w, b = torch.randn(64, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    torch_linear = torch._C._nn.linear  # torch's own, whatever F.linear is now
    with_bias = torch.equal(torch_linear(x, w, b), zero3_linear_wrap(x, w, b))
    without = torch.equal(torch_linear(x, w), zero3_linear_wrap(x, w))
    flat = x.reshape(-1, 64)
    two_d = torch.equal(torch_linear(flat, w, b), zero3_linear_wrap(flat, w, b))
    return (not with_bias) and without and two_d, {"3-D equal with bias": with_bias, "3-D equal without bias": without,
                                                   "2-D equal with bias": two_d}


@fact("deepspeed.ds_accelerator_env",
      "DeepSpeed takes its accelerator from the DS_ACCELERATOR environment variable when it is set (cpu here).",
      "deepspeed", V, "accelerator/real_accelerator.py: get_accelerator", runs=True)
def _ds_accelerator():
    from deepspeed.accelerator import real_accelerator as ra

    saved = ra.ds_accelerator
    try:
        ra.ds_accelerator = None
        with mock.patch.dict(os.environ, {"DS_ACCELERATOR": "cpu"}):
            name = ra.get_accelerator().device_name()
    finally:
        ra.ds_accelerator = saved
    return name == "cpu", {"DS_ACCELERATOR": "cpu", "device_name()": name}


@fact("deepspeed.hpz_secondary_shard",
      "ZeRO++ hpZ (zero_hpz_partition_size) keeps ZeRO-3's partitions across all ranks and adds a secondary "
      "partition of each parameter, in the parameter's dtype (bf16 here), within each group for the all-gathers.",
      "deepspeed", V, "runtime/zero/partition_parameters.py: Init._partition_param_sec")
def _hpz():
    holds, ev = source_has("deepspeed.runtime.zero.partition_parameters",  # Init._partition_param_sec (nvtx-wrapped)

                           "secondary_partition_size = int(tensor_size // self.num_ranks_in_param_group)",
                           "secondary_partitioned_tensor = torch.empty(secondary_partition_size, "
                           "dtype=param.dtype,")
    default = field_default(ZERO, "zero_hpz_partition_size")
    ev["zero_hpz_partition_size default"] = default
    return holds and default == 1, ev


@fact("deepspeed.offload_keys",
      "DeepSpeed offloads parameters (offload_param, ZeRO-3) and optimizer states (offload_optimizer) under two "
      "separate keys, each to cpu or nvme.",
      "deepspeed", V, "runtime/zero/config.py: DeepSpeedZeroConfig; runtime/zero/offload_config.py")
def _offload():
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    fields = resolve(ZERO).model_fields
    ev = {"fields": "offload_param" if "offload_param" in fields else "-",
          "and": "offload_optimizer" if "offload_optimizer" in fields else "-",
          "devices": ",".join(d.value for d in OffloadDeviceEnum)}
    return ev["fields"] == "offload_param" and ev["and"] == "offload_optimizer" and "nvme" in ev["devices"], ev


@fact("deepspeed.save_16bit_one_file",
      "DeepSpeed's save_16bit_model (zero3_save_16bit_model) writes the consolidated 16-bit weights to one file, "
      "pytorch_model.bin by default.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.save_16bit_model")
def _save16():
    import inspect

    fn = resolve("deepspeed.runtime.engine.DeepSpeedEngine.save_16bit_model")
    default = inspect.signature(fn).parameters["save_filename"].default
    holds, ev = source_has("deepspeed.runtime.engine.DeepSpeedEngine.save_16bit_model",
                           "state_dict = self._zero3_consolidated_16bit_state_dict(")
    return holds and default == "pytorch_model.bin", {"save_filename": default, **ev}


@fact("deepspeed.prefetch_bucket_elements",
      "ZeRO-3 prefetches parameters ahead up to stage3_prefetch_bucket_size parameter elements (default 5e7); "
      "a bucket size of 0 prefetches nothing.",
      "deepspeed", V, "runtime/zero/partitioned_param_coordinator.py: PartitionedParameterCoordinator.fetch_sub_module")
def _prefetch():
    import inspect

    cls = resolve(ZERO)
    doc = " ".join((cls.model_fields["prefetch_bucket_size"].description or inspect.getsource(cls)).split())
    holds, ev = source_has("deepspeed.runtime.zero.partitioned_param_coordinator",  # fetch_sub_module (nvtx-wrapped)
                           "if self.__prefetch_bucket_sz > 0:",
                           "while self.__param_queue and numel_prefetching < max_params_to_prefetch:")
    default = field_default(ZERO, "prefetch_bucket_size")
    ok = holds and default == 5e7 and "Maximum number of parameter elements to fetch ahead" in doc
    return ok, {"default": default, **ev}


@fact("deepspeed.bf16_master_weights_option",
      "DeepSpeed keeps an fp32 master with bf16 on unless bf16.bf16_master_weights_and_grads is set (ZeRO-1/2/3), "
      "which makes the master bf16.",
      "deepspeed", V, "runtime/base_optimizer.py: ZeROOptimizer._configure_master_weights; "
      "runtime/precision_config.py", runs=True)
def _bf16_master():
    import torch

    default = ds_engine({"stage": 1}).optimizer.single_partition_of_fp32_groups[0].dtype
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    master = _initialize({"stage": 1}, bf16=bf16).optimizer.single_partition_of_fp32_groups[0].dtype
    return default == torch.float32 and master == torch.bfloat16, {"default master": str(default),
                                                                   "with the key": str(master)}


@fact("deepspeed.no_bf16_keeps_model_dtype",
      "With bf16.enabled false DeepSpeed does not cast the model: it trains in the dtype the model was loaded in.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._configure_distributed_model", runs=True)
def _no_cast():
    import torch

    e32 = ds_engine({"stage": 1}, bf16=False)
    e16 = ds_engine({"stage": 0}, bf16=False, model=linear_stack(dtype=torch.bfloat16))
    a, b = next(e32.module.parameters()).dtype, next(e16.module.parameters()).dtype
    return a == torch.float32 and b == torch.bfloat16, {"fp32 model": str(a), "bf16 model": str(b)}


@fact("deepspeed.reduce_dtype_keys",
      "DeepSpeed sets the gradient buffer dtype with data_types.grad_accum_dtype and the reduction dtype with "
      "communication_data_type (both default to the model's bf16).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.get_data_types, communication_data_type", runs=True)
def _reduce_keys():
    import torch

    d = ds_engine({"stage": 1})
    f = ds_engine({"stage": 1}, data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32")
    ev = {"default buffer": str(d.get_data_types()[1]), "default reduce": str(d.communication_data_type),
          "set buffer": str(f.get_data_types()[1]), "set reduce": str(f.communication_data_type)}
    ok = (d.get_data_types()[1] == d.communication_data_type == torch.bfloat16
          and f.get_data_types()[1] == f.communication_data_type == torch.float32)
    return ok, ev


def _optimizer_class(stage: int, **extra) -> str:
    return type(ds_engine({"stage": stage}, **extra).optimizer).__name__


@fact("deepspeed.zero0_bf16_optimizer",
      "DeepSpeed runs ZeRO-0 in bf16 (with its default bf16 gradient-accumulation dtype) through a separate "
      "optimizer wrapper, FP16_UnfusedOptimizer (not BF16_Optimizer), instead of its ZeRO code.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._do_optimizer_sanity_check, _configure_fp16_optimizer",
      runs=True)
def _zero0_bf16():
    name = _optimizer_class(0)
    return name == "FP16_UnfusedOptimizer", {"optimizer": name}


@fact("deepspeed.zero_optimizer_classes",
      "ZeRO-1 and ZeRO-2 run one ZeRO optimizer class (DeepSpeedZeroOptimizer, stage_1_and_2.py); ZeRO-3 runs "
      "another (DeepSpeedZeroOptimizer_Stage3, stage3.py).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._configure_zero_optimizer", runs=True)
def _zero_classes():
    names = {s: _optimizer_class(s) for s in (1, 2, 3)}
    ok = names[1] == names[2] == "DeepSpeedZeroOptimizer" and names[3] == "DeepSpeedZeroOptimizer_Stage3"
    return ok, {f"stage{s}": n for s, n in names.items()}


@fact("deepspeed.gradient_clipping_default",
      "DeepSpeed clips gradients at a norm of 1.0 when the config has no gradient_clipping key.",
      "deepspeed", V, "runtime/config.py: get_gradient_clipping (GRADIENT_CLIPPING_DEFAULT)")
def _clip_default():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import get_gradient_clipping

    clip = get_gradient_clipping({})
    return clip == 1.0, {"gradient_clipping": clip}


@fact("deepspeed.hpz_secondary_dropped_after_step",
      "ZeRO++ hpZ drops each parameter's secondary partition after every optimizer step, so the next forward "
      "all-gathers from the primary partitions across all ranks.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3._post_step, invalidate_secondary_tensor")
def _hpz_drop():
    # hpZ needs groups of 2 or more ranks: the fact rests on the pinned code's text
    s3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
    post, ev = source_has(f"{s3}._post_step", "self.invalidate_secondary_tensor()")
    drop, ev2 = source_has(f"{s3}.invalidate_secondary_tensor", "param.ds_secondary_tensor = None")
    return post and drop, {**ev, "and": ev2.get("source has", ev2)}

