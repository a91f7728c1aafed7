"""Accelerate (1.15.0) facts the guide states about prefetch (04), loading (05) and checkpoints (06).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

from .. import fact
from .._tools import messages, source_has

V = "1.15.0"
PLUGIN = "accelerate/utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__"


def _plugin(env: dict | None = None, **kwargs):
    """``FullyShardedDataParallelPlugin(**kwargs)`` (or the exception) and the FSDP2 warnings it queued, with the
    FSDP_* variables of ``env`` only; the environment is restored afterwards (the plugin writes to it)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    with mock.patch.dict(os.environ, {**clean, **(env or {})}, clear=True):
        return messages(FullyShardedDataParallelPlugin, **kwargs)


@fact("accelerate.fsdp2_embedding_and_tail_units",
      "Whatever the wrap policy, Accelerate's FSDP2 preparation gives the input embedding a unit (with tied "
      "embeddings it joins the tail instead) and the final norm + head one more, which stays gathered from forward "
      "to backward (reshard_after_forward=False); the root takes what is left.",
      "accelerate", V, "accelerate/utils/fsdp_utils.py: fsdp2_prepare_model")
def _tail():
    return source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                      "if not is_weights_tied and input_embed is not None and not isinstance(input_embed, FSDPModule):"
                      " fully_shard(input_embed, **fsdp2_kwargs)",
                      "tail_modules = (final_norm, input_embed, output_embed)",
                      'fully_shard(tail, **{**fsdp2_kwargs, "reshard_after_forward": False})',
                      "fully_shard(model, **root_kwargs)")


def _model():
    """Two "decoder blocks" (a Sequential subclass the model's _no_split_modules names), each one Linear(4, 4),
    and a head Linear(4, 4): 20 parameters per Linear and per block, 60 in all."""
    import torch

    class _Block(torch.nn.Sequential):
        pass

    class _Model(torch.nn.Sequential):
        _no_split_modules = ["_Block"]

    return _Model(_Block(torch.nn.Linear(4, 4)), _Block(torch.nn.Linear(4, 4)), torch.nn.Linear(4, 4))


