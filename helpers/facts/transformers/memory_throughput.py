"""transformers (5.23.0) facts the guide states about throughput (07) and memory and batch size (08).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from .. import fact

V = "5.23.0"


@fact("transformers.llama_lm_head_untied_linear",
      "LlamaForCausalLM's output projection lm_head is a hidden x vocab nn.Linear; with tie_word_embeddings=False "
      "(the guide's presets) it has its own weight, not the embedding's.",
      "transformers", V, "models/llama/modeling_llama.py: LlamaForCausalLM.__init__", runs=True)
def _lm_head():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg)
    shared = m.lm_head.weight is m.model.embed_tokens.weight
    ok = type(m.lm_head) is torch.nn.Linear and tuple(m.lm_head.weight.shape) == (64, 16) and not shared
    return ok, {"lm_head": type(m.lm_head).__name__, "weight (vocab, hidden)": tuple(m.lm_head.weight.shape),
                "shares the embedding": shared}
