"""transformers (5.23.0) facts the guide states about launching (notebook 00) and sharding (01).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from .. import fact

V = "5.23.0"


@fact("transformers.qwen2_qkv_bias",
      "Qwen2's attention projections q_proj, k_proj and v_proj have biases (o_proj and the MLP have none).",
      "transformers", V, "models/qwen2/modeling_qwen2.py: Qwen2Attention.__init__")
def _qwen2_bias():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP

    cfg = Qwen2Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                      num_hidden_layers=1, vocab_size=32)
    attn, mlp = Qwen2Attention(cfg, layer_idx=0), Qwen2MLP(cfg)
    has = {n: getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    has["mlp"] = any(m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return has == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False, "mlp": False}, has
