"""Sentences a notebook says about its own runs, checked where they are said.

A notebook states a result in one line of code, next to the numbers it rests on::

    claim("FSDP offload moves every state to the host", fsdp_host == fsdp_total,
          host_MB=fsdp_host / 1e6, total_MB=fsdp_total / 1e6)

prints ``✓ FSDP offload moves every state to the host  [host_MB=1.2, total_MB=1.2]`` and, when the
condition is false, raises ``ClaimFailed`` with the same sentence and numbers, so the cell (and nbval,
and ``make notebooks``) fails instead of the notebook saying something its own output contradicts.

Timings on a shared CPU are noisy. ``timing`` compares two sets of step times (the steps of a run, or
repeated runs) and says "faster" or "slower" only when their spreads do not overlap; otherwise "within
this machine's noise". A notebook claims a speed difference only through it.

``ran`` checks a sentence that describes the jobs themselves (model, steps, ranks, flags) against what each
run directory recorded; ``reused`` checks that a job ``--reuse`` copied is its source's job; ``in_turn``
checks that jobs ran one after the other, in a given order.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path


class ClaimFailed(AssertionError):
    """A sentence of the notebook no longer holds for the runs it describes."""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def claim(sentence: str, holds: bool, **numbers) -> None:
    """Print ``sentence`` with the numbers it rests on; raise ``ClaimFailed`` when ``holds`` is false."""
    nums = ", ".join(f"{k}={_fmt(v)}" for k, v in numbers.items())
    if not holds:
        raise ClaimFailed(f"this sentence no longer holds: {sentence} [{nums}]")
    print(f"✓ {sentence}" + (f"  [{nums}]" if nums else ""))


_MISSING = object()


def _setting(run, key: str):
    """A run's value for ``key``: its summary, then its config (top level, ``train``, its backend's section)."""
    sources = (run.summary, run.config, run.config.get("train") or {}, run.config.get(run.summary["backend"]) or {})
    for source in sources:
        if key in source:
            return source[key]
    return _MISSING


def ran(sentence: str, runs, **expected) -> None:
    """Claim that every run of ``runs`` ran with ``expected`` (``steps=40, model="tiny"``), read from each
    run's ``summary.json`` and ``config.json``, so a sentence that describes the jobs ("the two jobs train the
    tiny model for 40 steps on 2 ranks") fails when a launch cell changes and the prose does not."""
    runs = list(runs)
    if not runs or not expected:
        raise ValueError("ran: give at least one run and one key=value to check")
    seen, holds = {}, True
    for key, want in expected.items():
        got = [_setting(r, key) for r in runs]
        missing = [r.name for r, g in zip(runs, got, strict=True) if g is _MISSING]
        if missing:
            raise KeyError(f"ran: key {key!r} is in neither summary.json nor config.json of {', '.join(missing)}")
        seen[key] = got[0] if len(set(map(repr, got))) == 1 else dict(zip((r.name for r in runs), got, strict=True))
        holds = holds and all(g == want for g in got)
    claim(sentence, holds, runs=len(runs), **seen)


def reused(sentence: str, runs, source) -> None:
    """Claim that each run of ``runs`` that ``--reuse`` copied is the job in the run directory ``source(run)``
    names: it records that directory in ``reused_from``; the key the asking job computed from its own flags,
    files, ranks and code (``reuse_key``) is the one the source's job recorded; and the copy has the source's
    config (all but ``--out``) and losses. Runs that were not copied ran here; both lists are printed."""
    runs = list(runs)
    copied = [r for r in runs if r.summary.get("reused_from")]

    def same(r) -> bool:
        src = Path(source(r))
        if Path(r.summary["reused_from"]).resolve() != src.resolve():
            return False
        s, c = (json.loads((src / f).read_text()) for f in ("summary.json", "config.json"))
        return ({**r.config, "out": None} == {**c, "out": None} and r.summary.get("reuse_key") == s["job_key"]
                and r.summary["losses"] == s["losses"])

    claim(sentence, all(same(r) for r in copied), reused=[r.name for r in copied],
          ran_here=[r.name for r in runs if r not in copied])


