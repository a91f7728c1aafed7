"""Tiny ``config.json`` models of the causal-LM families transformers builds from a config.

``--model PATH/config.json`` accepts any of them (helpers.core.models). Between them they cover attention and
MLP biases, tied embeddings, grouped- and multi-query attention, latent attention, fused projections, q/k norms,
parallel residuals, mixtures of experts and soft-capped attention. ``python -m helpers.families`` trains them
all under one launch config (helpers.job.sweep). The parity test (tests/test_families.py) and the precision
notebook expect the aligned pair (``fsdp/full_shard.yaml``, ``deepspeed/zero3.yaml``) to be bit-identical for
every family, unless it is in ``KNOWN_EXCEPTIONS`` with its cause. ``python -m helpers.switch --families all``
runs the same pairs and says where each parted one parts, and why.
"""

from __future__ import annotations

import json
from pathlib import Path

_W = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)

# name -> (config.json, what the family adds to the sweep)
FAMILIES: dict[str, tuple[dict, str]] = {
    "llama": ({"model_type": "llama", **_W, "tie_word_embeddings": False}, "no biases, untied"),
    "llama_tied": ({"model_type": "llama", **_W, "tie_word_embeddings": True}, "tied embeddings"),
    "mistral": ({"model_type": "mistral", **_W, "num_key_value_heads": 2}, "GQA"),
    "qwen2": ({"model_type": "qwen2", **_W, "num_key_value_heads": 2}, "q/k/v biases, GQA"),
    "qwen3": ({"model_type": "qwen3", **_W, "num_key_value_heads": 2, "head_dim": 16}, "q/k RMSNorm, GQA"),
    "gemma": ({"model_type": "gemma", **_W, "num_key_value_heads": 1, "head_dim": 16},
              "tied, scaled embeddings, multi-query"),
    "phi3": ({"model_type": "phi3", **_W, "num_key_value_heads": 2, "pad_token_id": None, "bos_token_id": 1,
              "eos_token_id": 2},
             "fused qkv and gate_up projections"),
    "gpt2": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "bos_token_id": 0,
              "eos_token_id": 0},
             "biases everywhere (Conv1D), LayerNorm, tied, learned positions"),
    "gpt_neox": ({"model_type": "gpt_neox", **_W, "tie_word_embeddings": False},
                 "biases (nn.Linear), parallel residual, partial rotary"),
    "starcoder2": ({"model_type": "starcoder2", **_W, "num_key_value_heads": 2, "use_bias": True,
                    "bos_token_id": 0, "eos_token_id": 0},  # its defaults (50256) lie outside our 128-token vocab
                   "biases (nn.Linear), GQA, LayerNorm"),
    "mixtral": ({"model_type": "mixtral", **_W, "num_key_value_heads": 2, "num_local_experts": 4,
                 "num_experts_per_tok": 2}, "mixture of experts (top-2 of 4), GQA"),
    "qwen2_moe": ({"model_type": "qwen2_moe", **_W, "num_key_value_heads": 2, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
                  "mixture of experts with a gated shared expert, q/k/v biases"),
    "deepseek_v3": ({"model_type": "deepseek_v3", **_W, "num_key_value_heads": 4, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1,
                     "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16},
                    "latent attention (low-rank q and kv), a dense layer then experts"),
    "gemma2": ({"model_type": "gemma2", **_W, "num_key_value_heads": 2, "head_dim": 16},
               "soft-capped attention and logits (eager attention: no sdpa), sandwich norms"),
    "gemma3_text": ({"model_type": "gemma3_text", **_W, "num_key_value_heads": 2, "head_dim": 16},
                    "sliding and global layers, q/k RMSNorm, sandwich norms"),
    "olmo2": ({"model_type": "olmo2", **_W, "num_key_value_heads": 2}, "norms after attention and MLP, q/k norm"),
    "phi": ({"model_type": "phi", **_W, "bos_token_id": 0, "eos_token_id": 0},
            "parallel attention and MLP, partial rotary, biases, dense (no gate) MLP"),
    "cohere": ({"model_type": "cohere", **_W, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 0,
                "pad_token_id": 0}, "LayerNorm without bias, parallel block, scaled tied logits"),
    "gpt_bigcode": ({"model_type": "gpt_bigcode", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128,
                     "bos_token_id": 0, "eos_token_id": 0}, "multi-query attention in one fused projection"),
    "opt": ({"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 128, "word_embed_proj_dim": 64, "pad_token_id": 1,
             "bos_token_id": 2, "eos_token_id": 2}, "learned positions with an offset, ReLU, biases"),
}

# family -> the cause (helpers.core.causes) that keeps the aligned pair from being bit-identical for it; the cause
# names the test that checks it, and tests/test_families.py checks that helpers.switch finds it
KNOWN_EXCEPTIONS: dict[str, str] = {
    "olmo2": "fsdp_casts_unit_inputs",  # its rotary cos/sin are fp32: FSDP hands them to the layers in bf16
}


def write_config(name: str, directory: str | Path) -> Path:
    """Write FAMILIES[name]'s config.json to DIRECTORY/NAME.json; returns the path."""
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(FAMILIES[name][0], indent=2))
    return path
