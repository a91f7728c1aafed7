"""DeepSpeed (0.19.8) facts the guide states about precision (02) and offload (03).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

from .. import fact, gpu_fact
from .._tools import ds_engine, field_default, linear_stack, messages, resolve, source_has

V = "0.19.8"
S3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
OPT_SWAP = "deepspeed.runtime.swap_tensor.optimizer_utils.OptimizerSwapper"
PARAM_SWAP = "deepspeed.runtime.swap_tensor.partitioned_param_swapper.AsyncPartitionedParameterSwapper"
CPU = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
OFFLOAD_OPT = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
_ENGINES: dict = {}


def _zero3(**extra):
    """A one-rank ZeRO-3 bf16 engine on two Linear layers (one per distinct config, built once per process)."""
    key = repr(sorted(extra.items()))
    if key not in _ENGINES:
        zero = {"stage": 3, **extra.pop("zero", {})}
        _ENGINES[key] = ds_engine(zero, **extra)
    return _ENGINES[key]


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read(dotted: str, *snippets: str) -> tuple[bool, dict]:
    """``source_has``, seeing through DeepSpeed's ``instrument_w_nvtx`` (a wrapper without functools.wraps)."""
    import inspect

    with mock.patch.dict(os.environ, CPU):
        obj = resolve(dotted)
    inner = [c.cell_contents for c in getattr(obj, "__closure__", None) or ()
             if inspect.isfunction(c.cell_contents) and c.cell_contents.__name__ == dotted.rsplit(".", 1)[1]]
    if not inner:
        with mock.patch.dict(os.environ, CPU):
            return source_has(dotted, *snippets)
    src = " ".join(inspect.getsource(inner[0]).split())
    missing = [s for s in snippets if " ".join(s.split()) not in src]
    return not missing, ({"missing": missing} if missing else {"source has": " | ".join(snippets)})


# -- notebook 02: precision ------------------------------------------------------------------------------------





@fact("deepspeed.zero3_fp32_grad_copy_for_step",
      "At the step ZeRO-3 hands the optimizer an fp32 copy of its reduced bf16 gradient partition.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group")
def _fp32_copy():
    return _read(f"{S3}._prepare_fp32_grad_for_sub_group",
                 "self.flatten(self.averaged_gradients[sub_group_id]).to( "
                 "self.fp32_partitioned_groups_flat[sub_group_id].dtype)")


@fact("deepspeed.zero3_bf16_partition_is_rounded_master",
      "After each step ZeRO-3 copies its fp32 master into the bf16 partition: the bf16 shard is the master rounded.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_"
      "parameters")
def _rounded():
    return _read(f"{S3}._reassign_or_swap_out_partitioned_parameters",
                 "self.fp16_partitioned_groups_flat[sub_group_id].data.copy_( "
                 "self.fp32_partitioned_groups_flat[sub_group_id].data)")


@fact("deepspeed.zero3_persistent_keep_partition",
      "ZeRO-3 keeps parameters of at most stage3_param_persistence_threshold elements (100k by default) whole on "
      "every rank, next to their own 1/N partition (on one rank the partition is the whole tensor).",
      "deepspeed", V, "runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload.mark_persistent_parameters; "
      "runtime/zero/config.py: param_persistence_threshold", runs=True)
def _persistence():
    default = field_default("deepspeed.runtime.zero.config.DeepSpeedZeroConfig", "param_persistence_threshold")
    at = _zero3(zero={"stage3_param_persistence_threshold": 256})  # the weights have 256 elements
    under = _zero3(zero={"stage3_param_persistence_threshold": 255})
    w_at, w_under = next(at.module.parameters()), next(under.module.parameters())
    ev = {"default": default, "256-element weight, threshold 256": w_at.ds_persist,
          "threshold 255": w_under.ds_persist, "partition / numel": f"{w_at.ds_tensor.numel()}/{w_at.ds_numel}"}
    return (default == 100_000 and w_at.ds_persist and not w_under.ds_persist
            and w_at.ds_tensor.numel() == w_at.ds_numel), ev



@fact("deepspeed.zero3_linear_adds_bias_after",
      "ZeRO-3's linear computes input @ weight.T in bf16 and then adds the bias, a second bf16 rounding, for 3-D "
      "inputs (batch x sequence); for 2-D inputs it uses addmm, like torch. With a zero bias both agree.",
      "deepspeed", V, "runtime/zero/linear.py: LinearFunctionForZeroStage3.forward")
