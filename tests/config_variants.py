"""Launch configs a user could write: the shipped ones with one documented key changed each.

DeepSpeed: every field of DeepSpeed's own ``DeepSpeedZeroConfig`` (read from the installed library, so a key
DeepSpeed adds is swept too), each set to a non-default value DeepSpeed accepts, on ``zero3.json`` (and the
keys of stages 1 and 2 on ``zero2.json``); the other sections the guide reads: ``bf16``, ``optimizer``,
``scheduler``, ``gradient_clipping``, ``activation_checkpointing``, the offload sections. FSDP: every key of the
Accelerate YAML's ``fsdp_config`` the guide applies, over its allowed values, on ``full_shard.yaml``.

``write_variants(dir)`` writes NAME.yaml (and NAME.json) per variant and returns the names; the sweep
(``python -m helpers.variants DIR``) trains or refuses each.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LC = ROOT / "launch_configs"

# A value DeepSpeed accepts for a field whose default the rule below would not change usefully.
_VALUE = {
    "stage": None,  # the stage is the base config's (zero2 / zero3): the shipped zero0..3 configs cover it
    "offload_param": {"device": "cpu"},
    "offload_optimizer": {"device": "cpu"},
    "zenflow": {"topk_ratio": 0.1},
    "leaf_module": {"classes": ["LlamaDecoderLayer"]},
    "overlap_comm": False,  # None: DeepSpeed picks (True for ZeRO-3)
    "zero_hpz_partition_size": 2,
    "sub_group_size": 1000,  # several sub-groups (the dtype probe once crashed on them)
    "reduce_bucket_size": 1000,
    "allgather_bucket_size": 1000,
    "stage3_prefetch_bucket_size": 1000,
    "stage3_param_persistence_threshold": 0,
    "stage3_model_persistence_threshold": 1000,
    "stage3_max_live_parameters": 1000,
    "stage3_max_reuse_distance": 0,
    "stage3_module_granularity_threshold": 1000,
}
# Keys that only act under ZeRO-1/2: swept on zero2.json as well.
_STAGE12 = ["contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
            "allgather_bucket_size", "overlap_comm", "round_robin_gradients", "use_multi_rank_bucket_allreduce",
            "elastic_checkpoint", "ignore_unused_parameters", "offload_optimizer", "legacy_stage1"]


def zero_fields() -> dict[str, object]:
    """DeepSpeedZeroConfig's documented keys (as a user writes them: aliases) -> a non-default accepted value."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    out = {}
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        extra = f.json_schema_extra or {}
        if extra.get("deprecated"):
            continue
        key = f.alias or name
        if key in _VALUE:
            value = _VALUE[key]
        elif f.annotation is bool:
            value = not f.default
        elif f.annotation is int:
            value = 1000 if f.default != 1000 else 2000
        else:
            raise AssertionError(f"zero_optimization.{key} ({f.annotation}): no sweep value; add one to _VALUE")
        if value is not None:
            out[key] = value
    return out


