"""Side-by-side figures, all drawn from run directories (helpers.results)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .results import Run

COLORS = {"fsdp": "#1f6fb4", "deepspeed": "#d9480f"}
LINES = {"fsdp": dict(lw=2.2, ls="-"), "deepspeed": dict(lw=1.4, ls="--", marker="o", ms=3)}

STYLE = {
    "figure.figsize": (10, 3.6),
    "figure.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "legend.frameon": False,
}


def use_style() -> None:
    """The shared look of every figure in the guide."""
    plt.rcParams.update(STYLE)


def loss_curves(runs: list[Run], ax=None, title: str = "loss per step"):
    """Loss vs step, one line per run, coloured by backend."""
    ax = ax or plt.subplots()[1]
    for r in runs:
        ax.plot(r.metrics["step"], r.metrics["loss"], color=COLORS[r.backend], label=r.label,
                **LINES[r.backend])
    ax.set(xlabel="step", ylabel="causal-LM loss", title=title)
    ax.legend()
    return ax


def loss_difference(a: Run, b: Run, ax=None):
    """|loss_a - loss_b| per step: a flat zero line means bit-identical training."""
    ax = ax or plt.subplots()[1]
    diff = (a.metrics["loss"] - b.metrics["loss"]).abs()
    ax.plot(a.metrics["step"], diff, color="black", marker=".", lw=1)
    ax.set(xlabel="step", ylabel="|difference|", title=f"|{a.backend} - {b.backend}| loss")
    top = float(diff.max())
    ax.set_ylim(-0.05 * (top or 1), (top or 1) * 1.1)
    return ax


def step_times(runs: list[Run], ax=None):
    """Step time per step (ms); the first step includes warm-up."""
    ax = ax or plt.subplots()[1]
    for r in runs:
        ax.plot(r.metrics["step"], r.metrics["step_time_s"] * 1e3, color=COLORS[r.backend],
                label=r.label, **LINES[r.backend])
    ax.set(xlabel="step", ylabel="ms", title="step time")
    ax.legend()
    return ax


def run_curves(runs: list[Run], column: str, labels: list[str] | None = None, ax=None, title: str = "",
               ylabel: str = "", **plot_kw):
    """One metrics.jsonl column vs step, one line per run (FSDP solid, DeepSpeed dashed)."""
    ax = ax or plt.subplots()[1]
    for r, label in zip(runs, labels or [r.label for r in runs], strict=True):
        ls = LINES[r.backend]["ls"]
        ax.plot(r.metrics["step"], r.metrics[column], ls=ls, lw=1.6, label=label, **plot_kw)
    ax.set(xlabel="step", ylabel=ylabel or column, title=title or column)
    ax.legend()
    return ax


def memory_bars(runs: list[Run], labels: list[str] | None = None, ax=None, rank: int = 0):
    """Stacked bars: bytes of params, grads, optimizer states and master copy one rank holds (MB)."""
    from .mapping import CATEGORIES

    ax = ax or plt.subplots()[1]
    labels = labels or [r.label for r in runs]
    bottom = [0.0] * len(runs)
    for cat in CATEGORIES:
        mb = [r.summary["memory_bytes"][rank][cat] / 1e6 for r in runs]
        ax.bar(labels, mb, bottom=bottom, label=cat)
        bottom = [b + m for b, m in zip(bottom, mb, strict=True)]
    ax.set(ylabel="MB", title=f"what rank {rank} holds after backward (helpers.memory)")
    ax.legend()
    return ax
