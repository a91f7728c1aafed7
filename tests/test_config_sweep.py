"""Every valid config trains or is refused in one line: the shipped configs with one documented key changed each.

tests/config_variants.py writes the variants (every field of DeepSpeed's own DeepSpeedZeroConfig, the bf16,
optimizer, scheduler, clipping, activation-checkpointing and offload sections; every FSDP key the guide applies);
one process group trains them all (``python -m helpers.variants``: 2 ranks, tiny, 2 steps), so the whole sweep
pays torchrun's start-up once. A variant that starts and then fails ends the sweep, naming it.
"""

import json

import pytest
from config_variants import write_variants, zero_fields
from conftest import gpu_count, run_module

# Refused before anything starts, with the reason (a fragment of the one line each gets). Everything else trains.
REFUSED = {
    "ds2_legacy_stage1": "the old ZeRO-1 was removed in 0.5.9",
    "ds3_legacy_stage1": "the old ZeRO-1 was removed in 0.5.9",
    "ds3_compute_grad_norm": "compute_grad_norm=false is supported only with ZeRO Stage 1 or 2",
    "ds3_offload_optimizer_ratio": "a partial optimizer offload needs DeepSpeed's CPU Adam",
    "ds3_scheduler_WarmupCosineLR_bare": "scheduler WarmupCosineLR needs params.total_num_steps",
    "ds3_zero_hpz_partition_size": "must divide the world size (2) into 2 or more groups",
    "fsdp_sharding_strategy_HYBRID_SHARD": "needs a shard group that divides the world size into 2 or more",
    "fsdp_sharding_strategy_HYBRID_SHARD_ZERO2": "needs a shard group that divides the world size into 2 or more",
    "fsdp_transformer_layer_cls_to_wrap_NoSuchLayer": "no module of class NoSuchLayer",
    "fsdp_mixed_precision_fp16": "mixed_precision = 'fp16': allowed values are no, bf16",
}
# ... and on a CPU, what runs on CUDA only
CPU_ONLY_REFUSED = {
    "ds3_offload_optimizer_super_offload": "SuperOffload runs on NVIDIA CUDA GPUs only",
    "ds3_zenflow": "ZenFlow's optimizer runs on CUDA",
    "ds3_zero_quantized_gradients": "DeepSpeed's quantizer is a CUDA op",
    "ds3_zero_quantized_nontrainable_weights": "DeepSpeed's quantizer is a CUDA op",
    "ds3_zero_quantized_weights": "DeepSpeed's quantizer is a CUDA op",
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    base = tmp_path_factory.mktemp("variants")
    names = write_variants(base / "configs")
    proc = run_module("helpers.variants", [base / "configs", "--out", base / "runs", "--steps", 2], 2, timeout=900)
    assert proc.returncode == 0, f"the sweep stopped: {proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    return names, json.loads((base / "runs" / "variants.json").read_text()), proc.stdout


def test_every_documented_zero_key_is_swept():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    documented = {f.alias or n for n, f in DeepSpeedZeroConfig.model_fields.items()
                  if not (f.json_schema_extra or {}).get("deprecated")}
    assert documented - {"stage"} <= set(zero_fields())


def test_every_variant_trains_or_is_refused_in_one_line(sweep):
    names, verdicts, stdout = sweep
    assert set(verdicts) == set(names)
    want = {**REFUSED, **({} if gpu_count() else CPU_ONLY_REFUSED)}
    refused = {n: v["why"] for n, v in verdicts.items() if v["verdict"] == "refused"}
    assert set(refused) == set(want), f"refused now: {refused}"
    for name, why in refused.items():
        assert want[name] in why and "\n" not in why and "Traceback" not in why
        assert f"{name}: refused: " in stdout
    for name, v in verdicts.items():
        if v["verdict"] == "trained":
            assert len(v["losses"]) == 2 and all(loss == loss for loss in v["losses"]), name  # no NaN

