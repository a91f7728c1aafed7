"""Accelerate (1.15.0) facts the guide states about the README and the launch configs' comments.

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from .. import fact, one_rank_group
from .._tools import fsdp2, messages, resolve, source_has

V = "1.15.0"


def _plugin(env: dict | None = None, **kw):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with mock.patch.dict(os.environ, env or {}):
        out, _ = messages(FullyShardedDataParallelPlugin, **kw)  # swallow its notes (use_orig_params, ...)
    if isinstance(out, Exception):
        raise out
    return out


def _tiny_llama(tie: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


@fact("accelerate.fsdp_state_dict_types",
      "Accelerate's FSDP2 plugin saves SHARDED_STATE_DICT (DCP shards) or FULL_STATE_DICT (one full state dict, "
      "gathered to rank 0 and offloaded to the CPU) per fsdp_state_dict_type.",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.set_state_dict_type; "
      "utils/constants.py: FSDP2_STATE_DICT_TYPE")
def _sd_types():
    from accelerate.utils.constants import FSDP2_STATE_DICT_TYPE

    full = _plugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT").state_dict_config
    ok = list(FSDP2_STATE_DICT_TYPE) == ["SHARDED_STATE_DICT", "FULL_STATE_DICT"] and full.rank0_only \
        and full.offload_to_cpu
    return ok, {"FSDP2 types": "/".join(FSDP2_STATE_DICT_TYPE), "FULL rank0_only": full.rank0_only}


@fact("accelerate.unknown_yaml_key_refused",
      "Accelerate's ClusterConfig refuses a YAML with a top-level key it does not know.",
      "accelerate", V, "commands/config/config_args.py: BaseConfig.from_yaml_file")
def _unknown_key():
    from accelerate.commands.config.config_args import ClusterConfig

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nbogus_key: 1\n")
        out, _ = messages(ClusterConfig.from_yaml_file, p)
    ok = isinstance(out, ValueError) and "bogus_key" in str(out)
    return ok, {"raised": type(out).__name__, "message": str(out)[:80]}


@fact("accelerate.note_keys_exist",
      "Every key the README lists as note-only (launcher, TPU, debug, use_cpu, fsdp_use_orig_params, "
      "fsdp_sync_module_states, deepspeed_moe_layer_cls_names, parallelism_config cp/sp, fp8/megatron/mpirun/"
      "dynamo) is a ClusterConfig field, an accelerate launch option or a key of its sub-configs.",
      "accelerate", V, "commands/config/config_args.py: ClusterConfig; commands/launch.py: launch_command_parser")
def _note_keys():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    keys = ("compute_environment num_processes num_machines machine_rank main_process_ip main_process_port "
            "rdzv_backend same_network gpu_ids main_training_function enable_cpu_affinity "
            "deepspeed_multinode_launcher deepspeed_hostfile deepspeed_inclusion_filter deepspeed_exclusion_filter "
            "tpu_name tpu_zone tpu_use_cluster tpu_use_sudo tpu_vm tpu_env command_file commands downcast_bf16 "
            "debug use_cpu fsdp_use_orig_params fsdp_sync_module_states deepspeed_moe_layer_cls_names "
            "parallelism_config_cp_backend parallelism_config_cp_comm_strategy parallelism_config_sp_backend "
            "parallelism_config_sp_seq_length parallelism_config_sp_seq_length_is_variable "
            "parallelism_config_sp_attn_implementation fp8_config megatron_lm_config mpirun_config "
            "dynamo_config").split()
    known = {a.dest for a in launch_command_parser()._actions} | set(ClusterConfig.__dataclass_fields__)
    missing = [k for k in keys if k not in known]
    return not missing, {"listed": len(keys), "missing": missing or "none"}


@fact("accelerate.no_shard_fsdp1",
      "Under fsdp_version 1 Accelerate's FSDP plugin reads fsdp_sharding_strategy NO_SHARD as FSDP1's "
      "ShardingStrategy.NO_SHARD (replicated, as DDP).",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__ (FSDP_SHARDING_STRATEGY)")
def _no_shard():
    s = _plugin({"FSDP_SHARDING_STRATEGY": "NO_SHARD"}, fsdp_version=1).sharding_strategy
    return getattr(s, "name", None) == "NO_SHARD", {"sharding_strategy": s}


@fact("accelerate.fsdp_version_picks_keys",
      "fsdp_version picks the implementation under accelerate launch (1, the default: FSDP1 with "
      "fsdp_sharding_strategy; 2: fully_shard with fsdp_reshard_after_forward true/false); the FSDP2 plugin "
      "ignores fsdp_sharding_strategy and the FSDP1 plugin ignores fsdp_reshard_after_forward.",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__; accelerator.py: "
      "Accelerator.prepare_model")
def _versions():
    default = _plugin().fsdp_version
    env = {"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP", "FSDP_RESHARD_AFTER_FORWARD": "false"}
    v2, v1 = _plugin(env, fsdp_version=2), _plugin(env, fsdp_version=1)
    ok = (default == 1 and v2.sharding_strategy is None and v2.reshard_after_forward is False
          and getattr(v1.sharding_strategy, "name", None) == "SHARD_GRAD_OP" and v1.reshard_after_forward is None)
    return ok, {"default fsdp_version": default, "v2 reshard_after_forward": v2.reshard_after_forward,
                "v2 sharding_strategy": v2.sharding_strategy, "v1 sharding_strategy": v1.sharding_strategy}


@fact("accelerate.fsdp2_reshard_false",
      "With fsdp_version 2, fsdp_reshard_after_forward: false gives fully_shard reshard_after_forward=False "
      "(SHARD_GRAD_OP, ~ ZeRO-2).",
      "accelerate", V, "utils/dataclasses.py: FullyShardedDataParallelPlugin.__post_init__; utils/fsdp_utils.py: "
      "fsdp2_prepare_model")
def _reshard_false():
    p = _plugin({"FSDP_RESHARD_AFTER_FORWARD": "false"}, fsdp_version=2)
    ok_src, src = source_has("accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                             '"reshard_after_forward": fsdp2_plugin.reshard_after_forward')
    return p.reshard_after_forward is False and ok_src, {"reshard_after_forward": p.reshard_after_forward}


@fact("accelerate.hsdp_mesh",
      "Accelerate's ParallelismConfig with dp_replicate_size and dp_shard_size gives FSDP2 a 2-D (replicate, "
      "shard) mesh: HSDP.",
      "accelerate", V, "parallelism_config.py: ParallelismConfig.fsdp_dim_names; utils/fsdp_utils.py: "
      "fsdp2_prepare_model")
def _hsdp():
    from accelerate.parallelism_config import ParallelismConfig

    dims = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).fsdp_dim_names
    return list(dims) == ["dp_replicate", "dp_shard_cp"], {"fsdp_dim_names": dims}


@fact("accelerate.size_wrap_picks_module_list",
      "Accelerate's FSDP2 SIZE_BASED_WRAP policy (more than fsdp_min_num_params parameters) also picks "
      "model.layers, a ModuleList, which fully_shard refuses: accelerate launch stops on it.",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_prepare_auto_wrap_policy; torch distributed/fsdp/"
      "_fully_shard/_fully_shard.py: fully_shard", runs=True)
def _size_wrap():
    one_rank_group()
    model = _tiny_llama()
    plugin = _plugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=2000)
    plugin.set_auto_wrap_policy(model)
    policy = resolve("accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy")(plugin, model)
    picked = [n for n, m in model.named_modules() if n and policy(m)]
    out, _ = messages(fsdp2, model.model.layers, units=False)
    ok = "model.layers" in picked and isinstance(out, ValueError)
    return ok, {"picks model.layers": "model.layers" in picked, "fully_shard(ModuleList)": type(out).__name__}


@fact("accelerate.fsdp2_ram_efficient_broadcast",
      "With fsdp_cpu_ram_efficient_loading, Accelerate's FSDP2 shards a meta model and broadcasts each full "
      "parameter from rank 0, every rank keeping its shard.",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_load_full_state_dict, fsdp2_prepare_model")
def _ram_efficient():
    return source_has("accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict",
                      "dist.broadcast(full_param, src=0", "distribute_tensor")


@fact("accelerate.fsdp2_ac_wraps_blocks",
      "fsdp_activation_checkpointing wraps each decoder block in torch's checkpoint_wrapper before fully_shard; "
      "with fsdp_activation_checkpointing_offload also in offload_wrapper (save_on_cpu, pinned).",
      "accelerate", V, "utils/fsdp_utils.py: fsdp2_apply_ac; accelerator.py: Accelerator._prepare_fsdp2")
def _ac():
    import inspect

    from accelerate import Accelerator

    plugin = _plugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", activation_checkpointing=True,
                     activation_checkpointing_offload=True)
    model = _tiny_llama()
    plugin.set_auto_wrap_policy(model)
    acc = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    resolve("accelerate.utils.fsdp_utils.fsdp2_apply_ac")(acc, model)
    kinds = sorted({type(b).__name__ for b in model.model.layers})
    inner = {type(getattr(b, "_checkpoint_wrapped_module", None)).__name__ for b in model.model.layers}
    src = inspect.getsource(Accelerator._prepare_fsdp2)
    before = src.index("fsdp2_apply_ac(") < src.index("fsdp2_prepare_model(")
    ok_pin, _ = source_has("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.OffloadWrapper",
                           "save_on_cpu(pin_memory=True)")
    ok = kinds == ["OffloadWrapper"] and inner == {"CheckpointWrapper"} and before and ok_pin
    return ok, {"blocks": "/".join(kinds), "inside": "/".join(sorted(inner)), "before fully_shard": before,
                "pinned": ok_pin}


@fact("accelerate.deepspeed_auto_filled",
      "Accelerate fills a DeepSpeed JSON's \"auto\" values before deepspeed.initialize (batch sizes, "
      "accumulation, clipping, bf16.enabled, ZeRO bucket sizes, and optimizer/scheduler params for its "
      "DummyOptim/DummyScheduler).",
      "accelerate", V, "utils/dataclasses.py: DeepSpeedPlugin.deepspeed_config_process, fill_match; "
      "accelerator.py: Accelerator._prepare_deepspeed")
def _auto():
    from accelerate.utils import DeepSpeedPlugin

    cfg = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3,
                                                                          "reduce_bucket_size": "auto"}}
    p = DeepSpeedPlugin(hf_ds_config=cfg)
    p.deepspeed_config_process(must_match=False, train_micro_batch_size_per_gpu=4,
                               **{"zero_optimization.reduce_bucket_size": 256})
    got = (p.deepspeed_config["train_micro_batch_size_per_gpu"],
           p.deepspeed_config["zero_optimization"]["reduce_bucket_size"])
    ok_src, _ = source_has("accelerate.accelerator.Accelerator._prepare_deepspeed", '"optimizer.params.lr"',
                           '"scheduler.params.warmup_max_lr"', '"gradient_clipping"',
                           '"zero_optimization.stage3_prefetch_bucket_size"')
    return got == (4, 256) and ok_src, {"filled": got, "optimizer/scheduler keys": ok_src}


@fact("accelerate.deepspeed_inline_keys",
      "Accelerate's DeepSpeedPlugin builds a DeepSpeed JSON from the inline keys (zero_stage, offload devices "
      "and NVMe paths, zero3_save_16bit_model, gradient_accumulation_steps, gradient_clipping), batch sizes "
      "\"auto\"; a gradient_clipping of 0 is left out.",
      "accelerate", V, "utils/dataclasses.py: DeepSpeedPlugin.__post_init__")
def _inline():
    from accelerate.utils import DeepSpeedPlugin

    c = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=0.0,
                        offload_optimizer_device="cpu", zero3_save_16bit_model=True).deepspeed_config
    z = c["zero_optimization"]
    ok = (z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and c["gradient_accumulation_steps"] == 2
          and z["stage3_gather_16bit_weights_on_model_save"] is True and c["train_batch_size"] == "auto"
          and "gradient_clipping" not in c)
    return ok, {"keys": ",".join(sorted(c)), "zero keys": ",".join(sorted(z))}


@fact("accelerate.debug_collective_checks",
      "accelerate launch --debug (the YAML's debug) sets ACCELERATE_DEBUG_MODE, which makes Accelerate's "
      "collectives check tensor shapes across processes first.",
      "accelerate", V, "utils/launch.py: prepare_simple_launcher_cmd_env; utils/operations.py: verify_operation")
def _debug():
    ok1, _ = source_has("accelerate.utils.launch.prepare_simple_launcher_cmd_env",
                        'current_env["ACCELERATE_DEBUG_MODE"] = "true"')
    ok2, _ = source_has("accelerate.utils.operations.verify_operation", "not PartialState().debug")
    return ok1 and ok2, {"launch sets env": ok1, "verify_operation reads debug": ok2}


@fact("accelerate.load_state_calls_ds_load_checkpoint",
      "Under DeepSpeed, Accelerator.load_state hands each model's checkpoint to the engine's own load_checkpoint.",
      "accelerate", V, "accelerator.py: Accelerator.load_state")
def _load_state_ds():
    # a DeepSpeed Accelerator needs a process group and an engine: the fact rests on the pinned code's text
    return source_has("accelerate.Accelerator.load_state",
                      "elif self.distributed_type == DistributedType.DEEPSPEED:",
                      "model.load_checkpoint(input_dir, ckpt_id, **load_model_func_kwargs)")
