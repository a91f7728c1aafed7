"""DeepSpeed (0.19.8) facts the guide states about prefetch (04), loading (05) and checkpoints (06).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from unittest import mock

from .. import fact
from .._tools import ds_engine, linear_stack, messages, resolve, scratch, source_has

V = "0.19.8"
COORD = "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator"


def _gathers_per_step(**zero) -> list[list[int]]:
    """Per step (two steps), the size in tensors of each all-gather ZeRO-3 issues for two Linear layers
    (weight + bias each), every parameter sharded."""
    import torch

    coord = resolve(COORD)
    name = "_PartitionedParameterCoordinator__all_gather_params_"
    orig, calls = getattr(coord, name), []

    def record(self, params, forward, quantize=False):
        calls.append(len(params))
        return orig(self, params, forward, quantize=quantize)

    eng = ds_engine({"stage": 3, "stage3_param_persistence_threshold": 0, **zero}, model=linear_stack(bias=True))
    steps = []
    with mock.patch.object(coord, name, record):
        for _ in range(2):
            calls.clear()
            eng.backward(eng(torch.ones(1, 16, dtype=torch.bfloat16)).float().sum())
            eng.step()
            steps.append(list(calls))
    return steps


@fact("deepspeed.zero3_gathers_per_module",
      "ZeRO-3 without prefetch gathers each module's own parameters when that module runs (one gather per "
      "module, all its tensors together), in forward and again in backward.",
      "deepspeed", V, "runtime/zero/partitioned_param_coordinator.py: PartitionedParameterCoordinator."
      "_fetch_sub_module_impl (params_to_fetch = the running module's own parameters)", runs=True)
def _per_module():
    steps = _gathers_per_step(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0,
                              stage3_max_live_parameters=0)
    # two Linear modules of two tensors each: 2 gathers in forward + 2 in backward, 2 tensors each
    return steps[1] == [2, 2, 2, 2], {"modules": 2, "tensors_per_module": 2, "gathers_step2 (tensors each)": steps[1]}


@fact("deepspeed.zero3_bucket_gathers_once",
      "With a prefetch bucket (stage3_prefetch_bucket_size, default 5e7 elements) and stage3_max_live_parameters "
      "both larger than the model, ZeRO-3 fetches the whole model in its first gather of a step (one all-gather, "
      "every tensor merged) and keeps it until each parameter's last use in backward, from its second step on (the "
      "first step records the modules' order and gathers module by module: gathers_step1).",
      "deepspeed", V, "runtime/zero/partitioned_param_coordinator.py: _fetch_sub_module_impl (prefetch from the "
      "recorded trace), __params_to_release; runtime/zero/config.py: prefetch_bucket_size", runs=True)
def _bucket_once():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    steps = _gathers_per_step(stage3_prefetch_bucket_size=50_000_000, stage3_max_reuse_distance=10**9,
                              stage3_max_live_parameters=10**9)
    default = DeepSpeedZeroConfig().prefetch_bucket_size
    # step 1 records the trace (no prefetch yet); from step 2 one gather brings all 4 tensors
    return steps[1] == [4] and default == 50_000_000, {
        "gathers_step1": steps[0], "gathers_step2": steps[1], "default_prefetch_bucket_size": default}


@fact("deepspeed.zero3_release_not_by_max_live",
      "ZeRO-3 keeps a gathered parameter while the prefetcher has already covered a later use of it or it is used "
      "again within stage3_max_reuse_distance elements; stage3_max_live_parameters only caps how much it "
      "prefetches, and releasing does not read it.",
      "deepspeed", V, "runtime/zero/partitioned_param_coordinator.py: PartitionedParameterCoordinator."
      "__params_to_release, _fetch_sub_module_impl")
def _release_rule():
    import inspect

    src = inspect.getsource(resolve(COORD))  # its methods are wrapped (nvtx): cut them from the class text

    def method(name):
        return src.split(f"def {name}(", 1)[1].split("\n    def ", 1)[0]

    release, fetch = method("__params_to_release"), method("_fetch_sub_module_impl")
    reads_reuse = "self.__max_reuse_dist_in_numel" in release and "__most_recent_step_id_param_fetched_for" in release
    live_in_release = "__max_n_available_params" in release
    live_caps_prefetch = "min(self.__max_n_available_params - self.__n_available_params" in " ".join(fetch.split())
    return reads_reuse and live_caps_prefetch and not live_in_release, {
        "release reads max_reuse_distance": reads_reuse, "release reads max_live": live_in_release,
        "prefetch capped by max_live": live_caps_prefetch}


@fact("deepspeed.zero3_persistence_threshold_zero",
      "stage3_param_persistence_threshold: 0 makes ZeRO-3 shard every parameter; by default (1e5 elements) it "
      "keeps small parameters whole on every rank.",
      "deepspeed", V, "runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload.mark_persistent_parameters",
      runs=True)
def _persistence():
    default = ds_engine({"stage": 3}, model=linear_stack(bias=True))
    zero = ds_engine({"stage": 3, "stage3_param_persistence_threshold": 0}, model=linear_stack(bias=True))
    d = [p.ds_persist for p in default.module.parameters()]
    z = [p.ds_persist for p in zero.module.parameters()]
    return all(d) and not any(z), {"persistent_by_default (4 tensors of <=256)": sum(d), "persistent_at_0": sum(z)}


@fact("deepspeed.zero3_async_all_gather",
      "DeepSpeed ZeRO-3 issues its all-gathers asynchronously (async_op=True): a prefetched gather moves its bytes "
      "while the training thread goes on; the gather of the module about to run is waited on at once.",
      "deepspeed", V, "runtime/zero/partition_parameters.py: _dist_allgather_fn; "
      "runtime/zero/partitioned_param_coordinator.py: PartitionedParameterCoordinator._fetch_sub_module_impl")
def _async_gather():
    ok, ev = source_has("deepspeed.runtime.zero.partition_parameters._dist_allgather_fn",
                        "dist.allgather_fn)(output_tensor, input_tensor, group=group, async_op=True)")
    ok2, ev2 = source_has("deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator."
                          "_fetch_sub_module_impl", ".pop(param).wait(")
    return ok and ok2, {**ev, **ev2}


@fact("deepspeed.zero3_backward_gather_in_autograd_node",
      "ZeRO-3 gathers a module's parameters for backward from the backward of an autograd node, "
      "PreBackwardFunctionForModule.",
      "deepspeed", V, "runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload._register_deepspeed_module, "
      "pre_sub_module_backward_function")
def _pre_backward_node():
    ok, ev = source_has("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module",
                        "class PreBackwardFunctionForModule(torch.autograd.Function)",
                        "ctx.pre_backward_function(ctx.module)", "self.pre_sub_module_backward_function(sub_module)")
    ok2, ev2 = source_has("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload."
                          "pre_sub_module_backward_function",
                          "param_coordinator.fetch_sub_module(sub_module, forward=False)")
    return ok and ok2, {**ev, "pre_sub_module_backward_function": ev2}


@fact("deepspeed.zero3_leaf_modules",
      "DeepSpeed asks for no wrap policy: set_z3_leaf_modules or stage3_module_granularity_threshold (0, off, by "
      "default) can make a subtree one gather.",
      "deepspeed", V, "utils/z3_leaf_module.py: set_z3_leaf_modules; runtime/zero/config.py: "
      "module_granularity_threshold")
def _leaf():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils import set_z3_leaf_modules, z3_leaf_module

    m = linear_stack()
    set_z3_leaf_modules(m, [type(m)])
    thr = DeepSpeedZeroConfig().module_granularity_threshold
    return z3_leaf_module(m) and thr == 0, {"z3_leaf_module after set_z3_leaf_modules": z3_leaf_module(m),
                                            "module_granularity_threshold": thr}


@fact("deepspeed.engine_compile_module",
      "DeepSpeed's engine.compile() compiles the wrapped module (module.compile).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.compile")
def _compile():
    return source_has("deepspeed.runtime.engine.DeepSpeedEngine.compile",
                      "self.module.compile(**{**compile_kwargs, 'backend': backend})")


@fact("deepspeed.zero3_hooks_and_dynamo",
      "ZeRO-3 excludes two per-module hooks from dynamo (torch.compiler.disable): the pre-forward hook, which "
      "gathers, and the post-backward hook, which releases; the others (post-forward, pre-backward) are traced.",
      "deepspeed", V, "runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload._register_deepspeed_module")
def _z3_dynamo():
    ok, ev = source_has("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module",
                        "@torch.compiler.disable def _pre_forward_module_hook(module, *args):",
                        "@torch.compiler.disable def _post_backward_module_hook(module, inputs):",
                        "def _post_forward_module_hook(module, input, output):")
    import inspect

    src = " ".join(inspect.getsource(resolve("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload."
                                             "_register_deepspeed_module")).split())
    traced = all(f"@torch.compiler.disable def {h}" not in src and f"def {h}" in src
                 for h in ("_post_forward_module_hook", "_pre_backward_module_hook"))
    return ok and traced, {**ev, "post_forward and pre_backward hooks traced": traced}


@fact("deepspeed.zero_init_partitions_on_creation",
      "Inside deepspeed.zero.Init each module's parameters are partitioned as soon as that module is created.",
      "deepspeed", V, "runtime/zero/partition_parameters.py: Init._post_init_method", runs=True)
def _zero_init():
    import deepspeed
    import torch

    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        lin = torch.nn.Linear(16, 16)
    w = lin.weight
    ok = hasattr(w, "ds_id") and w.numel() == 0 and w.ds_numel == 256
    return ok, {"ds_status": str(w.ds_status), "local_numel": w.numel(), "ds_numel": w.ds_numel}


@fact("deepspeed.initialize_fp32_master",
      "deepspeed.initialize builds ZeRO-3's fp32 master partitions of the bf16 weights (the optimizer's), after "
      "the model exists.",
      "deepspeed", V, "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3.__init__ "
      "(fp32_partitioned_groups_flat)", runs=True)
def _fp32_master():
    eng = ds_engine({"stage": 3})
    dt = eng.optimizer.fp32_partitioned_groups_flat[0].dtype
    mdt = next(eng.module.parameters()).dtype
    import torch

    return dt == torch.float32, {"master_dtype": str(dt), "module_dtype": str(mdt)}


@functools.cache
def _saved_zero3() -> Path:
    """A one-rank ZeRO-3 bf16 engine after one step, saved with save_checkpoint (tag ds) and save_16bit_model."""
    import torch

    eng = ds_engine({"stage": 3, "stage3_param_persistence_threshold": 0,
                     "stage3_gather_16bit_weights_on_model_save": True},
                    model=linear_stack(bias=False, dtype=torch.bfloat16))
    eng.backward(eng(torch.ones(1, 16, dtype=torch.bfloat16)).float().sum())
    eng.step()
    d = scratch("facts_ds_")
    eng.save_checkpoint(str(d), tag="ds", save_latest=False)
    eng.save_16bit_model(str(d), "model_16bit.bin")
    return d


def _files(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


@fact("deepspeed.zero3_checkpoint_files",
      "Under ZeRO-3, engine.save_checkpoint writes two files per rank (model states and optimizer states) and "
      "copies zero_to_fp32.py into the checkpoint folder, beside the tag folder that holds them.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.save_checkpoint, _save_checkpoint, "
      "_save_zero_checkpoint, _copy_recovery_script", runs=True)
def _ckpt_files():
    files = [f for f in _files(_saved_zero3()) if f != "model_16bit.bin"]
    want = {"ds/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "ds/zero_pp_rank_0_mp_rank_00_model_states.pt",
            "zero_to_fp32.py"}
    per_rank = [f for f in files if f.startswith("ds/")]
    return want <= set(files) and len(per_rank) == 2, {"files (1 rank)": files}


@fact("deepspeed.zero3_checkpoint_contents",
      "DeepSpeed's ZeRO-3 optimizer files hold the fp32 master partitions and Adam's two fp32 moments; its model "
      "files hold no weights (empty placeholders).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._save_checkpoint, _save_zero_checkpoint; "
      "runtime/zero/stage3.py: DeepSpeedZeroOptimizer_Stage3.state_dict", runs=True)
def _ckpt_contents():
    import torch

    d = _saved_zero3() / "ds"
    ms = torch.load(d / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    osd = torch.load(d / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
    module_numel = sum(v.numel() for v in ms["module"].values())
    fp32 = osd["fp32_flat_groups"]
    adam = {k: v for st in osd["optimizer_state_dict"]["state"].values() for k, v in st.items() if torch.is_tensor(v)}
    n = sum(t.numel() for t in fp32)
    ok = (module_numel == 0 and all(t.dtype == torch.float32 for t in fp32) and n == 512
          and all(adam[k].dtype == torch.float32 and adam[k].numel() == n for k in ("exp_avg", "exp_avg_sq")))
    return ok, {"model_states module numel": module_numel, "fp32_flat_groups numel (512 params)": n,
                "adam": {k: f"{str(v.dtype)[6:]}x{v.numel()}" for k, v in adam.items() if v.numel() > 1}}


@fact("deepspeed.save_16bit_model_weights_only",
      "With stage3_gather_16bit_weights_on_model_save: true, engine.save_16bit_model gathers the weights in bf16 "
      "into one file, weights only (no optimizer state).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine.save_16bit_model, _zero3_consolidated_16bit_state_dict",
      runs=True)
def _16bit():
    import torch

    sd = torch.load(_saved_zero3() / "model_16bit.bin", weights_only=True)
    dtypes = sorted({str(v.dtype) for v in sd.values()})
    return dtypes == ["torch.bfloat16"] and sorted(sd) == ["0.weight", "1.weight"], {
        "keys": sorted(sd), "dtypes": dtypes, "numel": sum(v.numel() for v in sd.values())}


@fact("deepspeed.zero_checkpoint_fixed_world_size",
      "DeepSpeed's native ZeRO checkpoint loads with its optimizer state only at the world size that wrote it.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._load_zero_checkpoint", runs=True)
def _fixed_world():
    import torch

    d = scratch("facts_ds_")
    eng = ds_engine({"stage": 3})
    eng.save_checkpoint(str(d), tag="t", save_latest=False)
    p = d / "t" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ms = torch.load(p, weights_only=False)
    ms["dp_world_size"] = 2  # as if two ranks had written it
    torch.save(ms, p)
    out, _ = messages(eng.load_checkpoint, str(d), tag="t")
    msg = str(out)
    ok = type(out).__name__ == "ZeRORuntimeException" and "new world size is not currently supported" in msg
    return ok, {"loading a 2-rank checkpoint on 1 rank": f"{type(out).__name__}: ...{msg[-90:]}"}


@fact("deepspeed.universal_checkpoint_tools",
      "DeepSpeed's own ways around a fixed world size: ds_to_universal plus the config's checkpoint.load_universal "
      "(universal checkpoint), and zero_to_fp32 for the fp32 weights only.",
      "deepspeed", V, "checkpoint/ds_to_universal.py: main; runtime/constants.py: LOAD_UNIVERSAL_CHECKPOINT; "
      "utils/zero_to_fp32.py: get_fp32_state_dict_from_zero_checkpoint")
def _universal():
    import inspect

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.constants import LOAD_UNIVERSAL_CHECKPOINT
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tool = Path(resolve("deepspeed.checkpoint").__file__).with_name("ds_to_universal.py")
    params = list(inspect.signature(get_fp32_state_dict_from_zero_checkpoint).parameters)[:2]
    ok = tool.is_file() and LOAD_UNIVERSAL_CHECKPOINT == "load_universal" and params[0] == "checkpoint_dir"
    return ok, {"ds_to_universal.py": tool.is_file(), "config key": LOAD_UNIVERSAL_CHECKPOINT,
                "zero_to_fp32": f"get_fp32_state_dict_from_zero_checkpoint({', '.join(params)}, ...)"}


@fact("deepspeed.safe_set_full_state",
      "deepspeed.utils.safe_set_full_fp32_param(param, value) sets a parameter's fp32 master and "
      "safe_set_full_optimizer_state(param, value, optim_state_key) its Adam state, whatever the partitioning.",
      "deepspeed", V, "utils/tensor_fragment.py: safe_set_full_fp32_param, safe_set_full_optimizer_state")
def _safe_set():
    import inspect

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    a = list(inspect.signature(safe_set_full_fp32_param).parameters)
    b = list(inspect.signature(safe_set_full_optimizer_state).parameters)
    return a == ["param", "value"] and b == ["param", "value", "optim_state_key"], {
        "safe_set_full_fp32_param": a, "safe_set_full_optimizer_state": b}


@fact("deepspeed.zero12_link_state_after_step",
      "ZeRO-1/2 link each parameter to its slice of the optimizer state only after the first step.",
      "deepspeed", V, "runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.step (_lazy_init_hp_params_"
      "optimizer_state)", runs=True)
def _link_after_step():
    import torch
    from deepspeed.utils import safe_get_full_optimizer_state

    eng = ds_engine({"stage": 1})
    p = next(eng.module.parameters())
    before, _ = messages(safe_get_full_optimizer_state, p, "exp_avg")  # no state linked yet: None or an error
    eng.backward(eng(torch.ones(1, 16, dtype=torch.bfloat16)).float().sum())
    eng.step()
    after = safe_get_full_optimizer_state(p, "exp_avg")
    unlinked = before is None or isinstance(before, Exception)
    shape = tuple(after.shape) if torch.is_tensor(after) else after
    return unlinked and torch.is_tensor(after), {"exp_avg before step": type(before).__name__, "after step": shape}
