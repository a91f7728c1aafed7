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


def _m(key, backend, fsdp1, fsdp2, zero, sharded, config, min_ws=1, note=""):
    return Mode(key, backend, fsdp1, fsdp2, zero, frozenset(sharded), config, min_ws, note)


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
       note="DeepSpeed reduces gradients into partitions at the step; they are full during backward"),
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
         "sharded per rank": ", ".join(c for c in CATEGORIES if c in m.sharded) or "nothing",
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


def mode_key(job) -> str:
    """The MODES key of a JobConfig."""
    if job.backend == "fsdp":
        return job.fsdp.sharding.lower()
    hpz = int(job.deepspeed.json.get("zero_optimization", {}).get("zero_hpz_partition_size", 1))
    return f"zero{job.deepspeed.zero_stage}" + ("_hpz" if hpz > 1 else "")


