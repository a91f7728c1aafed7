"""transformers (5.23.0) facts the guide states about precision (02) and offload (03).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from .. import fact

V = "5.23.0"
FAMILY_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox", "starcoder2", "mixtral",
                "qwen2_moe", "deepseek_v3", "gemma2", "gemma3_text", "olmo2", "phi", "cohere", "gpt_bigcode", "opt"]


@fact("transformers.causal_lm_families",
      "transformers builds a causal LM from a config (AutoModelForCausalLM.from_config) for every model_type the "
      "guide's twenty families use: llama, mistral, qwen2, qwen3, gemma, phi3, gpt2, gpt_neox, starcoder2, mixtral, "
      "qwen2_moe, deepseek_v3, gemma2, gemma3_text, olmo2, phi, cohere, gpt_bigcode, opt.",
      "transformers", V, "models/auto/modeling_auto.py: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
def _families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    missing = [t for t in FAMILY_TYPES if t not in names]
    return not missing, {"missing": missing, "classes": ", ".join(names[t] for t in FAMILY_TYPES if t in names)}


@fact("transformers.qwen2_qkv_bias_zero_init",
      "Qwen2's q/k/v projections have biases (its o_proj has none), and a Qwen2 built from a config starts them "
      "at zero.",
      "transformers", V, "models/qwen2/modeling_qwen2.py: Qwen2Attention; modeling_utils.py: "
      "PreTrainedModel._init_weights")
def _qwen2():
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    attn = AutoModelForCausalLM.from_config(cfg).model.layers[0].self_attn
    biases = {n: getattr(attn, n).bias for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    zero = all(b is not None and not b.any() for n, b in biases.items() if n != "o_proj")
    return zero and biases["o_proj"] is None, {"has bias": {n: b is not None for n, b in biases.items()},
                                               "q/k/v biases all zero": zero}


@fact("transformers.family_config_defaults",
      "transformers' defaults behind the families' 'what it adds': Gemma ties its embeddings, GPT-NeoX uses a "
      "parallel residual and partial rotary (0.25), StarCoder2 and GPT-NeoX have biased linears.",
      "transformers", V, "models/gemma/configuration_gemma.py; models/gpt_neox/configuration_gpt_neox.py; "
      "models/starcoder2/configuration_starcoder2.py")
def _defaults():
    from transformers import GemmaConfig, GPTNeoXConfig, Starcoder2Config

    g, n, s = GemmaConfig(), GPTNeoXConfig(), Starcoder2Config()
    rotary = getattr(n, "rotary_pct", None) or (getattr(n, "rope_parameters", None) or {}).get("partial_rotary_factor")
    ev = {"gemma tie_word_embeddings": g.tie_word_embeddings, "gpt_neox use_parallel_residual":
          n.use_parallel_residual, "gpt_neox partial rotary": rotary, "gpt_neox attention_bias": n.attention_bias,
          "starcoder2 use_bias": s.use_bias}
    return (g.tie_word_embeddings is True and n.use_parallel_residual is True and rotary == 0.25
            and n.attention_bias is True and s.use_bias is True), ev


def _tiny(model_type: str, **extra):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64, **extra)
    return cfg, AutoModelForCausalLM


@fact("transformers.sdpa_needs_class_support",
      "transformers refuses attn_implementation=\"sdpa\" for a model class whose _supports_sdpa is False (Gemma-2, "
      "with its soft-capped attention, is one); left unset, it picks sdpa where supported, else eager.",
      "transformers", V, "modeling_utils.py: PreTrainedModel._sdpa_can_dispatch, _check_and_adjust_attn_implementation")
def _sdpa_support():
    cfg, auto = _tiny("gemma2", head_dim=8)
    cls = auto._model_mapping[type(cfg)]
    cfg._attn_implementation = "sdpa"
    try:
        auto.from_config(cfg)
        refused = False
    except ValueError as e:
        refused = "does not support" in str(e)
    default = auto.from_config(_tiny("gemma2", head_dim=8)[0]).config._attn_implementation
    llama = auto.from_config(_tiny("llama")[0]).config._attn_implementation
    ev = {"Gemma2 _supports_sdpa": cls._supports_sdpa, "sdpa refused": refused, "gemma2 default": default,
          "llama default": llama}
    return cls._supports_sdpa is False and refused and default == "eager" and llama == "sdpa", ev


@fact("transformers.olmo2_rotary_fp32",
      "Olmo2's rotary embedding returns its cos and sin in fp32 for a bf16 model (Llama's returns them in the "
      "model's dtype); the decoder layers receive them as an argument.",
      "transformers", V, "models/olmo2/modeling_olmo2.py: Olmo2RotaryEmbedding.forward, apply_rotary_pos_emb")
def _olmo2_rotary():
    import torch

    out = {}
    for t in ("olmo2", "llama"):
        cfg, auto = _tiny(t)
        m = auto.from_config(cfg).to(torch.bfloat16)
        x = m.model.embed_tokens(torch.zeros(1, 4, dtype=torch.long))
        cos, sin = m.model.rotary_emb(x, torch.arange(4)[None])
        out[t] = str(cos.dtype).removeprefix("torch.")
    return out == {"olmo2": "float32", "llama": "bfloat16"}, out
