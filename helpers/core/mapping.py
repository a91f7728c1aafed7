"""Which FSDP setting is which ZeRO stage: the mapping as data, and the memory model.

``MODES`` is the one table the guide uses: the sharding notebook renders it,
the memory accounting takes its theory from it, and config translation reads
it. ``theory_bytes`` is the ZeRO paper's model (per parameter: params, grads,
Adam's two moments, and an fp32 master copy when training in bf16), divided by
the number of ranks that share each kind of state.
"""

from __future__ import annotations

from dataclasses import dataclass

CATEGORIES = ("params", "grads", "optimizer_states", "master_params")


@dataclass(frozen=True)
class Mode:
    key: str  # short name, also the launch config's file stem
    backend: str  # "fsdp" | "deepspeed"
    fsdp1: str  # FSDP1 sharding_strategy
    fsdp2: str  # how FSDP2 spells it
    zero: str  # the DeepSpeed stage it corresponds to
    sharded: frozenset  # categories each rank keeps only a shard of
    config: str  # launch config, relative to the repo
    min_world_size: int = 1
    note: str = ""
    at_step_only: frozenset = frozenset()  # of ``sharded``: a shard only at the step (whole during backward)


def _m(key, backend, fsdp1, fsdp2, zero, sharded, config, min_ws=1, note="", at_step_only=()):
    return Mode(key, backend, fsdp1, fsdp2, zero, frozenset(sharded), config, min_ws, note, frozenset(at_step_only))


_ALL = ("params", "grads", "optimizer_states", "master_params")
MODES: dict[str, Mode] = {m.key: m for m in [
    _m("no_shard", "fsdp", "NO_SHARD", "2-D mesh (world x 1): replicate only", "ZeRO-0", (),
       "launch_configs/fsdp/no_shard.yaml", note="plain data parallel (DDP)"),
    _m("shard_grad_op", "fsdp", "SHARD_GRAD_OP", "fully_shard(reshard_after_forward=False)", "ZeRO-2",
       _ALL, "launch_configs/fsdp/shard_grad_op.yaml",
       note="params stay gathered from forward to backward: sharded at rest, not in between"),
    _m("full_shard", "fsdp", "FULL_SHARD", "fully_shard(reshard_after_forward=True)", "ZeRO-3", _ALL,
       "launch_configs/fsdp/full_shard.yaml"),
    _m("hybrid_shard", "fsdp", "HYBRID_SHARD", "2-D mesh (replicate x shard)", "ZeRO++ hpZ", _ALL,
       "launch_configs/fsdp/hybrid_shard.yaml", 4, note="sharded within a group, replicated across groups"),
    _m("zero0", "deepspeed", "NO_SHARD", "(replicate)", "ZeRO-0", (), "launch_configs/deepspeed/zero0.yaml",
       note="bf16 params + fp32 master on every rank"),
    _m("zero1", "deepspeed", "(none)", "(none)", "ZeRO-1", ("optimizer_states", "master_params", "grads"),
       "launch_configs/deepspeed/zero1.yaml",
       note="DeepSpeed reduces gradients into partitions at the step; they are full during backward",
       at_step_only=("grads",)),
    _m("zero2", "deepspeed", "SHARD_GRAD_OP", "fully_shard(reshard_after_forward=False)", "ZeRO-2",
       ("optimizer_states", "master_params", "grads"), "launch_configs/deepspeed/zero2.yaml"),
    _m("zero3", "deepspeed", "FULL_SHARD", "fully_shard(reshard_after_forward=True)", "ZeRO-3", _ALL,
       "launch_configs/deepspeed/zero3.yaml"),
    _m("zero3_hpz", "deepspeed", "HYBRID_SHARD", "2-D mesh (replicate x shard)", "ZeRO++ hpZ", _ALL,
       "launch_configs/deepspeed/zero3_hpz.yaml", 4,
       note="ZeRO-3 plus a secondary bf16 param shard per group, for intra-group all-gathers"),
]}