def _picked(model, kind: str, **plugin) -> list[str]:
    """The modules Accelerate's FSDP2 wrap policy ``kind`` makes units of."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    fn = {"transformer": transformer_auto_wrap_policy, "size": size_based_auto_wrap_policy}[kind]
    p = SimpleNamespace(**{"auto_wrap_policy": fn, "transformer_cls_names_to_wrap": None, "min_num_params": 0,
                           **plugin})
    policy = fsdp2_prepare_auto_wrap_policy(p, model)
    return [n or "(root)" for n, mod in model.named_modules() if policy(mod)]


@fact("accelerate.fsdp2_transformer_policy_units",
      "TRANSFORMER_BASED_WRAP makes one unit per block of the class the model's _no_split_modules names, unless "
      "fsdp_transformer_layer_cls_to_wrap names another.",
      "accelerate", V, "accelerate/utils/fsdp_utils.py: fsdp2_prepare_auto_wrap_policy")
def _transformer():
    m = _model()
    default = _picked(m, "transformer")
    named = _picked(m, "transformer", transformer_cls_names_to_wrap=["Linear"])
    return default == ["0", "1"] and named == ["0.0", "1.0", "2"], {
        "_no_split_modules=['_Block'] ->": default, "cls_to_wrap=['Linear'] ->": named}


@fact("accelerate.fsdp2_size_policy_counts_children",
      "SIZE_BASED_WRAP picks every module holding more than fsdp_min_num_params parameters in total, children "
      "included.",
      "accelerate", V, "accelerate/utils/fsdp_utils.py: fsdp2_prepare_auto_wrap_policy")
def _size():
    m = _model()  # each Linear(4, 4) 20 parameters, each block 20 (its Linear), the model 60
    at20, at19 = _picked(m, "size", min_num_params=20), _picked(m, "size", min_num_params=19)
    return at20 == ["(root)"] and at19 == ["(root)", "0", "0.0", "1", "1.0", "2"], {
        "min_num_params=20 (60 in all)": at20, "min_num_params=19": at19}


@fact("accelerate.fsdp2_ignores_use_orig_params",
      "Accelerate ignores fsdp_use_orig_params under fsdp_version: 2 (it sets it to None with a warning).",
      "accelerate", V, PLUGIN)
def _orig():
    p, msgs = _plugin(fsdp_version=2, use_orig_params=True)
    warned = any("use_orig_params is obsolete in FSDP2" in m for m in msgs)
    return p.use_orig_params is None and warned, {"use_orig_params": p.use_orig_params, "warning": warned}


@fact("accelerate.fsdp2_sync_module_states_required_but_ignored",
      "accelerate launch refuses fsdp_cpu_ram_efficient_loading without fsdp_sync_module_states: true, which FSDP2 "
      "then ignores (set to None with a warning).",
      "accelerate", V, "accelerate/utils/launch.py: prepare_multi_gpu_env; " + PLUGIN)
def _sync():
    p, msgs = _plugin(fsdp_version=2, sync_module_states=True, cpu_ram_efficient_loading=True)
    ok, ev = source_has("accelerate.utils.launch.prepare_multi_gpu_env",
                        "if args.fsdp_cpu_ram_efficient_loading and not args.fsdp_sync_module_states: "
                        "raise ValueError(")
    warned = any("sync_module_states is obsolete in FSDP2" in m for m in msgs)
    return ok and warned and p.sync_module_states is None and p.cpu_ram_efficient_loading, {
        "sync_module_states": p.sync_module_states, "warning": warned, "launcher requires it": ok}


@fact("accelerate.ram_efficient_loading_default_off",
      "accelerate launch turns fsdp_cpu_ram_efficient_loading on when a YAML leaves it out (its command-line "
      "default is true); Accelerate's FSDP plugin built in code, and this guide, leave it off: every rank then "
      "loads the whole model.",
      "accelerate", V, "accelerate/commands/launch.py: launch_command_parser (--fsdp_cpu_ram_efficient_loading); "
      + PLUGIN)
def _ram_off():
    from accelerate.commands.launch import launch_command_parser

    launch_default = launch_command_parser().parse_args(["x.py"]).fsdp_cpu_ram_efficient_loading
    p, _ = _plugin({"FSDP_VERSION": "2"})
    ev = {"accelerate launch default": launch_default, "plugin default": p.cpu_ram_efficient_loading}
    return str(launch_default).lower() == "true" and p.cpu_ram_efficient_loading is False, ev


@fact("accelerate.save_state_no_16bit_file",
      "Accelerate's zero3_save_16bit_model is DeepSpeed's stage3_gather_16bit_weights_on_model_save; "
      "Accelerator.save_state calls save_checkpoint only, so it adds no 16-bit file to a checkpoint.",
      "accelerate", V, "accelerate/accelerator.py: Accelerator.save_state; accelerate/utils/dataclasses.py: "
      "DeepSpeedPlugin")
def _save_state():
    import inspect

    from accelerate import Accelerator

    src = inspect.getsource(Accelerator.save_state)
    ok, ev = source_has("accelerate.utils.dataclasses.DeepSpeedPlugin",
                        '"zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save"')
    calls = "model.save_checkpoint(" in src
    sixteen = "save_16bit_model" in src
    return ok and calls and not sixteen, {"save_state calls save_checkpoint": calls,
                                          "save_state calls save_16bit_model": sixteen, "key mapped": ok}


@fact("accelerate.size_wrap_default_threshold",
      "accelerate launch's --fsdp_min_num_params defaults to 1e8; a FullyShardedDataParallelPlugin built in code "
      "defaults min_num_params to 0, which silently turns SIZE_BASED_WRAP off (no policy).",
      "accelerate", V, "accelerate/commands/launch.py: launch_command_parser (--fsdp_min_num_params); " + PLUGIN
      + ", set_auto_wrap_policy")
def _size_default():
    from accelerate.commands.launch import launch_command_parser

    launch_default = launch_command_parser().parse_args(["x.py"]).fsdp_min_num_params
    p, _ = _plugin({"FSDP_VERSION": "2"}, auto_wrap_policy="SIZE_BASED_WRAP")
    p.set_auto_wrap_policy(_model())  # what Accelerator.prepare does with the plugin's policy
    return launch_default == int(1e8) and p.min_num_params == 0 and p.auto_wrap_policy is None, {
        "accelerate launch default": launch_default, "plugin default": p.min_num_params,
        "plugin policy": p.auto_wrap_policy}