def _merge(base: dict, edit: dict) -> dict:
    """A copy of ``base`` with ``edit``'s keys set (nested dicts merged)."""
    out = copy.deepcopy(base)
    for k, v in edit.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _ds_variants() -> dict[str, dict]:
    base3 = json.loads((LC / "deepspeed/zero3.json").read_text())
    base2 = json.loads((LC / "deepspeed/zero2.json").read_text())
    out = {}
    for key, value in zero_fields().items():
        out[f"ds3_{key}"] = _merge(base3, {"zero_optimization": {key: value}})
        if key in _STAGE12:
            out[f"ds2_{key}"] = _merge(base2, {"zero_optimization": {key: value}})
    out["ds2_stage1"] = _merge(base2, {"zero_optimization": {"stage": 1}})
    for k, v in (("immediate_grad_update", True), ("check_grad_overflow", False), ("enabled", False)):
        out[f"ds3_bf16_{k}"] = _merge(base3, {"bf16": {k: v}})
    out["ds3_bf16_master_weights_and_optimizer_states"] = _merge(
        base3, {"bf16": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    for clip in (0.5, 1.0):
        out[f"ds3_gradient_clipping_{clip:g}"] = _merge(base3, {"gradient_clipping": clip})
    for opt in ("AdamW", "Adam"):
        out[f"ds3_optimizer_{opt}"] = _merge(base3, {"optimizer": {"type": opt, "params": {"lr": "auto"}}})
    for sched, params in (("WarmupLR", {}), ("WarmupDecayLR", {"total_num_steps": "auto"}),
                          ("WarmupCosineLR", {"total_num_steps": "auto"}), ("WarmupCosineLR_bare", {}),
                          ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}),
                          ("LRRangeTest", {"lr_range_test_min_lr": 1e-4})):
        out[f"ds3_scheduler_{sched}"] = _merge(base3, {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                                                       "scheduler": {"type": sched.removesuffix("_bare"),
                                                                     "params": params}})
    out["ds3_activation_checkpointing"] = _merge(base3, {"activation_checkpointing": {}})
    for k, v in (("partition_activations", True), ("cpu_checkpointing", True),
                 ("contiguous_memory_optimization", True), ("number_checkpoints", 2),
                 ("synchronize_checkpoint_boundary", True), ("profile", True)):
        out[f"ds3_activation_checkpointing_{k}"] = _merge(base3, {"activation_checkpointing": {k: v}})
    for k, v in (("pin_memory", False), ("buffer_count", 6), ("buffer_size", 10**7), ("max_in_cpu", 10**6)):
        out[f"ds3_offload_param_{k}"] = _merge(base3, {"zero_optimization": {"offload_param": {"device": "cpu",
                                                                                                k: v}}})
    for k, v in (("pin_memory", False), ("buffer_count", 6), ("pipeline_read", True), ("pipeline_write", True),
                 ("fast_init", True), ("ratio", 0.5), ("super_offload", True), ("cpuadam_cores_perc", 0.5)):
        out[f"ds3_offload_optimizer_{k}"] = _merge(
            base3, {"zero_optimization": {"offload_optimizer": {"device": "cpu", k: v}}})
    return out


_FSDP_VALUES = {
    "fsdp_sharding_strategy": ["SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"],
    "fsdp_reshard_after_forward": [False],
    "fsdp_offload_params": [True],
    "fsdp_state_dict_type": ["FULL_STATE_DICT"],
    "fsdp_cpu_ram_efficient_loading": [True],
    "fsdp_auto_wrap_policy": ["SIZE_BASED_WRAP", "NO_WRAP"],
    "fsdp_min_num_params": [1000],
    "fsdp_forward_prefetch": [True],
    "fsdp_backward_prefetch": ["BACKWARD_POST", "NO_PREFETCH"],
    "fsdp_activation_checkpointing": [True],
    "fsdp_activation_checkpointing_offload": [True],
    "fsdp_sync_module_states": [False],
    "fsdp_use_orig_params": [False],
    "fsdp_version": [1],
    "fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "NoSuchLayer"],
}


def _fsdp_variants() -> dict[str, dict]:
    from helpers.core.config_keys import _FSDP_KEYS

    assert set(_FSDP_VALUES) == set(_FSDP_KEYS), "a guide FSDP key without sweep values (or the reverse)"
    base = yaml.safe_load((LC / "fsdp/full_shard.yaml").read_text())
    out = {}
    for key, values in _FSDP_VALUES.items():
        for v in values:
            y = copy.deepcopy(base)
            y["fsdp_config"][key] = v
            if key == "fsdp_sharding_strategy":  # the base says FULL_SHARD as reshard_after_forward: true
                y["fsdp_config"].pop("fsdp_reshard_after_forward", None)
            if key == "fsdp_activation_checkpointing_offload":  # offloads what checkpointing holds
                y["fsdp_config"]["fsdp_activation_checkpointing"] = True
            out[f"{key}_{v}"] = y
    for mp in ("no", "fp16"):
        y = copy.deepcopy(base)
        y["mixed_precision"] = mp
        out[f"fsdp_mixed_precision_{mp}"] = y
    return out


def write_variants(d: Path, which: str = "all") -> list[str]:
    """Write the variants (``which``: deepspeed, fsdp or all) as launch configs into ``d``; returns the names."""
    d.mkdir(parents=True, exist_ok=True)
    names = []
    if which in ("deepspeed", "all"):
        base = yaml.safe_load((LC / "deepspeed/zero3.yaml").read_text())
        for name, js in _ds_variants().items():
            (d / f"{name}.json").write_text(json.dumps(js, indent=1))
            y = copy.deepcopy(base)
            y["deepspeed_config"]["deepspeed_config_file"] = f"{name}.json"
            (d / f"{name}.yaml").write_text(yaml.safe_dump(y))
            names.append(name)
    if which in ("fsdp", "all"):
        for name, y in _fsdp_variants().items():
            (d / f"{name}.yaml").write_text(yaml.safe_dump(y))
            names.append(name)
    return names
