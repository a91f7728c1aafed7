"""Why two runs of the same job part: the causes the guide knows, each with the test that checks it.

``python -m helpers.switch`` (and the family sweep) name a cause when its ``applies`` holds for the two runs:
their ``summary.json`` (``effective`` settings, ``peft``), the comparison (``helpers.compare``: the first
differing step, tensor and module) and the forward activation trace (which module outputs, in which dtype,
came before the first differing one). A cause is a diagnosis, not a proof: its test checks where such runs
part, and the facts behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Evidence:
    """What a cause may look at (helpers.switch builds it from two run directories)."""

    summaries: tuple[dict, dict]
    stage: str | None  # first differing tensor stage (helpers.compare), or None
    phase: str | None  # first differing module: "forward" | "backward", or None
    module_cls: str | None  # that module's class
    module_biased: bool  # whether it has a bias parameter
    module_step: int | None  # the step of that module's record
    losses_equal: bool  # every loss the two runs logged is the same
    before: list[tuple[str, str]]  # (module, dtype) of the forward outputs met before it, side A

    def both(self, key: str) -> tuple:
        return tuple((s.get("effective") or {}).get(key) for s in self.summaries)

    def backends(self) -> tuple[str, str]:
        return tuple(s.get("backend") for s in self.summaries)


@dataclass(frozen=True)
class Cause:
    key: str
    text: str
    test: str  # the test that checks it (tests/FILE::NAME)
    applies: Callable[[Evidence], bool]


def _unit_input_cast(e: Evidence) -> bool:
    casts = e.both("unit_inputs_cast_to")
    fp32_outside = any(dt == "fp32" for name, dt in e.before if ".layers." not in name and name != "(model)")
    return e.phase == "forward" and len(set(casts)) == 2 and fp32_outside


def _zero3_linear(e: Evidence) -> bool:
    return (e.phase == "forward" and e.module_cls == "Linear" and e.module_biased
            and True in e.both("memory_efficient_linear"))


def _zero3_shared_input(e: Evidence) -> bool:
    peft = all(s.get("peft") for s in e.summaries)
    zero3_one_side = sum("every module" in (u or "") for u in e.both("units")) == 1
    return e.phase == "backward" and peft and zero3_one_side


def _clipping(e: Evidence) -> bool:
    a, b = e.both("max_norm")
    # with tensor traces: the reduced gradient or the update parts first; without: the forward agrees at step 0
    # and parts once an update has been applied
    return a != b and (e.stage in ("grad_reduced", "update") or (e.stage is None and (e.module_step or 0) > 0))


def _norm_dtype(e: Evidence) -> bool:
    a, b = e.both("norm_dtype")
    return a != b and e.losses_equal and e.phase is None and e.stage is None


CAUSES: list[Cause] = [
    Cause("fsdp_casts_unit_inputs",
          "FSDP2 casts the floating-point inputs of every unit to bf16 (MixedPrecisionPolicy.cast_forward_inputs, "
          "which Accelerate leaves on); DeepSpeed passes them as they are. A tensor the model makes in fp32 "
          "outside its layers (here {fp32}) reaches the layers in bf16 under FSDP only.",
          "tests/test_families.py::test_fsdp_casts_unit_inputs_is_the_olmo2_cause", _unit_input_cast),
    Cause("zero3_memory_efficient_linear",
          "ZeRO-3's memory_efficient_linear (on unless the JSON sets it false) replaces F.linear with its own "
          "function, which adds the bias in a second bf16 rounding.",
          "tests/test_families.py::test_zero3_default_linear_is_the_qwen2_cause", _zero3_linear),
    Cause("zero3_shared_input_order",
          "ZeRO-3 passes every module's inputs and outputs through its own autograd functions; an input that two "
          "adapted projections share (q_proj and v_proj read the same hidden states) then has its gradients "
          "summed in another order, and bf16 sums in another order round differently.",
          "tests/test_lora.py::test_adapters_on_shared_inputs_part_in_the_last_bit_under_zero3", _zero3_shared_input),
    Cause("clipping_differs",
          "The two runs clip at different max norms ({max_norm}): DeepSpeed clips at 1.0 when its JSON has no "
          "gradient_clipping, FSDP clips only when the training script asks.",
          "tests/test_promises.py::test_fsdp_grad_clip_matches_deepspeed_clipping", _clipping),
    Cause("grad_norm_dtype",
          "Training is identical (every loss, module output and output gradient); only the reported gradient norms "
          "differ, in their last bits: ZeRO-1/2 sum the squared norms in fp32, ZeRO-3 and the guide's FSDP engine "
          "in fp64 ({norm_dtype}). With clipping on, the clip factor would differ as well.",
          "tests/test_switch.py::test_zero2_and_fsdp_train_the_same_and_report_the_norm_in_other_dtypes", _norm_dtype),
]


def explain(e: Evidence) -> list[tuple[Cause, str]]:
    """The known causes that apply, each with its text filled in."""
    fp32 = ", ".join(n for n, dt in e.before if dt == "fp32" and ".layers." not in n) or "none"
    norms = " vs ".join(str(x) for x in e.both("max_norm"))
    dtypes = " vs ".join(str(x) for x in e.both("norm_dtype"))
    return [(c, c.text.format(fp32=fp32, max_norm=norms, norm_dtype=dtypes)) for c in CAUSES if c.applies(e)]
