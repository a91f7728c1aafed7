"""Tiny ``config.json`` models of the causal-LM families transformers builds from a config.

``--model PATH/config.json`` accepts any of them (helpers.core.models). Between them they cover
attention and MLP biases, tied embeddings, grouped-query attention, fused projections, q/k
norms and parallel residuals. ``python -m helpers.families`` trains them all under one launch
config (helpers.job.sweep). The parity test (tests/test_families.py) and the precision notebook
expect the aligned pair (``fsdp/full_shard.yaml``, ``deepspeed/zero3.yaml``) to be bit-identical
for every family, unless it is in ``KNOWN_EXCEPTIONS`` with its cause.
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
}

# family -> why the aligned pair cannot be bit-identical for it (none known with the shipped configs)
KNOWN_EXCEPTIONS: dict[str, str] = {}


def write_config(name: str, directory: str | Path) -> Path:
    """Write FAMILIES[name]'s config.json to DIRECTORY/NAME.json; returns the path."""
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(FAMILIES[name][0], indent=2))
    return path
