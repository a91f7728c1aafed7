"""Where do two runs part? ``python -m helpers.compare RUN_A RUN_B``

Reads two run directories (``--out`` of two jobs) and compares, step by step, the loss and
the gradient norm bit for bit. Exit status 0: identical at every step; 1: they differ, and
the first line says where::

    first difference: step 1 loss 6.144670963287354 vs 6.144979476928711, grad_norm ... vs ...

When both jobs ran with ``--trace-tensors`` (helpers.job.observe.tensor_trace) it also names the first
tensor that differs: the earliest step, then the earliest stage of that step (weight, local
gradient, reduced gradient, update), then the first parameter in model order, with its dtype
on each side. When both ran with ``--trace-activations`` (helpers.job.observe.activation_trace) it
names the first module whose output (forward) or output gradient (backward) differs. A
difference in the tensors usually shows up a step before the losses do (an update at step K
changes the loss of step K+1). Exit status 2: bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from helpers.core.metrics import ACTIVATION_FILE, STAGES, TRACE_FILE


class CompareError(ValueError):
    """A run directory compare cannot read; the message names it and why."""


@dataclass
class TensorDiff:
    step: int
    stage: str
    param: str
    dtype_a: str | None
    dtype_b: str | None
    differing: int  # parameters that differ at this step and stage
    total: int
    changed_a: int | None = None  # update stage: elements the step changed, each side
    changed_b: int | None = None

    def line(self) -> str:
        more = f" (and {self.differing - 1} more of {self.total} parameters)" if self.differing > 1 else ""
        changed = (f"; elements changed {self.changed_a} vs {self.changed_b}"
                   if self.stage == "update" else "")
        return (f"first differing tensor: step {self.step} {self.stage} of {self.param}: "
                f"{self.dtype_a} vs {self.dtype_b}{more}{changed}\n  {HINTS.get(self.stage, '')}").rstrip()


@dataclass
class ActivationDiff:
    step: int
    rank: int
    micro: int
    phase: str  # "forward": the module's output; "backward": the gradient that reached its output
    module: str
    cls: str  # the module's class
    dtype_a: str
    dtype_b: str
    biased: bool = False  # the module has a bias parameter

    def line(self) -> str:
        what = "output" if self.phase == "forward" else "output gradient"
        return (f"first differing module: step {self.step} rank {self.rank} micro-batch {self.micro}, {self.phase}: "
                f"{what} of {self.module} ({self.cls}{', with a bias' if self.biased else ''}): {self.dtype_a} vs "
                f"{self.dtype_b}")


HINTS = {  # what a first difference at each stage says about where the two runs part
    "weight": "the weights differ before any gradient: a different start (seed, loading, dtype rounding)",
    "grad_local": "same weights, different local gradients: the forward/backward arithmetic differs "
                  "(kernels, dtypes, a patched op) or the data does",
    "grad_reduced": "same local gradients, different reduced ones: the reduction (dtype, order, averaging) "
                    "or clipping differs",
    "update": "same gradients, different updates: the optimizer step differs (its dtype, hyperparameters, "
              "or a bf16 weight that rounds a small update away)",
}


@dataclass
class Comparison:
    a: Path
    b: Path
    steps: int  # steps compared (present in both)
    first_step: int | None = None  # first step whose loss or grad norm differs (None: identical)
    values: dict = field(default_factory=dict)  # {"loss": (a, b), "grad_norm": (a, b)} at first_step
    length: tuple[int, int] | None = None  # (steps in A, steps in B) when they differ
    tensor: TensorDiff | None = None  # first differing tensor, when both runs have traces
    traced: tuple[bool, bool] = (False, False)
    untraced: int = 0  # parameters without a gradient (a frozen base): their tensors are not in the traces
    losses_equal: bool = True  # every loss of the steps both logged is the same (grad norms aside)
    module: ActivationDiff | None = None  # first differing module output, when both runs traced activations
    activations: tuple[bool, bool] = (False, False)
    coverage: tuple[int, int, int] = (0, 0, 0)  # activation records compared (forward, backward), on one side only

    @property
    def identical(self) -> bool:
        return self.first_step is None and self.length is None

    def report(self) -> str:
        lines = []
        if self.first_step is not None:
            vals = ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in self.values.items())
            lines.append(f"first difference: step {self.first_step} {vals}")
        elif self.length is not None:
            lines.append(f"first difference: step {self.steps}: A ran {self.length[0]} steps, B {self.length[1]}")
        else:
            lines.append(f"identical: {self.steps} steps, losses and grad norms bit for bit")
        if self.tensor is not None:
            lines.append(self.tensor.line())
        elif all(self.traced):
            lines.append("tensor traces: every weight, gradient and update identical" if not self.untraced else
                         f"tensor traces: every traced weight, gradient and update identical ({self.untraced} "
                         "parameters without a gradient are not traced)")
        else:
            missing = " and ".join(str(p) for p, t in zip((self.a, self.b), self.traced, strict=True) if not t)
            lines.append(f"no tensor trace in {missing}: run both jobs with --trace-tensors to name the tensor")
        if self.module is not None:
            lines.append(self.module.line())
        elif all(self.activations):
            n_fwd, n_bwd, one_side = self.coverage
            only = f"; {one_side} only on one side" if one_side else ""
            lines.append(f"activation traces: every module output and output gradient identical ({n_fwd} forward and "
                         f"{n_bwd} backward records compared{only})")
        elif not self.identical:
            lines.append("no activation trace in both runs: run them with --trace-activations to name the module")
        return "\n".join(lines)


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y


def _read_jsonl(path: Path, what: str) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: cannot read {what}: {e}") from None


def _steps(run: Path) -> dict[int, dict]:
    if not run.is_dir():
        raise CompareError(f"{run}: no such run directory")
    summary = run / "summary.json"
    if not summary.is_file():
        raise CompareError(f"{run}: not a finished run directory (no summary.json)")
    try:
        status = json.loads(summary.read_text()).get("status")
    except json.JSONDecodeError as e:
        raise CompareError(f"{summary}: not JSON: {e}") from None
    if status != "completed":
        raise CompareError(f"{run}: status = {status!r} in summary.json; compare reads completed runs")
    rows = _read_jsonl(run / "metrics.jsonl", "metrics.jsonl")
    if not rows:
        raise CompareError(f"{run}: metrics.jsonl has no steps")
    return {r["step"]: r for r in rows}


def first_tensor_diff(a: Path, b: Path, steps: list[int]) -> TensorDiff | None:
    """The first (step, stage, parameter) whose fingerprint differs in the two traces."""
    ta = {r["step"]: r["params"] for r in _read_jsonl(a / TRACE_FILE, TRACE_FILE)}
    tb = {r["step"]: r["params"] for r in _read_jsonl(b / TRACE_FILE, TRACE_FILE)}
    for step in steps:
        pa, pb = ta.get(step), tb.get(step)
        if pa is None or pb is None:
            continue
        if list(pa) != list(pb):
            only = sorted(set(pa) ^ set(pb))
            name = only[0] if only else next(x for x, y in zip(pa, pb, strict=False) if x != y)
            side = "A" if name in pa else "B"
            return TensorDiff(step, f"parameter set (only in {side})", name, None, None, len(only) or 1, len(pa))
        for stage in STAGES:
            diff = [n for n in pa if pa[n][stage][0] != pb[n][stage][0]]
            if diff:
                ra, rb = pa[diff[0]][stage], pb[diff[0]][stage]
                ca, cb = (ra[2], rb[2]) if stage == "update" else (None, None)
                return TensorDiff(step, stage, diff[0], ra[1], rb[1], len(diff), len(pa), ca, cb)
    return None


def first_activation_diff(a: Path, b: Path, steps: list[int], coverage: list | None = None) -> ActivationDiff | None:
    """The first (step, rank, micro-batch, phase, module) whose output fingerprint differs in the two traces:
    the forward before the backward, modules in the order the traces met them. ``coverage``, when given, gets
    [forward, backward, one-sided] record counts of what was compared (a record one side lacks is not)."""
    coverage = coverage if coverage is not None else [0, 0, 0]
    ra, rb = _read_jsonl(a / ACTIVATION_FILE, ACTIVATION_FILE), _read_jsonl(b / ACTIVATION_FILE, ACTIVATION_FILE)
    classes = ra[0].get("modules", {}) if ra else {}
    biased = set(ra[0].get("biased", [])) if ra else set()
    ta = {r["step"]: r["ranks"] for r in ra if "step" in r}
    tb = {r["step"]: r["ranks"] for r in rb if "step" in r}
    for step in steps:
        if step not in ta or step not in tb:
            continue
        for rank, (ma, mb) in enumerate(zip(ta[step], tb[step], strict=False)):
            for micro, (xa, xb) in enumerate(zip(ma, mb, strict=False)):
                for k, phase in enumerate(("forward", "backward")):
                    fb = {n: (fp, dt) for n, fp, dt in xb[phase]}
                    shared = sum(n in fb for n, _, _ in xa[phase])
                    coverage[k] += shared
                    coverage[2] += len(xa[phase]) + len(fb) - 2 * shared
                    for name, fp, dt in xa[phase]:
                        if name in fb and fb[name][0] != fp:
                            base = name.split("#")[0]
                            return ActivationDiff(step, rank, micro, phase, name, classes.get(base, "?"), dt,
                                                  fb[name][1], base in biased)
    return None


def compare(a: str | Path, b: str | Path) -> Comparison:
    """Compare two run directories (raises CompareError on bad input)."""
    a, b = Path(a), Path(b)
    sa, sb = _steps(a), _steps(b)
    common = sorted(set(sa) & set(sb))
    if not common:
        raise CompareError(f"{a} (steps {min(sa)}..{max(sa)}) and {b} (steps {min(sb)}..{max(sb)}) share no step")
    out = Comparison(a, b, len(common))
    out.losses_equal = len(sa) == len(sb) and all(_same(sa[s]["loss"], sb[s]["loss"]) for s in common)
    for step in common:
        ra, rb = sa[step], sb[step]
        if not all(_same(ra[k], rb[k]) for k in ("loss", "grad_norm")):
            out.first_step = step
            out.values = {k: (ra[k], rb[k]) for k in ("loss", "grad_norm")}
            break
    if out.first_step is None and len(sa) != len(sb):
        out.length = (len(sa), len(sb))
    out.traced = ((a / TRACE_FILE).is_file(), (b / TRACE_FILE).is_file())
    if all(out.traced):
        out.tensor = first_tensor_diff(a, b, common)
        first = _read_jsonl(a / TRACE_FILE, TRACE_FILE)[0]["params"]
        out.untraced = sum(rec["weight"][1] is None for rec in first.values())
    out.activations = ((a / ACTIVATION_FILE).is_file(), (b / ACTIVATION_FILE).is_file())
    if all(out.activations):
        counts = [0, 0, 0]
        out.module = first_activation_diff(a, b, common, counts)
        out.coverage = tuple(counts)
    return out


def differing(a: str | Path, b: str | Path, step: int, stage: str) -> list[str]:
    """The parameters whose ``stage`` fingerprint differs at ``step`` in the two runs' traces, in order."""
    ta = {r["step"]: r["params"] for r in _read_jsonl(Path(a) / TRACE_FILE, TRACE_FILE)}[step]
    tb = {r["step"]: r["params"] for r in _read_jsonl(Path(b) / TRACE_FILE, TRACE_FILE)}[step]
    return [n for n in ta if n in tb and ta[n][stage][0] != tb[n][stage][0]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.error = lambda msg: ap.exit(2, f"error: {msg} (see python -m helpers.compare --help)\n")
    args = ap.parse_args(argv)
    try:
        result = compare(args.run_a, args.run_b)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
