"""Accelerate (1.15.0) facts the guide states about precision (02) and offload (03).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
from unittest import mock

from .. import fact
from .._tools import messages, source_has

V = "1.15.0"


def _plugin(**kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with mock.patch.dict(os.environ, {}):  # the plugin reads FSDP_* variables; leave the environment as it was
        return FullyShardedDataParallelPlugin(fsdp_version=2, **kwargs)


@fact("accelerate.fsdp2_upcasts_with_mixed_precision",
      "With mixed_precision on (bf16), Accelerate upcasts a bf16 model's trainable parameters to fp32 before "
      "fully_shard, so FSDP2's shards are fp32; with mixed_precision: no, nothing is upcast.",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_prepare_model")
def _upcast():
    return source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                      'if accelerator.mixed_precision != "no" and not model_has_params4bit:',
                      "param.data = param.data.to(torch.float32)")


@fact("accelerate.fsdp2_upcasts_trainable_only",
      "Under mixed precision Accelerate upcasts only the parameters that require a gradient: a frozen base (LoRA) "
      "stays in the dtype it was loaded in, and FSDP2 shards it so.",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_prepare_model")
def _upcast_trainable():
    return source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                      "if param.requires_grad and param.dtype != torch.float32:")


@fact("accelerate.ds_auto_persistence_threshold",
      "Accelerate fills a DeepSpeed config's stage3_param_persistence_threshold: \"auto\" with 10 x the model's "
      "hidden size.",
      "accelerate", V, "accelerator.py: Accelerator._prepare_deepspeed")
def _auto_persistence():
    return source_has("accelerate.accelerator.Accelerator._prepare_deepspeed",
                      '"zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size')


@fact("accelerate.fsdp_bf16_policy",
      "Accelerate's FSDP2 plugin with bf16 mixed precision computes and reduces gradients in bf16 "
      "(param_dtype = reduce_dtype = bf16).",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.set_mixed_precision")
def _policy():
    p = _plugin(mixed_precision_policy="bf16").mixed_precision_policy
    ev = {"param_dtype": str(p.param_dtype), "reduce_dtype": str(p.reduce_dtype)}
    return ev == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.bfloat16"}, ev


@fact("accelerate.no_model_dtype_key",
      "Accelerate's config YAML has no key for the dtype a model is loaded in (only mixed_precision): the training "
      "script chooses it.",
      "accelerate", V, "commands/config/config_args.py: ClusterConfig")
def _no_dtype():
    from accelerate.commands.config.config_args import ClusterConfig

    keys = sorted(k for k in ClusterConfig.__dataclass_fields__ if "dtype" in k or "precision" in k)
    return keys == ["mixed_precision"], {"dtype/precision keys": keys}


@fact("accelerate.clipping_is_the_scripts",
      "Accelerate's FSDP config has no clipping key: the training script clips by calling "
      "accelerator.clip_grad_norm_(parameters, max_norm) itself.",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin; accelerator.py: "
      "Accelerator.clip_grad_norm_")
def _clip():
    import dataclasses
    import inspect

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    clip = [f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin) if "clip" in f.name or "norm" in f.name]
    sig = str(inspect.signature(Accelerator.clip_grad_norm_))
    return not clip and sig == "(self, parameters, max_norm, norm_type=2)", {
        "plugin clipping fields": clip, "clip_grad_norm_": sig}


@fact("accelerate.fsdp_offload_one_switch",
      "Accelerate's FSDP has one offload switch (fsdp_offload_params): true becomes one CPUOffloadPolicy that "
      "Accelerate passes to every fully_shard call.",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.set_cpu_offload; utils/fsdp_utils.py: "
      "fsdp2_prepare_model")
def _one_switch():
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    policy = _plugin(cpu_offload=True).cpu_offload
    keys = [f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)
            if "offload" in f.name and "activation" not in f.name]  # activations are not state
    ok, ev = source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                        '"offload_policy": fsdp2_plugin.cpu_offload')
    return ok and type(policy).__name__ == "CPUOffloadPolicy" and keys == ["cpu_offload"], {
        "offload fields": keys, "cpu_offload=True": type(policy).__name__, **ev}


@fact("accelerate.deepspeed_fills_auto_grad_accum",
      "Accelerate fills an \"auto\" gradient_accumulation_steps in a DeepSpeed JSON from its own setting.",
      "accelerate", V, "accelerator.py: Accelerator._prepare_deepspeed")
def _fill():
    return source_has("accelerate.Accelerator._prepare_deepspeed",
                      'deepspeed_plugin.fill_match( "gradient_accumulation_steps"')


@fact("accelerate.offload_swaps_in_cpu_adam",
      "With offload_optimizer on and zero_force_ds_cpu_optimizer left true, Accelerate replaces a torch optimizer "
      "with DeepSpeedCPUAdam without a warning, carrying over only lr and weight_decay (betas and eps are dropped).",
      "accelerate", V, "accelerator.py: Accelerator._prepare_deepspeed; utils/deepspeed.py: "
      "map_pytorch_optim_to_deepspeed")
def _cpu_adam_swap():
    import torch
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

    class FakeCPUAdam:  # the real one JIT-compiles a C++ op when built
        def __init__(self, params, **kw):
            self.kw = kw

    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3, betas=(0.8, 0.9), eps=1e-6,
                            weight_decay=0.1)
    with mock.patch("deepspeed.ops.adam.DeepSpeedCPUAdam", FakeCPUAdam):
        out, msgs = messages(map_pytorch_optim_to_deepspeed, opt)
    called, _ = source_has("accelerate.Accelerator._prepare_deepspeed", '"zero_force_ds_cpu_optimizer", True',
                           "optimizer = map_pytorch_optim_to_deepspeed(optimizer)")
    kw = sorted(getattr(out, "kw", {}))
    return called and isinstance(out, FakeCPUAdam) and "betas" not in kw and "eps" not in kw and not msgs, {
        "becomes": type(out).__name__, "carried": kw, "warnings": len(msgs), "prepare swaps": called}
