"""transformers (5.23.0) facts the guide states about the README and the launch configs' comments.

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
import tempfile
from unittest import mock

from .. import fact
from .._tools import source_has

V = "5.23.0"


def _tiny(**kw):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, **kw))


@fact("transformers.loads_weights_only_no_remote_code",
      "transformers reads a .bin checkpoint with torch.load(weights_only=True) and refuses a directory's own code "
      "unless trust_remote_code is passed.",
      "transformers", V, "modeling_utils.py: load_state_dict; dynamic_module_utils.py: resolve_trust_remote_code")
def _safe_load():
    import torch
    from transformers import dynamic_module_utils
    from transformers.modeling_utils import load_state_dict

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "pytorch_model.bin")
        torch.save({"w": torch.ones(1)}, p)
        with mock.patch("torch.load", wraps=torch.load) as spy:
            load_state_dict(p)
        wo = spy.call_args.kwargs.get("weights_only", "unset")
        with mock.patch.object(dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 0):
            try:
                dynamic_module_utils.resolve_trust_remote_code(None, d, has_local_code=False, has_remote_code=True)
                refused = False
            except ValueError:
                refused = True
    return wo is True and refused, {"weights_only": wo, "remote code refused by default": refused}


@fact("transformers.activation_checkpointing_kwargs",
      "transformers' activation_checkpointing_enable() takes use_reentrant inside activation_checkpointing_kwargs "
      "(no use_reentrant argument) and defaults to non-reentrant checkpointing of each decoder layer.",
      "transformers", V, "modeling_utils.py: PreTrainedModel.activation_checkpointing_enable, "
      "_activation_checkpointing_enable")
def _ac_kwargs():
    import inspect

    from transformers import PreTrainedModel

    params = inspect.signature(PreTrainedModel.activation_checkpointing_enable).parameters
    m = _tiny()
    m.activation_checkpointing_enable()
    fn = m.model.layers[0]._gradient_checkpointing_func
    kw = getattr(fn, "keywords", {})
    ok = "use_reentrant" not in params and "activation_checkpointing_kwargs" in params \
        and m.model.gradient_checkpointing and kw.get("use_reentrant") is False
    return ok, {"use_reentrant param": "use_reentrant" in params, "on": m.model.gradient_checkpointing,
                "use_reentrant": kw.get("use_reentrant")}


@fact("transformers.activation_checkpointing_offload_pinned",
      "activation_checkpointing_enable(offload=True) keeps the checkpointed inputs on the host in pinned memory "
      "(save_on_cpu(pin_memory=True)).",
      "transformers", V, "modeling_utils.py: PreTrainedModel._activation_checkpointing_enable")
def _ac_offload():
    return source_has("transformers.PreTrainedModel._activation_checkpointing_enable", "if offload:",
                      "save_on_cpu(pin_memory=True")


@fact("transformers.config_gradient_checkpointing_on",
      "A model whose config says gradient_checkpointing: true is built with transformers' own activation "
      "checkpointing on.",
      "transformers", V, "modeling_utils.py: PreTrainedModel._backward_compatibility_gradient_checkpointing")
def _cfg_on():
    m, plain = _tiny(gradient_checkpointing=True), _tiny()
    return m.model.gradient_checkpointing and not plain.model.gradient_checkpointing, {
        "with config key": m.model.gradient_checkpointing, "without": plain.model.gradient_checkpointing}


@fact("transformers.no_deepspeed_checkpointing",
      "transformers' models never call deepspeed.checkpointing: their activation checkpointing is torch's "
      "torch.utils.checkpoint.checkpoint, and no transformers module refers to DeepSpeed's checkpointing.",
      "transformers", V, "modeling_utils.py: PreTrainedModel._activation_checkpointing_enable")
def _no_ds_ckpt():
    from pathlib import Path

    import torch.utils.checkpoint
    import transformers

    m = _tiny()
    m.activation_checkpointing_enable()
    fn = m.model.layers[0]._gradient_checkpointing_func
    fn = getattr(fn, "func", fn)
    names = ("deepspeed.checkpointing", "activation_checkpointing.checkpointing",
             "deepspeed.runtime.activation_checkpointing")
    files = list(Path(transformers.__file__).parent.rglob("*.py"))
    hits = [p.name for p in files if any(n in p.read_text(errors="ignore") for n in names)]
    return fn is torch.utils.checkpoint.checkpoint and not hits and len(files) > 100, {
        "checkpoint function": f"{fn.__module__}.{fn.__name__}",
        "files naming DeepSpeed's checkpointing": hits or "none", "files read": len(files)}