def _zero3_linear():
    import torch

    with mock.patch.dict(os.environ, CPU):
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 64, generator=g).bfloat16()
    w, b = torch.randn(32, 64, generator=g).bfloat16() / 8, torch.randn(32, generator=g).bfloat16()
    lin = torch._C._nn.linear  # torch's own, whatever F.linear is now

    def gap(x, b):
        return int((lin(x, w, b) != zero3_linear_wrap(x, w, b)).sum())

    ev = {"3-D, bias": gap(x, b), "2-D, bias": gap(x.reshape(-1, 64), b), "3-D, zero bias": gap(x, 0 * b)}
    return ev["3-D, bias"] > 0 and ev["2-D, bias"] == 0 and ev["3-D, zero bias"] == 0, {
        f"outputs differing from torch's, {k}": v for k, v in ev.items()}


@fact("deepspeed.zero3_grad_norm_fp64",
      "ZeRO-3 takes each local gradient's norm in fp64, sums their squares, all-reduces the sum, and clips by "
      "1 / max((norm + 1e-6) / clip, 1).",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct, "
      "unscale_and_clip_grads; runtime/zero/utils.py: get_norm_dtype")
def _norm():
    import torch

    ok1, ev1 = _read(f"{S3}.get_grad_norm_direct", ".to(get_norm_dtype()).norm(norm_type))",
                     "torch.sum(torch.pow(torch.stack(grad_norms), norm_type))",
                     "dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM")
    ok2, ev2 = _read(f"{S3}.unscale_and_clip_grads", "clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad",
                     "clip = torch.clamp(clip, min=1.0)")
    with mock.patch.dict(os.environ, CPU):
        dt = resolve("deepspeed.runtime.zero.utils.get_norm_dtype")()
    return ok1 and ok2 and dt == torch.float64, {"norm dtype (CPU accelerator)": _name(dt),
                                                 "norm": ev1.get("missing", "ok"), "clip": ev2.get("missing", "ok")}


@fact("deepspeed.zero12_grad_norm_fp32",
      "ZeRO-1/2 take each local gradient's norm in fp64 too, but cast the sum of their squares to fp32 before the "
      "all-reduce: the norm they report (and clip with) is an fp32 value, where ZeRO-3's is fp64.",
      "deepspeed", V, "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.get_grad_norm_direct")
def _norm12():
    return _read("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.get_grad_norm_direct",
                 "g.data.to(get_norm_dtype()).detach(), ord=norm_type)",
                 "total_norm = torch.stack(all_norms).pow(norm_type).sum().float()")


@fact("deepspeed.no_scheduler_section_constant_lr",
      "DeepSpeed builds no learning-rate scheduler when the JSON has no scheduler section and the script passes "
      "none: the rate stays constant.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._configure_lr_scheduler", runs=True)
def _no_sched():
    e = _zero3()
    return e.lr_scheduler is None, {"lr_scheduler": e.lr_scheduler}


@fact("deepspeed.backward_divides_by_grad_accum",
      "DeepSpeed's engine.backward divides the loss by gradient_accumulation_steps: the micro-batch losses are "
      "averaged.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.backward")
def _gas():
    return _read("deepspeed.runtime.engine.DeepSpeedEngine.backward",
                 "loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss")


@fact("deepspeed.zero3_no_sync_refused",
      "ZeRO-3 refuses no_sync() (it is incompatible with gradient partitioning): run with engine.backward and "
      "engine.step per micro-batch, it reduces every micro-batch (coalesce_grad_reduction() would defer that; the "
      "guide does not use it).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.no_sync, coalesce_grad_reduction", runs=True)
def _no_sync():
    e = _zero3()

    def enter():
        with e.no_sync():
            pass

    out, _ = messages(enter)
    refused = isinstance(out, AssertionError) and "incompatible with gradient partitioning" in str(out)
    return refused and hasattr(e, "coalesce_grad_reduction"), {
        "no_sync()": f"{type(out).__name__}: {out}" if out is not None else "allowed",
        "coalesce_grad_reduction": hasattr(e, "coalesce_grad_reduction")}