def mapping_rows() -> list[dict]:
    """The mapping table, one row per mode, for display."""
    return [
        {"mode": m.key, "backend": m.backend, "FSDP1 strategy": m.fsdp1, "FSDP2": m.fsdp2, "ZeRO": m.zero,
         "sharded per rank": ", ".join(c + (" (at the step only)" if c in m.at_step_only else "")
                                       for c in CATEGORIES if c in m.sharded
                                       and bytes_per_param(m.backend, "bf16")[c]) or "nothing",  # no empty categories
         "needs ranks": m.min_world_size}
        for m in MODES.values()
    ]


def bytes_per_param(backend: str, mixed_precision: str, model_dtype_bytes: int = 2,
                    grad_dtype_bytes: int | None = None) -> dict[str, int]:
    """Bytes per parameter for each category, before sharding.

    FSDP (Accelerate semantics): with bf16 mixed precision the params are
    upcast to fp32 and the fp32 shard *is* the optimizer's master (no extra
    copy); without it everything stays in the dtype the model was loaded in.
    DeepSpeed with bf16: bf16 params and grads, fp32 master, fp32 Adam states.
    """
    if backend == "fsdp":
        p = 4 if mixed_precision == "bf16" else model_dtype_bytes
        return {"params": p, "grads": p, "optimizer_states": 2 * p, "master_params": 0}
    if mixed_precision == "bf16":
        return {"params": 2, "grads": grad_dtype_bytes or 2, "optimizer_states": 8, "master_params": 4}
    return {"params": 4, "grads": 4, "optimizer_states": 8, "master_params": 0}


def theory_bytes(mode: Mode, num_params: int, world_size: int, mixed_precision: str,
                 shard_group: int | None = None, secondary_group: int | None = None,
                 grad_dtype_bytes: int | None = None, model_dtype_bytes: int = 2) -> dict[str, float]:
    """Per-rank bytes the ZeRO model predicts for this mode.

    ``shard_group``: ranks that share one copy (FSDP hybrid); default all.
    ``secondary_group``: ZeRO++ hpZ partition size (an extra bf16 param shard).
    ``model_dtype_bytes``: bytes per element of the dtype the model was loaded in (FSDP without
    mixed precision keeps it).
    """
    per = bytes_per_param(mode.backend, mixed_precision, model_dtype_bytes, grad_dtype_bytes)
    group = shard_group or world_size
    out = {cat: per[cat] * num_params / (group if cat in mode.sharded else 1) for cat in CATEGORIES}
    if secondary_group:
        out["params"] += per["params"] * num_params / secondary_group
    return out


def job_theory_bytes(job, num_params: int, world_size: int, trainable: int | None = None) -> dict[str, float]:
    """``theory_bytes`` for a JobConfig (``job_theory_split``'s two parts added up)."""
    split = job_theory_split(job, num_params, world_size, trainable)
    return {cat: split["trainable"][cat] + split["frozen"][cat] for cat in CATEGORIES}


def frozen_param_bytes(job) -> int:
    """Bytes per element of a frozen parameter once wrapped: FSDP keeps it as loaded (Accelerate upcasts only
    trainable ones), DeepSpeed casts every parameter to bf16 when bf16 is on."""
    loaded = 4 if job.train.model_dtype == "fp32" else 2
    if job.backend == "fsdp":
        return loaded
    return 2 if job.mixed_precision == "bf16" else 4


def job_theory_split(job, num_params: int, world_size: int, trainable: int | None = None) -> dict[str, dict]:
    """Per-rank bytes of the trainable parameters (``trainable`` of ``num_params``; all when None) and of the
    frozen rest: a frozen parameter has no gradient, no optimizer state and no master copy, only its weight,
    sharded where the mode shards parameters (``frozen_param_bytes`` each)."""
    trainable = num_params if trainable is None else trainable
    frozen = dict.fromkeys(CATEGORIES, 0.0)
    group = world_size
    if job.backend == "fsdp" and job.fsdp.sharding.startswith("HYBRID"):
        group = job.fsdp.hybrid_shard_size
    mode = MODES[mode_key(job)]
    frozen["params"] = frozen_param_bytes(job) * (num_params - trainable) / (group if "params" in mode.sharded else 1)
    return {"trainable": _job_theory(job, trainable, world_size), "frozen": frozen}


