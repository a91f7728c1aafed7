"""Accelerate (1.15.0) facts the guide states about launching (notebook 00) and sharding (01).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from unittest import mock

from .. import REPO, fact
from .._tools import messages, source_has

V = "1.15.0"
ZERO3_JSON = str(REPO / "launch_configs/deepspeed/zero3.json")


def _fsdp2_plugin(env: dict | None = None, **kwargs):
    """Accelerate's FSDP plugin for fsdp_version 2, built from ``env`` (restored afterwards: it writes env vars)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    with mock.patch.dict(os.environ, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", **(env or {})}):
        return messages(FullyShardedDataParallelPlugin, **kwargs)


def _ds_plugin(env: dict, **kwargs):
    """Accelerate's DeepSpeed plugin built under ``env`` (restored afterwards); (plugin or exception, messages)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from accelerate.utils import DeepSpeedPlugin

    with mock.patch.dict(os.environ, {"ACCELERATE_USE_DEEPSPEED": "true", **env}):
        return messages(DeepSpeedPlugin, **kwargs)


@fact("accelerate.fsdp2_bf16_fp32_shards",
      "Accelerate's FSDP2 path with mixed_precision bf16 upcasts the model's trainable params to fp32 before "
      "sharding and sets MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): fp32 shards, bf16 compute.",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_prepare_model; utils/dataclasses.py: "
      "FullyShardedDataParallelPlugin.set_mixed_precision")
def _fsdp2_mixed():
    import torch

    plugin, _ = _fsdp2_plugin()
    plugin.set_mixed_precision("bf16")
    pol = plugin.mixed_precision_policy
    holds, ev = source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                           "if param.requires_grad and param.dtype != torch.float32:",
                           "param.data = param.data.to(torch.float32)")
    ok = holds and pol.param_dtype == pol.reduce_dtype == torch.bfloat16
    return ok, {"param_dtype": str(pol.param_dtype), "reduce_dtype": str(pol.reduce_dtype), **ev}


@fact("accelerate.launch_config_keys",
      "Every key of launch_configs/fsdp/full_shard.yaml and launch_configs/deepspeed/zero3.yaml is one "
      "`accelerate launch --config_file` reads.",
      "accelerate", V, "commands/config/config_args.py: load_config_from_file; commands/launch.py: "
      "launch_command_parser")
def _config_keys():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    dests = {a.dest for a in launch_command_parser()._actions}
    ev, ok = {}, True
    for f in ("launch_configs/fsdp/full_shard.yaml", "launch_configs/deepspeed/zero3.yaml"):
        c = load_config_from_file(str(REPO / f))
        keys = set((c.fsdp_config or {}) | (c.deepspeed_config or {}))
        unknown = sorted(keys - dests)
        ok &= bool(keys) and not unknown
        ev[Path(f).name] = f"{len(keys)} keys, unknown: {unknown or 'none'}"
    return ok, ev


def _distributed_type(env: dict) -> str:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    base = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "ACCELERATE_MIXED_PRECISION": "bf16", "DS_ACCELERATOR": "cpu"}
    AcceleratorState._reset_state(True)
    try:
        with mock.patch.dict(os.environ, {**base, **env}), mock.patch("torch.cuda.is_available", return_value=False):
            return Accelerator().distributed_type.value  # as on a machine without GPUs
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()


@fact("accelerate.cpu_fsdp_falls_back",
      "On a machine without GPUs, Accelerate does not run its FSDP path: with distributed_type FSDP it falls back "
      "to no sharding (DistributedType.NO, or MULTI_CPU with use_cpu).",
      "accelerate", V, "state.py: PartialState.__init__, AcceleratorState.__init__ (via Accelerator())", runs=True)
def _cpu_fsdp():
    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    plain, cpu = _distributed_type(fsdp), _distributed_type({**fsdp, "ACCELERATE_USE_CPU": "true"})
    return plain == "NO" and cpu == "MULTI_CPU", {"FSDP config": plain, "with use_cpu": cpu}


@fact("accelerate.cpu_flag_skips_deepspeed",
      "On a machine without GPUs, Accelerate still selects its DeepSpeed path (DistributedType.DEEPSPEED); "
      "use_cpu: true turns it off (MULTI_CPU).",
      "accelerate", V, "state.py: PartialState.__init__ (the cpu flag), AcceleratorState.__init__", runs=True)
def _cpu_ds():
    ds = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO3_JSON}
    plain, cpu = _distributed_type(ds), _distributed_type({**ds, "ACCELERATE_USE_CPU": "true"})
    return plain == "DEEPSPEED" and cpu == "MULTI_CPU", {"DeepSpeed config": plain, "with use_cpu": cpu}


@fact("accelerate.yaml_clip_zero_dropped",
      "Accelerate drops a gradient_clipping of 0.0 written in the YAML's deepspeed_config: the DeepSpeed config it "
      "builds has no gradient_clipping key, so DeepSpeed's default applies.",
      "accelerate", V, "utils/dataclasses.py: DeepSpeedPlugin.__post_init__ (if self.gradient_clipping:)")
def _clip_zero():
    env = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_MIXED_PRECISION": "bf16"}
    zero, _ = _ds_plugin({**env, "ACCELERATE_GRADIENT_CLIPPING": "0.0"})
    half, _ = _ds_plugin({**env, "ACCELERATE_GRADIENT_CLIPPING": "0.5"})
    a, b = zero.deepspeed_config.get("gradient_clipping"), half.deepspeed_config.get("gradient_clipping")
    return a is None and b == 0.5, {"0.0 in the YAML ->": a or "no key", "0.5 in the YAML ->": b}


@fact("accelerate.launch_only_keys",
      "compute_environment, num_machines and num_processes are read from the config file only by "
      "`accelerate launch` (to start the processes); the Accelerator in a training process never reads the file.",
      "accelerate", V, "commands/launch.py: _validate_launch_command; accelerator.py, state.py")
def _launch_only():
    import accelerate.accelerator
    import accelerate.commands.launch
    import accelerate.state

    runtime = inspect.getsource(accelerate.accelerator) + inspect.getsource(accelerate.state)
    launch = inspect.getsource(accelerate.commands.launch)
    in_runtime = [k for k in ("load_config_from_file", "compute_environment", "num_machines") if k in runtime]
    ok = not in_runtime and "load_config_from_file" in launch and "num_machines" in launch
    return ok, {"runtime reads": in_runtime or "none of them", "launch reads": "load_config_from_file"}


@fact("accelerate.fsdp2_keeps_root_tail_gathered",
      "Accelerate's FSDP2 path applies fsdp_reshard_after_forward to the wrapped layers but wraps the final norm "
      "and lm_head with reshard_after_forward=False and leaves the root at torch's default (not resharded).",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_prepare_model")
def _root_tail():
    return source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                      'fully_shard(tail, **{**fsdp2_kwargs, "reshard_after_forward": False})',
                      'root_kwargs = {k: v for k, v in fsdp2_kwargs.items() if k != "reshard_after_forward"}')


@fact("accelerate.ds_config_file_refuses_keys",
      "With deepspeed_config_file, Accelerate refuses mixed_precision, zero_stage, gradient_clipping and the other "
      "settings the JSON holds if the YAML also sets them.",
      "accelerate", V, "utils/dataclasses.py: DeepSpeedPlugin._deepspeed_config_checks")
def _refuses():
    ok_fields = "deepspeed_config_file,zero3_init_flag"
    fine, _ = _ds_plugin({"ACCELERATE_CONFIG_DS_FIELDS": ok_fields}, hf_ds_config=ZERO3_JSON)
    bad, _ = _ds_plugin({"ACCELERATE_CONFIG_DS_FIELDS": ok_fields + ",gradient_clipping"}, hf_ds_config=ZERO3_JSON)
    refused = isinstance(bad, ValueError) and "deepspeed_config_file" in str(bad)
    return refused and not isinstance(fine, Exception), {
        "YAML with gradient_clipping": type(bad).__name__, "message": str(bad)[:70],
        "YAML with zero3_init_flag only": type(fine).__name__}


@fact("accelerate.low_memory_loading",
      "Accelerate's zero3_init_flag works only under ZeRO-3 (set with another stage it is turned off with a "
      "warning); fsdp_cpu_ram_efficient_loading loads the weights on rank 0 and sends them to the other ranks.",
      "accelerate", V, "utils/dataclasses.py: DeepSpeedPlugin.__post_init__; utils/fsdp_utils.py: "
      "fsdp2_prepare_model, fsdp2_load_full_state_dict")
def _loading():
    plugin, msgs = _ds_plugin({}, hf_ds_config={"zero_optimization": {"stage": 2}}, zero3_init_flag=True)
    holds, ev = source_has("accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict",
                           "if accelerator.is_main_process:", "dist.broadcast(")
    warned = any("Zero3 Init flag is only applicable for ZeRO Stage 3" in m for m in msgs)
    return holds and plugin.zero3_init_flag is False and warned, {
        "zero3_init_flag under ZeRO-2": plugin.zero3_init_flag, "warned": warned, **ev}


@fact("accelerate.full_state_dict_one_file",
      "With fsdp_state_dict_type FULL_STATE_DICT, Accelerate's save_fsdp_model writes the whole model to one file "
      "(pytorch_model_fsdp.bin) from rank 0, in the params' dtype (fp32 under bf16 mixed precision).",
      "accelerate", V, "utils/fsdp_utils.py: save_fsdp_model")
def _full_sd():
    from accelerate.utils.constants import FSDP_MODEL_NAME

    holds, ev = source_has("accelerate.utils.fsdp_utils.save_fsdp_model",
                           'weights_name = f"{FSDP_MODEL_NAME}.bin" if model_index == 0',
                           "if accelerator.process_index == 0:", "torch.save(state_dict, output_model_file)")
    return holds, {"file": f"{FSDP_MODEL_NAME}.bin", **ev}


@fact("accelerate.fsdp2_ignores_prefetch_keys",
      "Under fsdp_version 2 Accelerate ignores fsdp_backward_prefetch (it sets it to None with a warning) and "
      "does not read fsdp_forward_prefetch.",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__")
def _prefetch():
    plugin, msgs = _fsdp2_plugin({"FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE", "FSDP_FORWARD_PREFETCH": "true"})
    v1, _ = messages(lambda: _fsdp2_plugin({"FSDP_VERSION": "1", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE"})[0])
    ok = plugin.backward_prefetch is None and plugin.forward_prefetch is None and v1.backward_prefetch is not None
    return ok, {"v2 backward_prefetch": plugin.backward_prefetch, "v2 forward_prefetch": plugin.forward_prefetch,
                "v1 backward_prefetch": getattr(v1.backward_prefetch, "name", v1.backward_prefetch)}


@fact("accelerate.no_reduce_dtype_key",
      "Accelerate's FSDP plugin has no config key for the reduction dtype: mixed_precision bf16 sets both "
      "param_dtype and reduce_dtype to bf16 (another policy only from code).",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__, set_mixed_precision")
def _no_reduce_key():
    from accelerate.utils import FullyShardedDataParallelPlugin

    src = inspect.getsource(FullyShardedDataParallelPlugin)
    keys = sorted(set(re.findall(r'env_prefix \+ "(\w+)"', src)))
    about_dtype = [k for k in keys if any(w in k for w in ("REDUCE", "DTYPE", "PRECISION"))]
    return len(keys) > 10 and not about_dtype, {"FSDP_* keys read": len(keys), "about a dtype": about_dtype or "none"}