@fact("deepspeed.zero3_adds_reduced_grads",
      "Across micro-batches ZeRO-3 adds each reduced gradient partition into its gradient buffer, in "
      "gradient_accumulation_dtype.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3.partition_grads")
def _adds():
    return _read(f"{S3}.partition_grads",
                 "grad_buffer.add_(grad_partition.to(self.gradient_accumulation_dtype).view(grad_buffer.shape))")


# -- notebook 03: offload ---------------------------------------------------------------------------------------

@fact("deepspeed.nvme_min_aio_bytes",
      "DeepSpeed swaps to NVMe only tensors of at least MIN_AIO_BYTES (1 MiB) per rank, or aio.block_size if "
      "larger; smaller ones stay in host memory.",
      "deepspeed", V, "runtime/swap_tensor/utils.py: MIN_AIO_BYTES; optimizer_utils.py: OptimizerSwapper; "
      "partitioned_param_swapper.py: AsyncPartitionedParameterSwapper._configure_aio")
def _min_aio():
    with mock.patch.dict(os.environ, CPU):
        m = resolve("deepspeed.runtime.swap_tensor.utils.MIN_AIO_BYTES")
    ok1, _ = _read(f"{OPT_SWAP}.__init__", "self.min_aio_bytes = max(MIN_AIO_BYTES, aio_config[AIO_BLOCK_SIZE])")
    ok2, _ = _read(f"{PARAM_SWAP}._configure_aio",
                   "self.min_aio_bytes = max(MIN_AIO_BYTES, self.aio_config[AIO_BLOCK_SIZE])")
    ok3, _ = _read(f"{OPT_SWAP}.is_swappable_tensor", "return self.min_aio_bytes <= (tensor.numel() * "
                   "self.swap_element_size)")
    return m == 2**20 and ok1 and ok2 and ok3, {"MIN_AIO_BYTES": m, "both swappers take max(it, block_size)":
                                                ok1 and ok2, "optimizer swaps when bytes >= it": ok3}


@fact("deepspeed.zero3_one_flat_partition_per_rank",
      "ZeRO-3 holds the optimizer's fp32 partition as one flat buffer per sub-group of sub_group_size (1e9 by "
      "default) elements: one buffer per rank for a model this size.",
      "deepspeed", V, "runtime/zero/config.py: sub_group_size; runtime/zero/stage3.py: _create_fp32_partitions")
def _sub_group():
    with mock.patch.dict(os.environ, CPU):
        d = field_default("deepspeed.runtime.zero.config.DeepSpeedZeroConfig", "sub_group_size")
    return d == 10**9, {"sub_group_size default": d}


@fact("deepspeed.nvme_params_read_back_max_in_cpu",
      "ZeRO-3 swaps large-enough parameter partitions out to NVMe as it builds the model, then reads them back "
      "into a host buffer for good, as far as offload_param.max_in_cpu (1e9 elements by default) allows.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3._move_to_flat_buffer; "
      "runtime/zero/offload_config.py: max_in_cpu")
def _max_in_cpu():
    with mock.patch.dict(os.environ, CPU):
        d = field_default("deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig", "max_in_cpu")
    ok, ev = _read(f"{S3}._move_to_flat_buffer", "permanently to CPU", "param.ds_tensor.final_location = 'not-nvme'")
    return ok and d == 10**9, {"max_in_cpu default": d, **ev}


@fact("deepspeed.async_io_needs_libaio",
      "DeepSpeed's NVMe swapping uses its async_io C++ op, built on first use against libaio (libaio-dev on "
      "Debian/Ubuntu).",
      "deepspeed", V, "ops/op_builder/async_io.py: AsyncIOBuilder")
def _aio():
    ok1, _ = _read("deepspeed.ops.op_builder.async_io.AsyncIOBuilder.check_for_libaio_pkg", '"libaio-dev"')
    with mock.patch.dict(os.environ, CPU):
        libs = resolve("deepspeed.ops.op_builder.async_io.AsyncIOBuilder")().extra_ldflags()
    return ok1 and "-laio" in libs, {"package looked for": "libaio-dev" if ok1 else "missing", "links": libs}