def in_turn(sentence: str, runs) -> None:
    """Claim that ``runs`` ran one after the other in the order given: each started (``started_at``) after the
    previous one had written its summary (its start + ``wall_time_s``)."""
    runs = list(runs)
    starts = [r.summary["started_at"] for r in runs]
    ends = [s + r.summary["wall_time_s"] for s, r in zip(starts, runs, strict=True)]
    claim(sentence, all(b > a for a, b in zip(ends[:-1], starts[1:], strict=True)), order=[r.name for r in runs],
          started_s=[round(s - starts[0], 1) for s in starts])


@dataclass
class Timing:
    """Two sets of times compared by their spread (quartiles), not by one number."""

    name_a: str
    name_b: str
    median_a: float
    median_b: float
    spread_a: tuple[float, float]  # (25th, 75th percentile)
    spread_b: tuple[float, float]
    runs_a: tuple[float, ...] = ()  # each run's median (timing_runs: repeated runs, made in turn)
    runs_b: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        """median a / median b."""
        return self.median_a / self.median_b

    @property
    def verdict(self) -> str:
        """"slower" / "faster" (a against b) when the spreads do not overlap (and, for repeated runs, every run
        of one side is beyond every run of the other), else "within noise"."""
        if self.spread_a[0] > self.spread_b[1] and (not self.runs_a or min(self.runs_a) > max(self.runs_b)):
            return "slower"
        if self.spread_a[1] < self.spread_b[0] and (not self.runs_a or max(self.runs_a) < min(self.runs_b)):
            return "faster"
        return "within noise"

    def measured(self) -> str:
        """The medians, their quartiles and the ratio, without a verdict."""
        return (f"{self.name_a} {self.median_a * 1e3:.0f} ms (quartiles {self.spread_a[0] * 1e3:.0f}-"
                f"{self.spread_a[1] * 1e3:.0f}) vs {self.name_b} {self.median_b * 1e3:.0f} ms "
                f"({self.spread_b[0] * 1e3:.0f}-{self.spread_b[1] * 1e3:.0f}): x{self.ratio:.2f}")

    def __str__(self) -> str:
        said = {"slower": "slower than", "faster": "faster than", "within noise": "within this machine's noise of"}
        runs = ""
        if self.runs_a:
            ms = lambda xs: "/".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
            runs = f"; run medians {ms(self.runs_a)} vs {ms(self.runs_b)} ms"
        return f"{self.measured()}{runs}, {said[self.verdict]} {self.name_b}"


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def timing(name_a: str, a, name_b: str, b) -> Timing:
    """Compare times ``a`` and ``b`` (seconds; e.g. a run's per-step times, first step left out)."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        raise ValueError(f"timing: no times for {name_a if not a else name_b}")
    return Timing(name_a, name_b, statistics.median(a), statistics.median(b), _quartiles(a), _quartiles(b))


def timing_runs(name_a: str, runs_a: list, name_b: str, runs_b: list, skip: int | None = None) -> Timing:
    """Compare repeated runs of a and b, made in turn (a, b, a, b, ...). A machine that drifts during one
    run moves all its steps together, so one run each cannot tell a backend from the drift: the verdict
    needs at least two runs a side, every run of one side beyond every run of the other, and the pooled
    steps' spreads apart."""
    if min(len(runs_a), len(runs_b)) < 2:
        raise ValueError(f"timing_runs: {len(runs_a)} run(s) of {name_a}, {len(runs_b)} of {name_b}: "
                         "needs two or more of each, made in turn")
    per_a, per_b = [step_times(r, skip) for r in runs_a], [step_times(r, skip) for r in runs_b]
    pooled = timing(name_a, [x for xs in per_a for x in xs], name_b, [x for xs in per_b for x in xs])
    pooled.runs_a = tuple(statistics.median(xs) for xs in per_a)
    pooled.runs_b = tuple(statistics.median(xs) for xs in per_b)
    return pooled


def step_times(run, skip: int | None = None) -> list[float]:
    """A run's per-step times (``metrics.jsonl``), the first ``skip`` steps left out: by default the warm-up
    steps the job's own medians leave out (``helpers.core.metrics.WARMUP_STEPS``: start-up, then the probes)."""
    if skip is None:
        from helpers.core.metrics import WARMUP_STEPS

        skip = WARMUP_STEPS
    return [float(x) for x in run.metrics["step_time_s"].iloc[skip:]]
