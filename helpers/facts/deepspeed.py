"""DeepSpeed (0.19.8) facts the guide states. Read the module docstring of helpers.facts first."""

from __future__ import annotations

import os

from . import fact
from ._tools import ds_engine

V = "0.19.8"


def _optimizer_class(stage: int, **extra) -> str:
    return type(ds_engine({"stage": stage}, **extra).optimizer).__name__


@fact("deepspeed.zero0_bf16_optimizer",
      "DeepSpeed runs ZeRO-0 in bf16 (with its default bf16 gradient-accumulation dtype) through a separate "
      "optimizer wrapper, FP16_UnfusedOptimizer (not BF16_Optimizer), instead of its ZeRO code.",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._do_optimizer_sanity_check, _configure_fp16_optimizer",
      runs=True)
def _zero0_bf16():
    name = _optimizer_class(0)
    return name == "FP16_UnfusedOptimizer", {"optimizer": name}


@fact("deepspeed.zero_optimizer_classes",
      "ZeRO-1 and ZeRO-2 run one ZeRO optimizer class (DeepSpeedZeroOptimizer, stage_1_and_2.py); ZeRO-3 runs "
      "another (DeepSpeedZeroOptimizer_Stage3, stage3.py).",
      "deepspeed", V, "runtime/engine.py: DeepSpeedEngine._configure_zero_optimizer", runs=True)
def _zero_classes():
    names = {s: _optimizer_class(s) for s in (1, 2, 3)}
    ok = names[1] == names[2] == "DeepSpeedZeroOptimizer" and names[3] == "DeepSpeedZeroOptimizer_Stage3"
    return ok, {f"stage{s}": n for s, n in names.items()}


@fact("deepspeed.gradient_clipping_default",
      "DeepSpeed clips gradients at a norm of 1.0 when the config has no gradient_clipping key.",
      "deepspeed", V, "runtime/config.py: get_gradient_clipping (GRADIENT_CLIPPING_DEFAULT)")
def _clip_default():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import get_gradient_clipping

    clip = get_gradient_clipping({})
    return clip == 1.0, {"gradient_clipping": clip}
