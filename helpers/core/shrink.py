"""``--shrink``: the user's architecture at a laptop's size.

The same ``model_type`` and the config's switches are kept: biases, ties, norms, soft-capping, the rotary
settings (a partial rotary keeps its fraction of a head), the attention kind (grouped-query and multi-query kept
as such) and implementation. Sizes and counts go down: width 64, 2 layers, 4 heads, a 128-token vocabulary, and
for a mixture of experts 4 experts, at most 2 per token, in one group (so a router that picks 8 of 256 in groups
now picks 2 of 4: the same code, another routing). Every change is listed. The arithmetic each layer does is the
same code at any width, so a parity question can be asked of the small model in a minute on a CPU; what depends
on size cannot: memory, speed, and which parameters ZeRO-3 keeps whole (at this size, all of them).
"""

from __future__ import annotations

WIDTH, FFN, LAYERS, HEADS, VOCAB = 64, 128, 2, 4, 128
_FIXED = {  # key -> shrunk value, for the keys a config has
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"), WIDTH),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "shared_expert_intermediate_size"), FFN),
    "moe_intermediate_size": 64,
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head"), HEADS),
    "head_dim": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": 32,
    "kv_lora_rank": 16,
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), 4),
    "n_group": 1, "topk_group": 1, "vocab_size": VOCAB,
}
_AT_MOST = {"num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 1024,
            "n_positions": 1024, "sliding_window": 8, "n_shared_experts": 1}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
_DROPPED = ("quantization_config",)  # weights are random: nothing to dequantize


def shrink(raw: dict) -> tuple[dict, list[str]]:
    """(the shrunk config.json, one ``key old -> new`` line per change)."""
    out, changes = dict(raw), []

    def put(key, value):
        if out.get(key) != value:
            changes.append(f"{key} {out.get(key)!r} -> {value!r}")
            out[key] = value

    for key, value in _FIXED.items():
        if key in raw and raw[key] is not None:
            put(key, value)
    for key, cap in _AT_MOST.items():
        if isinstance(raw.get(key), int) and raw[key] > cap:
            put(key, cap)
    heads = raw.get("num_attention_heads", raw.get("n_head"))
    kv = raw.get("num_key_value_heads")
    if isinstance(kv, int) and isinstance(heads, int):  # keep the kind: MHA, GQA or MQA
        put("num_key_value_heads", HEADS if kv == heads else 1 if kv == 1 else 2)
    if isinstance(raw.get("rotary_dim"), int) and heads:  # partial rotary: keep the rotated fraction of a head
        old_head = raw.get("head_dim") or (raw.get("hidden_size") or raw.get("n_embd")) // heads
        new_head = out.get("head_dim") or WIDTH // HEADS
        put("rotary_dim", max(2, 2 * round(raw["rotary_dim"] / old_head * new_head / 2)))
    for key in _TOKEN_IDS:
        v = raw.get(key)
        if isinstance(v, int) and v >= VOCAB:
            put(key, v % VOCAB)
        elif isinstance(v, list) and any(isinstance(x, int) and x >= VOCAB for x in v):
            put(key, [x % VOCAB for x in v])
    if isinstance(raw.get("layer_types"), list):  # one entry per layer: keep the first kinds, e.g. sliding, full
        kinds = list(dict.fromkeys(raw["layer_types"]))
        put("layer_types", (kinds * LAYERS)[:LAYERS])
    for key in _DROPPED:
        if key in out:
            changes.append(f"{key} dropped")
            del out[key]
    return out, changes
