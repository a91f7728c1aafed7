"""PEFT (0.21.2) facts the fine-tuning notebook and helpers.job.lora state.

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from .. import fact

V = "0.21.2"


def _tiny_bf16():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


@fact("peft.adapter_dtype",
      "PEFT's inject_adapter_in_model makes a LoRA adapter in the dtype of the layer it adapts (bf16 for a bf16 "
      "model) and freezes every other parameter; get_peft_model makes the same model's adapter fp32 "
      "(autocast_adapter_dtype=True).",
      "peft", V, "tuners/tuners_utils.py: BaseTuner.inject_adapter, cast_adapter_dtype; peft_model.py: PeftModel")
def _adapter_dtype():
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    cfg = dict(r=2, target_modules=["o_proj"])
    injected = inject_adapter_in_model(LoraConfig(**cfg), _tiny_bf16())
    wrapped = get_peft_model(_tiny_bf16(), LoraConfig(**cfg))
    lora = {str(p.dtype) for n, p in injected.named_parameters() if "lora_" in n}
    frozen = all(not p.requires_grad for n, p in injected.named_parameters() if "lora_" not in n)
    wrapped_dtypes = {str(p.dtype) for n, p in wrapped.named_parameters() if "lora_" in n}
    ev = {"inject_adapter_in_model": sorted(lora), "base frozen": frozen, "get_peft_model": sorted(wrapped_dtypes)}
    return lora == {"torch.bfloat16"} and frozen and wrapped_dtypes == {"torch.float32"}, ev


@fact("peft.save_reads_module_tensors",
      "PeftModel.save_pretrained writes the tensors of the model's own state_dict (get_peft_model_state_dict) as "
      "they are in the process that calls it: it gathers only for transformers' tensor parallelism, never an "
      "FSDP-sharded or ZeRO-3-partitioned parameter. PEFT warns when a lora_A or lora_B tensor it is about to "
      "return is zero-sized or 1-D (\"shards were not gathered\"), and returns it anyway.",
      "peft", V, "peft_model.py: PeftModel.save_pretrained; utils/save_and_load.py: get_peft_model_state_dict, "
      "_validate_lora_adapter_state_dict")
def _save_reads_module():
    import warnings

    import torch

    from .._tools import source_has

    ok1, ev1 = source_has("peft.utils.save_and_load.get_peft_model_state_dict", "state_dict = model.state_dict()",
                          "gather_state_dict_for_save")
    ok2, ev2 = source_has("peft.peft_model.PeftModel.save_pretrained", "get_peft_model_state_dict(")
    from peft.utils.save_and_load import _validate_lora_adapter_state_dict

    empty = {"m.lora_A.weight": torch.empty(0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _validate_lora_adapter_state_dict(empty, adapter_name="default")
    warned = any("were not gathered" in str(w.message) for w in caught)
    return ok1 and ok2 and warned and empty["m.lora_A.weight"].numel() == 0, \
        {**ev1, **{f"save_pretrained {k}": v for k, v in ev2.items()}, "warns on an empty lora_A": warned}
