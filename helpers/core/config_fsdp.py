"""The ``fsdp_config`` (and ``parallelism_config``) section of a launch config -> FSDPOptions.

Legacy FSDP1 spellings are normalised first (``helpers.core.compat``, with a note); then the sharding
strategy, the other keys, and hybrid sharding's group sizes against the world size are checked.
"""

from __future__ import annotations

import os

from helpers.core.compat import normalize_fsdp_config
from helpers.core.config_keys import _FSDP_KEYS, _PAR_KEYS, _SHARDING, _Checker
from helpers.core.config_types import FSDPOptions


def _fsdp_options(c: _Checker, raw: dict, world_size: int | None) -> tuple[FSDPOptions, list[str]]:
    fsdp_sec, notes = normalize_fsdp_config(raw.get("fsdp_config") or {})  # legacy spellings, warned
    sec = c.section({**raw, "fsdp_config": fsdp_sec}, "fsdp_config", _FSDP_KEYS)
    par = c.section(raw, "parallelism_config", _PAR_KEYS)
    o = FSDPOptions()
    version = sec.get("fsdp_version", 1)
    raf = sec.get("fsdp_reshard_after_forward")
    strategy = sec.get("fsdp_sharding_strategy")
    if isinstance(raf, bool) or (isinstance(raf, str) and raf.lower() in ("true", "false")):
        raf = c.value("fsdp_config.fsdp_reshard_after_forward", raf, bool)
        if strategy is not None:
            c.fail(
                "fsdp_config: give either fsdp_sharding_strategy or a true/false "
                "fsdp_reshard_after_forward, not both"
            )
        strategy = "FULL_SHARD" if raf else "SHARD_GRAD_OP"
    elif raf is not None:  # FSDP1 spelling: the strategy name under reshard_after_forward
        strategy = _strategy_under_raf(c, raf, version)
    o.sharding = strategy or "FULL_SHARD"
    o.reshard_after_forward = o.sharding in ("FULL_SHARD", "HYBRID_SHARD")
    if version == 1:
        notes.append("fsdp_version 1: this guide runs these keys with FSDP2 (fully_shard); "
                     "accelerate launch would use FSDP1")
    for key, attr in [
        ("fsdp_offload_params", "offload_params"), ("fsdp_state_dict_type", "state_dict_type"),
        ("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
        ("fsdp_sync_module_states", "sync_module_states"), ("fsdp_auto_wrap_policy", "auto_wrap_policy"),
        ("fsdp_transformer_layer_cls_to_wrap", "transformer_layer_cls_to_wrap"),
        ("fsdp_min_num_params", "min_num_params"), ("fsdp_forward_prefetch", "forward_prefetch"),
        ("fsdp_backward_prefetch", "backward_prefetch"),
        ("fsdp_activation_checkpointing", "activation_checkpointing"),
        ("fsdp_activation_checkpointing_offload", "activation_checkpointing_offload"),
        ("fsdp_use_orig_params", "use_orig_params"),
    ]:
        if key in sec:
            setattr(o, attr, sec[key])
    if o.activation_checkpointing_offload and not o.activation_checkpointing:
        c.fail("fsdp_config.fsdp_activation_checkpointing_offload = true needs fsdp_activation_checkpointing: true "
               "(it offloads what checkpointing holds; Accelerate refuses it alone too)")
    if version == 2 and ("fsdp_forward_prefetch" in sec or "fsdp_backward_prefetch" in sec):
        notes.append("fsdp_forward_prefetch / fsdp_backward_prefetch: accelerate launch ignores them under "
                     "fsdp_version 2; this guide maps them onto FSDP2's explicit prefetch (helpers.job.backends.fsdp)")
    if o.min_num_params < 0:
        c.fail(f"fsdp_config.fsdp_min_num_params = {o.min_num_params}: must be >= 0")

    for key in ("parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_sp_size"):
        if par.get(key, 1) != 1:
            c.fail(f"parallelism_config.{key} = {par[key]}: this guide runs data parallelism only; allowed: 1")
    rep, shard = par.get("parallelism_config_dp_replicate_size"), par.get("parallelism_config_dp_shard_size")
    for key, v in (("dp_replicate_size", rep), ("dp_shard_size", shard)):
        if v is not None and v < 1:
            c.fail(f"parallelism_config.parallelism_config_{key} = {v}: must be >= 1")
    if rep and rep > 1 and o.sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        o.sharding = "HYBRID_SHARD" if o.sharding == "FULL_SHARD" else "HYBRID_SHARD_ZERO2"
    if o.sharding.startswith("HYBRID"):
        o.hybrid_shard_size = shard
        if world_size is not None:
            size = shard or (world_size // rep if rep else None)
            if size is None:
                size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            if rep and shard and rep * shard != world_size:
                c.fail(
                    f"parallelism_config: dp_replicate_size ({rep}) x dp_shard_size ({shard}) = "
                    f"{rep * shard}, but the job has {world_size} ranks; run it on {rep * shard} ranks "
                    f"(--nproc_per_node {rep * shard}), or on {world_size} use fsdp/full_shard.yaml (one "
                    "shard group) or set the two sizes so that their product is the rank count"
                )
            if world_size % size or size == world_size:
                c.fail(
                    f"{o.sharding} needs a shard group that divides the world size into 2 or more "
                    f"replicas: shard group size {size}, world size {world_size} "
                    "(hybrid modes need 4 ranks here: 2 replicas x 2 shards)"
                )
            o.hybrid_shard_size = size
    return o, notes


def _strategy_under_raf(c: _Checker, raf, version: int) -> str:
    """A sharding strategy under fsdp_reshard_after_forward (FSDP1's spelling); any other value is a true/false
    key's typo (``ture``), and the message says so rather than listing the strategies alone."""
    if isinstance(raf, str) and raf.upper() in _SHARDING:
        return c.value("fsdp_config.fsdp_reshard_after_forward", raf, _SHARDING)
    also = f" (under fsdp_version 1 also a sharding strategy: {', '.join(_SHARDING)})" if version == 1 else ""
    c.fail(f"fsdp_config.fsdp_reshard_after_forward = {raf!r}: expected true or false{also}")