def _job_theory(job, num_params: int, world_size: int) -> dict[str, float]:
    """``theory_bytes`` for a JobConfig: its mode, hybrid / hpZ groups, gradient and model dtypes."""
    shard_group = secondary = grad_bytes = None
    if job.backend == "fsdp" and job.fsdp.sharding.startswith("HYBRID"):
        shard_group = job.fsdp.hybrid_shard_size
    if job.backend == "deepspeed":
        js = job.deepspeed.json
        hpz = int(js.get("zero_optimization", {}).get("zero_hpz_partition_size", 1))
        secondary = hpz if hpz > 1 else None
        if js.get("data_types", {}).get("grad_accum_dtype") == "fp32":
            grad_bytes = 4
    return theory_bytes(MODES[mode_key(job)], num_params, world_size, job.mixed_precision,
                        shard_group=shard_group, secondary_group=secondary, grad_dtype_bytes=grad_bytes,
                        model_dtype_bytes=4 if job.train.model_dtype == "fp32" else 2)


def zero3_local_numel(numel: int, part: int, rank: int) -> int:
    """How many of a ZeRO-3 parameter's ``numel`` elements rank ``rank``'s partition of ``part`` elements holds.
    Rank r holds elements [r * part, (r + 1) * part); part is numel / ranks rounded up, so the last ranks'
    partitions end in padding (zeros), or are all padding."""
    return max(0, min(part, numel - rank * part))


def mode_key(job) -> str:
    """The MODES key of a JobConfig."""
    if job.backend == "fsdp":
        return job.fsdp.sharding.lower()
    hpz = int(job.deepspeed.json.get("zero_optimization", {}).get("zero_hpz_partition_size", 1))
    return f"zero{job.deepspeed.zero_stage}" + ("_hpz" if hpz > 1 else "")




# --------------------------------------------------------------------------- settings, key by key
# The rest of a launch config, as data: which FSDP key says what which DeepSpeed key says.
# ``exact``: the two settings do the same thing (the translator converts silently); otherwise
# helpers.translate converts to the nearest choice and prints ``note`` as a warning.


@dataclass(frozen=True)
class Setting:
    topic: str
    fsdp: str  # Accelerate fsdp_config key (or top-level key)
    deepspeed: str  # Accelerate deepspeed_config key or DeepSpeed JSON path
    exact: bool
    note: str = ""


