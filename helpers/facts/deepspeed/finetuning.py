"""DeepSpeed (0.19.8) facts the fine-tuning notebook (09) and docs/finetuning.md state.

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from .. import fact
from .._tools import source_has

V = "0.19.8"


@fact("deepspeed.zero3_module_io_autograd_functions",
      "ZeRO-3 registers hooks on every module of the model, recursively, but stops at a module marked as a ZeRO-3 "
      "leaf (the leaf is hooked, its submodules are not); the hooks pass each module's tensor inputs and outputs "
      "through autograd Functions of its own "
      "(PostBackwardFunctionModule, PreBackwardFunctionForModule): each module's inputs reach the module through a "
      "node of their own in the backward graph.",
      "deepspeed", V, "runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload._register_deepspeed_module")
def _module_io_functions():
    return source_has("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module",
                      "if z3_leaf_module(module):",
                      "for child in module.children():", "class PostBackwardFunctionModule(torch.autograd.Function):",
                      "class PreBackwardFunctionForModule(torch.autograd.Function):",
                      "module.register_forward_pre_hook(_post_backward_module_hook)")
