"""transformers (5.23.0) facts the guide states about prefetch (04), loading (05) and checkpoints (06).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os

from .. import fact
from .._tools import scratch, source_has

V = "5.23.0"


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)


@fact("transformers.save_pretrained_files",
      "save_pretrained writes config.json, generation_config.json and model.safetensors; from_pretrained loads a "
      "directory holding config.json + model.safetensors.",
      "transformers", V, "transformers/modeling_utils.py: PreTrainedModel.save_pretrained, from_pretrained",
      runs=True)
def _save():
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    d = scratch("facts_hf_")
    LlamaForCausalLM(_tiny_config()).save_pretrained(d)
    files = sorted(os.listdir(d))
    (d / "generation_config.json").unlink()
    loaded = type(AutoModelForCausalLM.from_pretrained(d)).__name__
    return files == ["config.json", "generation_config.json", "model.safetensors"] and loaded == "LlamaForCausalLM", {
        "save_pretrained wrote": files, "from config.json + model.safetensors": loaded}


@fact("transformers.safetensors_memory_mapped",
      "transformers memory-maps safetensors files (safetensors.safe_open).",
      "transformers", V, "transformers/modeling_utils.py: load_state_dict")
def _mmap():
    return source_has("transformers.modeling_utils.load_state_dict",
                      'with safe_open(checkpoint_path, framework="pt") as f:')


@fact("transformers.from_pretrained_in_zero_init",
      "With a live HfDeepSpeedConfig of stage 3 (Accelerate's zero3_init_flag), from_pretrained builds the model "
      "inside deepspeed.zero.Init.",
      "transformers", V, "transformers/modeling_utils.py: PreTrainedModel.get_init_context; "
      "transformers/integrations/deepspeed.py: HfDeepSpeedConfig", runs=True)
def _zero_init():
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    before = is_deepspeed_zero3_enabled()
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    during = is_deepspeed_zero3_enabled()
    del keep
    ok, ev = source_has("transformers.modeling_utils.PreTrainedModel.get_init_context",
                        "if is_deepspeed_zero3_enabled():",
                        "deepspeed.zero.Init(config_dict_or_path=deepspeed_config())")
    return ok and not before and during, {"zero3 enabled without / with HfDeepSpeedConfig": (before, during), **ev}


@fact("transformers.zero3_rank0_reads_fills_per_module",
      "Under ZeRO-3 only rank 0 reads the checkpoint's values (the others read shapes only), and the weights are "
      "filled module by module: each module's parameters are gathered, rank 0 copies them in, then re-partitioned.",
      "transformers", V, "transformers/modeling_utils.py: PreTrainedModel._load_pretrained_model; "
      "transformers/integrations/deepspeed.py: _load_state_dict_into_zero3_model")
def _rank0():
    a, ea = source_has("transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
                       'map_location = "cpu" if torch.distributed.get_rank() == 0 else "meta"')
    b, eb = source_has("transformers.integrations.deepspeed._load_state_dict_into_zero3_model",
                       "with deepspeed.zero.GatheredParameters(params_to_gather, modifier_rank=0):")
    return a and b, {"rank 0 reads": a, "GatheredParameters per module, modifier_rank=0": b,
                     **({} if a and b else {**ea, **eb})}


@fact("transformers.rope_buffers_non_persistent",
      "Llama's rotary module holds two non-persistent buffers, inv_freq and original_inv_freq, computed in "
      "__init__: they are in no state dict, so no checkpoint restores them.",
      "transformers", V, "transformers/models/llama/modeling_llama.py: LlamaRotaryEmbedding.__init__")
def _rope():
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(_tiny_config())
    rot = m.model.rotary_emb
    in_sd = [k for k in m.state_dict() if "rotary" in k]
    names = sorted(rot._non_persistent_buffers_set)
    return names == ["inv_freq", "original_inv_freq"] and not in_sd, {
        "non-persistent buffers": names, "rotary keys in state_dict": in_sd}