@fact("deepspeed.nvme_small_partitions_in_host",
      "With offload_param on NVMe, a parameter partition under the swap minimum ends up in host memory and is never "
      "swapped (a persistent parameter's is made on the device first, then copied to ZeRO-3's host buffer).",
      "deepspeed", V, "runtime/zero/partition_parameters.py: Init._partition_param")
def _small_in_host():
    return _read("deepspeed.runtime.zero.partition_parameters.Init._partition_param",
                 "elif self.remote_device == OffloadDeviceEnum.nvme: device = OffloadDeviceEnum.cpu")



@fact("deepspeed.offload_optimizer_keeps_fp32_grads",
      "With offload_optimizer on the CPU, ZeRO-3 keeps an fp32 gradient buffer on the host from the start, between "
      "steps; without offload it makes the fp32 copy during the step and frees it after.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states, "
      "_release_sub_group", runs=True)
def _fp32_grads():
    off = _zero3(zero=OFFLOAD_OPT, zero_force_ds_cpu_optimizer=False).optimizer.fp32_partitioned_groups_flat[0].grad
    none = _zero3().optimizer.fp32_partitioned_groups_flat[0].grad
    ok, _ = _read(f"{S3}._release_sub_group",
                  "if not self.offload_optimizer: self.fp32_partitioned_groups_flat[sub_group_id].grad = None")
    ev = {"offload: fp32 grad after init": None if off is None else _name(off.dtype),
          "no offload": none, "freed after the step only without offload": ok}
    return off is not None and off.dtype.is_floating_point and off.element_size() == 4 and none is None and ok, ev


@fact("deepspeed.nvme_small_grads_wait_in_host",
      "With the optimizer on NVMe, ZeRO-3 converts the gradient to fp32 at the end of backward and swaps out "
      "pieces of at least the swap minimum; smaller pieces wait in host memory for the step.",
      "deepspeed", V, "runtime/swap_tensor/optimizer_utils.py: OptimizerSwapper._swap_out_gradients")
def _grads_wait():
    return _read(f"{OPT_SWAP}._swap_out_gradients", "swap_info.unswapped_gradients[offset] = tensor")


@fact("deepspeed.nvme_swaps_states_not_step",
      "With the optimizer on NVMe, the fp32 master and each optimizer state tensor over the swap minimum are swap "
      "files; smaller states (Adam's step counter) stay in memory.",
      "deepspeed", V, "runtime/swap_tensor/optimizer_utils.py: OptimizerSwapper._get_state_tensors")
def _states():
    return _read(f"{OPT_SWAP}._get_state_tensors",
                 "if torch.is_tensor(value) and self.is_swappable_tensor(tensor=value):")


@fact("deepspeed.nvme_swap_file_paths",
      "ZeRO-3 writes each rank's swap files under nvme_path/zero_stage_3/<kind>/rank<r>/, the optimizer's as "
      "<id>.tensor.swp, a relative nvme_path taken from the working directory.",
      "deepspeed", V, "runtime/swap_tensor/optimizer_utils.py: OptimizerSwapper, SwapTensorContext; "
      "runtime/zero/stage3.py: _configure_tensor_swapping")
def _paths():
    ok1, _ = _read(f"{OPT_SWAP}.__init__", "os.path.join(base_folder, 'optimizer', f'rank{dist.get_rank()}')")
    ok2, _ = _read("deepspeed.runtime.swap_tensor.optimizer_utils.SwapTensorContext.__init__",
                   "f'{OptimizerSwapper.parameter_id(tensor)}.tensor.swp'")
    ok3, _ = _read(f"{S3}._configure_tensor_swapping",
                   "os.path.join(offload_optimizer_config.nvme_path, 'zero_stage_3')")
    return ok1 and ok2 and ok3, {"zero_stage_3/": ok3, "optimizer/rank{r}/": ok1, "{id}.tensor.swp": ok2}


@fact("deepspeed.aio_aligned_bytes",
      "DeepSpeed rounds each swap file up to its I/O alignment, AIO_ALIGNED_BYTES (1024) times "
      "aio.intra_op_parallelism (1 by default).",
      "deepspeed", V, "runtime/swap_tensor/optimizer_utils.py: OptimizerSwapper.__init__; utils.py")
