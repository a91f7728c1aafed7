"""Older spellings of ``fsdp_config`` keys that Accelerate (1.15) still reads.

Accelerate copies every ``fsdp_config`` key onto its launch arguments (adding
the ``fsdp_`` prefix when a key lacks it), and under ``fsdp_version: 1`` its FSDP plugin
turns numbers into enums: ``fsdp_sharding_strategy: 1`` is FULL_SHARD (1-5 in the order of
``ShardingStrategy``), ``fsdp_backward_prefetch: 1`` is BACKWARD_PRE,
``fsdp_state_dict_type: 3`` is SHARDED_STATE_DICT (torch's ``StateDictType``); under
``fsdp_version: 2`` it ignores the first two and only the state-dict number still applies.
``normalize_fsdp_config`` rewrites those spellings into the names the rest of
helpers.config checks, and says what it did.

``fsdp_backward_prefetch_policy`` (the name before ``fsdp_backward_prefetch``)
is still *accepted* by ``accelerate launch`` but nothing reads it: the file
looks as if it sets prefetching and it does not. This guide does the same (the
value is ignored) and warns, so the learner can rename the key.
"""

from __future__ import annotations

SHARDING_BY_NUMBER = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
PREFETCH_BY_NUMBER = {1: "BACKWARD_PRE", 2: "BACKWARD_POST"}
STATE_DICT_BY_NUMBER = {1: "FULL_STATE_DICT", 2: "LOCAL_STATE_DICT", 3: "SHARDED_STATE_DICT"}
_NUMBERED = {
    "fsdp_sharding_strategy": SHARDING_BY_NUMBER,
    "fsdp_reshard_after_forward": SHARDING_BY_NUMBER,  # FSDP1 spelling: a strategy under this key
    "fsdp_backward_prefetch": PREFETCH_BY_NUMBER,
    "fsdp_state_dict_type": STATE_DICT_BY_NUMBER,
}
IGNORED_BY_ACCELERATE = "fsdp_backward_prefetch_policy"


def _number(v) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    return None


def normalize_fsdp_config(sec: dict) -> tuple[dict, list[str]]:
    """``fsdp_config`` with legacy spellings rewritten; also one warning line per rewrite or ignored key.

    Numbers outside the tables are left as they are, so the normal check refuses them by name.
    """
    if not isinstance(sec, dict):
        return sec, []
    out, warnings = {}, []
    for key, value in sec.items():
        name = key if str(key).startswith("fsdp_") else f"fsdp_{key}"
        if name != key:
            warnings.append(f"fsdp_config.{key}: read as {name} (Accelerate adds the fsdp_ prefix)")
        n = _number(value) if name in _NUMBERED else None
        if n is not None and n in _NUMBERED[name]:
            value = _NUMBERED[name][n]
            warnings.append(f"fsdp_config.{name} = {n}: the numeric spelling of {value}")
        if name == IGNORED_BY_ACCELERATE:
            warnings.append(
                f"fsdp_config.{name} = {value!r} is ignored: Accelerate 1.15 accepts the old key and "
                f"silently drops it, and so does this guide; to prefetch, write fsdp_backward_prefetch: "
                f"{PREFETCH_BY_NUMBER.get(_number(value), value)}"
            )
            continue
        out[name] = value
    return out, warnings