SETTINGS: list[Setting] = [
    Setting("sharding", "fsdp_reshard_after_forward / fsdp_sharding_strategy", "zero_optimization.stage", False,
            "through MODES: exact for FULL_SHARD = ZeRO-3 and NO_SHARD = ZeRO-0; SHARD_GRAD_OP ~ ZeRO-2 and "
            "HYBRID_SHARD ~ ZeRO++ hpZ are the nearest, not the same"),
    Setting("hybrid groups", "parallelism_config_dp_shard_size", "zero_optimization.zero_hpz_partition_size",
            False, "HYBRID_SHARD replicates across groups; hpZ shards across all ranks and adds a "
            "secondary bf16 param shard per group"),
    Setting("offload", "fsdp_offload_params: true", "offload_param + offload_optimizer device: cpu", True,
            "FSDP moves params, grads and optimizer states together; ZeRO-3 needs both DeepSpeed keys for "
            "that; DeepSpeed's param-only, optimizer-only and nvme offload have no FSDP counterpart; under "
            "accelerate launch also set zero_force_ds_cpu_optimizer: false, or Accelerate swaps the torch "
            "optimizer for DeepSpeedCPUAdam (lr and weight decay only)"),
    Setting("loading", "fsdp_cpu_ram_efficient_loading (+ fsdp_sync_module_states)", "zero3_init_flag", False,
            "both keep ranks other than 0 from loading a whole model (FSDP's rank 0 still loads it whole and "
            "broadcasts it; under zero.Init each module is partitioned as it is built); zero3_init_flag only "
            "exists for ZeRO-3"),
    Setting("checkpoint", "fsdp_state_dict_type", "zero3_save_16bit_model", False,
            "fsdp_state_dict_type sets what save_state writes (DCP shards, or one full fp32 file, plus the "
            "optimizer); DeepSpeed's save_state always writes per-rank ZeRO files, and zero3_save_16bit_model "
            "only lets save_model / get_state_dict gather one bf16 weights-only file"),
    Setting("prefetch", "fsdp_forward_prefetch / fsdp_backward_prefetch",
            "zero_optimization.stage3_prefetch_bucket_size", False,
            "hints only (notebook 04 checks the losses are unchanged): by default FSDP2 prefetches the next unit "
            "in backward only, in forward for modules given set_modules_to_forward_prefetch (Accelerate ignores "
            "these keys under fsdp_version 2; the guide applies them itself), DeepSpeed prefetches up to a bucket "
            "of parameter elements; NO_PREFETCH = bucket size 0"),
    Setting("mixed precision", "mixed_precision: bf16", "bf16.enabled: true", True,
            "fp32 shards + bf16 compute + bf16 reduction on FSDP = fp32 master + bf16 params + bf16 "
            "gradient buffer (DeepSpeed's default data_types) on ZeRO-1/2/3: identical losses on CPU/gloo in "
            "this guide (GPUs not checked; ZeRO-0 in bf16 runs another optimizer wrapper and does not match)"),
    Setting("low precision", "mixed_precision: no (model loaded in bf16)", "(none)", False,
            "DeepSpeed keeps an fp32 master with bf16 on unless bf16.bf16_master_weights_and_grads (ZeRO-1/2/3); "
            "bf16.enabled false trains in the model's loaded dtype: for an fp32 model, FSDP with --model-dtype fp32"),
    Setting("reduce dtype", "(none: bf16 under mixed_precision bf16)",
            "data_types.grad_accum_dtype + communication_data_type", False,
            "an fp32 gradient buffer/reduction on DeepSpeed has no fsdp_config key"),
    Setting("accumulation", "(script: --grad-accum)", "gradient_accumulation_steps", True,
            "the translation writes \"auto\", so the job's --grad-accum fills it on both sides"),
    Setting("clipping", "(script: --grad-clip, default off)", "gradient_clipping", True,
            "the translation writes \"auto\" (DeepSpeed would clip at 1.0 when the key is missing)"),
]


def settings_rows() -> list[dict]:
    """The key-by-key table, for display."""
    return [{"topic": s.topic, "FSDP (Accelerate)": s.fsdp, "DeepSpeed": s.deepspeed,
             "exact": "yes" if s.exact else "nearest", "note": s.note} for s in SETTINGS]


# Sharding: FSDP mode <-> DeepSpeed mode (MODES keys), with whether the pair is the same thing.
# ZeRO-1 has no FSDP mode: its nearest is SHARD_GRAD_OP (which also shards what ZeRO-1 shards).
COUNTERPARTS: list[tuple[str, str, bool]] = [
    ("no_shard", "zero0", True),
    ("shard_grad_op", "zero2", False),
    ("full_shard", "zero3", True),
    ("hybrid_shard", "zero3_hpz", False),
    ("shard_grad_op", "zero1", False),
]


def counterpart(key: str) -> tuple[Mode, bool]:
    """The other backend's mode for MODES[key] (first match in COUNTERPARTS) and whether it is exact."""
    for f, d, exact in COUNTERPARTS:
        if key in (f, d):
            return MODES[d if key == f else f], exact
    raise KeyError(f"no counterpart for mode {key!r}")