def _aligned():
    with mock.patch.dict(os.environ, CPU):
        a = resolve("deepspeed.runtime.swap_tensor.utils.AIO_ALIGNED_BYTES")
        p = resolve("deepspeed.runtime.swap_tensor.constants.AIO_INTRA_OP_PARALLELISM_DEFAULT")
    ok, _ = _read(f"{OPT_SWAP}.__init__", "AIO_ALIGNED_BYTES * aio_config[AIO_INTRA_OP_PARALLELISM]")
    return ok and a == 1024 and p == 1, {"AIO_ALIGNED_BYTES": a, "intra_op_parallelism default": p}


@fact("deepspeed.nvme_param_swapper_locked_buffers",
      "When offload_param goes to nvme, DeepSpeed's parameter swapper allocates buffer_count x buffer_size "
      "(5 x 1e8 by default) elements of page-locked host memory per rank as it starts.",
      "deepspeed", V, "runtime/swap_tensor/partitioned_param_swapper.py: AsyncPartitionedParameterSwapper."
      "_configure_aio; runtime/zero/offload_config.py")
def _locked():
    ok, _ = _read(f"{PARAM_SWAP}._configure_aio", "self.aligned_elements_per_buffer * self.param_buffer_count",
                  "self.aio_read_handle.new_cpu_locked_tensor(")
    cfg = "deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig"
    with mock.patch.dict(os.environ, CPU):
        count, size = field_default(cfg, "buffer_count"), field_default(cfg, "buffer_size")
    return ok and count == 5 and size == 10**8, {"buffer_count": count, "buffer_size": size,
                                                 "page-locked at construction": ok}


@fact("deepspeed.aio_o_direct",
      "DeepSpeed's async I/O op opens the swap files with O_DIRECT, past the page cache.",
      "deepspeed", V, "ops/csrc/aio/common/deepspeed_aio_common.cpp: open_file")
def _o_direct():
    import importlib.util

    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    src = (root / "ops/csrc/aio/common/deepspeed_aio_common.cpp").read_text()
    flags = "read_op ? (O_RDONLY | O_DIRECT) : (O_WRONLY | O_CREAT | O_DIRECT)"
    return flags in src, {"open flags": flags if flags in src else "changed"}


@fact("deepspeed.offload_needs_force_cpu_optimizer_off",
      "DeepSpeed refuses a torch optimizer with offload_optimizer unless the JSON sets "
      "zero_force_ds_cpu_optimizer: false (default true); with it false, the torch AdamW itself steps on the host.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._configure_optimizer; runtime/constants.py", runs=True)
def _force():
    from deepspeed.runtime.constants import ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT as d

    out, _ = messages(ds_engine, OFFLOAD_OPT)
    ok_engine = _zero3(zero=OFFLOAD_OPT, zero_force_ds_cpu_optimizer=False)
    base = type(ok_engine.optimizer.optimizer).__name__
    return d is True and type(out).__name__ == "ZeRORuntimeException" and base == "AdamW", {
        "default": d, "without the key": type(out).__name__, "with false, host optimizer": base}


gpu_fact("deepspeed.offload_optimizer_steps_on_host",
         "On a GPU, with offload_optimizer DeepSpeed runs the optimizer step on the host's cores, and the updated "
         "partitions go back to the GPU.",
         "deepspeed", V, "runtime/zero/offload_config.py: DeepSpeedZeroOffloadOptimizerConfig; runtime/zero/stage3.py",
         "host and device are one memory without an accelerator")


_ = linear_stack  # the builders' default model: two Linear(16, 16) layers (256-element weights, 16-element biases)


@fact("deepspeed.cpu_accelerator_pin_noop",
      "DeepSpeed's CPU accelerator treats pin_memory as a no-op: it returns the tensor as it is, unpinned "
      "(unless DS_PIN_MEMORY_BACKEND=native).",
      "deepspeed", V, "accelerator/cpu_accelerator.py: CPU_Accelerator.pin_memory")
def _cpu_pin():
    import torch

    with mock.patch.dict(os.environ, CPU):
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        env = {k: v for k, v in os.environ.items() if k != "DS_PIN_MEMORY_BACKEND"}
        with mock.patch.dict(os.environ, env, clear=True):
            t = torch.ones(4)
            out = CPU_Accelerator().pin_memory(t)
    return out is t and not out.is_pinned(), {"same tensor": out is t, "pinned": out.is_pinned()}
