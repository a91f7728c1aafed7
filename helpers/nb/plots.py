"""Side-by-side figures, all drawn from run directories (helpers.nb.results)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from cycler import cycler

from helpers.nb.results import Run

# The visual language: FSDP is always this blue and DeepSpeed this orange, in every figure. Anything else
# (a mode, a precision, a lane, a category) gets a line style, a hatch or a colour from NEUTRAL, whose hues
# are far from both (tests/test_plots.py checks every palette here and every figure these functions draw).
COLORS = {"fsdp": "#1f6fb4", "deepspeed": "#d9480f"}
LINES = {"fsdp": dict(lw=2.2, ls="-"), "deepspeed": dict(lw=1.4, ls="--", marker="o", ms=3)}
VARIANT_LS = {"fsdp": ["-", "--", ":", "-."], "deepspeed": ["--", ":", "-.", "-"]}  # 2nd, 3rd run of a backend
VARIANT_HATCH = [None, "//", "..", "xx"]
NEUTRAL = ["#2a9d8f", "#8e6bbf", "#6c757d", "#c9b037", "#3d5a40", "#b5838d"]  # teal, purple, grey, ...

STYLE = {
    "figure.figsize": (10, 3.6),
    "figure.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "legend.frameon": False,
    "axes.prop_cycle": cycler(color=NEUTRAL),  # a line drawn without a colour never looks like a backend
}



def use_style() -> None:
    """The shared look of every figure in the guide."""
    plt.rcParams.update(STYLE)


def run_styles(backends: list[str]) -> list[dict]:
    """Line keywords per run: its backend's colour, and a line style of its own where a backend has more
    than one run (the k-th FSDP run gets the k-th FSDP style)."""
    seen: dict[str, int] = {}
    out = []
    for b in backends:
        k = seen[b] = seen.get(b, -1) + 1
        out.append({**LINES[b], "color": COLORS[b], "ls": VARIANT_LS[b][k % len(VARIANT_LS[b])]})
    return out


def backend_bars(ax, labels: list[str], values: list[float | None], backends: list[str], zero: bool = True,
                 missing: str = "out of\nmemory", **bar_kw):
    """One bar per label in its backend's colour, a hatch of its own for a backend's 2nd, 3rd... bar. A
    value None is drawn as missing (an empty outlined bar and the word), never as a 0 bar. zero=False
    starts the axis near the smallest value, so that the differences show (the axis says so)."""
    seen: dict[str, int] = {}
    for i, (v, b) in enumerate(zip(values, backends, strict=True)):
        k = seen[b] = seen.get(b, -1) + 1
        if v is None:
            ax.bar(i, 0, color="none", edgecolor=COLORS[b], hatch="xx", **bar_kw)
            ax.text(i, 0, missing, ha="center", va="bottom", fontsize=8, color=COLORS[b])
            continue
        ax.bar(i, v, color=COLORS[b], hatch=VARIANT_HATCH[k % len(VARIANT_HATCH)], edgecolor="white", **bar_kw)
    ax.set_xticks(range(len(labels)), labels)  # one per value (zip above is strict on values and backends)
    shown = [v for v in values if v is not None]
    if not zero and shown:
        lo, hi = min(shown), max(shown)
        pad = (hi - lo) * 0.15 or abs(hi) * 0.05 or 1
        ax.set_ylim(lo - pad, hi + pad)
        ax.annotate("axis does not start at 0", (0, 1), xycoords="axes fraction", fontsize=7, color="#555",
                    va="bottom")
    return ax


def loss_curves(runs: list[Run], ax=None, title: str = "loss per step"):
    """Loss vs step, one line per run, coloured by backend."""
    ax = ax or plt.subplots()[1]
    for r, kw in zip(runs, run_styles([r.backend for r in runs]), strict=True):
        ax.plot(r.metrics["step"], r.metrics["loss"], label=r.label, **kw)
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
    for r, kw in zip(runs, run_styles([r.backend for r in runs]), strict=True):
        ax.plot(r.metrics["step"], r.metrics["step_time_s"] * 1e3, label=r.label, **kw)
    ax.set(xlabel="step", ylabel="ms", title="step time")
    ax.legend()
    return ax


CATEGORY_COLORS = dict(zip(("params", "grads", "optimizer_states", "master_params"), NEUTRAL, strict=False))


def memory_bars(table, world_size: int, axes=None, rank: int = 0, unit: float = 2**20):
    """Stacked per-rank bytes by category, FSDP modes left, DeepSpeed right, theory as a black tick."""
    import numpy as np

    from helpers.core.mapping import CATEGORIES, MODES

    if axes is None:
        _, axes = plt.subplots(1, 2, sharey=True)
    sub = table[(table.world_size == world_size) & (table["rank"] == rank)]
    for ax, backend in zip(axes, ("fsdp", "deepspeed"), strict=True):
        modes = [k for k, m in MODES.items() if m.backend == backend and k in set(sub["mode"])]
        x, bottom = np.arange(len(modes)), np.zeros(len(modes))
        for cat in CATEGORIES:
            vals = np.array([sub[(sub["mode"] == m) & (sub.category == cat)].measured.sum() / unit
                             for m in modes])
            ax.bar(x, vals, bottom=bottom, color=CATEGORY_COLORS[cat], label=cat, width=0.6)
            bottom += vals
        theory = [sub[sub["mode"] == m].theory.sum() / unit for m in modes]
        ax.scatter(x, theory, marker="_", s=900, color="black", zorder=3, label="ZeRO model")
        ax.set_xticks(x, modes, rotation=20)
        ax.set_title(f"{backend}: bytes held by rank {rank} of {world_size}")
    axes[0].set_ylabel("MiB per rank")
    axes[1].legend(loc="upper right", fontsize=8)
    return axes


def memory_vs_world(table, modes, ax=None, unit: float = 2**20):
    """Per-rank total state vs number of ranks, measured (solid) and theory (dashed)."""
    ax = ax or plt.subplots()[1]
    for mode in modes:
        sub = table[(table["mode"] == mode) & (table["rank"] == 0)]
        g = sub.groupby("world_size")[["measured", "theory"]].sum().sort_index() / unit
        backend = sub.backend.iloc[0]
        # FSDP drawn wide and pale under DeepSpeed: where they hold the same, both stay visible
        style = (dict(color=COLORS[backend], marker="o", lw=5, ms=9, alpha=0.45) if backend == "fsdp"
                 else dict(color=COLORS[backend], marker="s", lw=1.5, ms=4))
        line = "-" if mode in ("full_shard", "zero3") else ":"
        ax.plot(g.index, g.measured, ls=line, label=f"{mode} (measured)", **style)
        ax.plot(g.index, g.theory, ls="--", lw=0.8, color="gray")
    ax.set(xlabel="ranks", ylabel="MiB per rank",
           title="per-rank state vs ranks\n(gray dashes: ZeRO model, hidden where the lines agree)")
    ax.set_xticks(sorted(set(table.world_size)))
    ax.legend(fontsize=8)
    return ax


def run_curves(runs: list[Run], column: str, labels: list[str] | None = None, ax=None, title: str = "",
               ylabel: str = "", **plot_kw):
    """One metrics.jsonl column vs step, one line per run (backend colours; a style per run of a backend)."""
    ax = ax or plt.subplots()[1]
    styles = run_styles([r.backend for r in runs])
    for r, label, kw in zip(runs, labels or [r.label for r in runs], styles, strict=True):
        ax.plot(r.metrics["step"], r.metrics[column], label=label, **{**kw, **plot_kw})
    ax.set(xlabel="step", ylabel=ylabel or column, title=title or column)
    ax.legend()
    return ax


def run_memory_bars(runs: list[Run], labels: list[str] | None = None, ax=None, rank: int = 0):
    """Stacked bars: bytes of params, grads, optimizer states and master copy one rank holds (MB)."""
    from helpers.core.mapping import CATEGORIES

    ax = ax or plt.subplots()[1]
    labels = labels or [r.label for r in runs]
    bottom = [0.0] * len(runs)
    for cat in CATEGORIES:
        mb = [r.summary["memory_bytes"][rank][cat] / 1e6 for r in runs]
        ax.bar(labels, mb, bottom=bottom, label=cat, color=CATEGORY_COLORS[cat])
        bottom = [b + m for b, m in zip(bottom, mb, strict=True)]
    ax.set(ylabel="MB", title=f"what rank {rank} holds after backward (helpers.job.observe.memory)")
    ax.legend()
    return ax


LANE_COLORS = {"compute": NEUTRAL[2], "comm": NEUTRAL[0]}
PHASE_COLORS = {"forward": "#eef6f1", "backward": "#f3eff8", "optimizer_step": "#f4f4f4"}  # pale, hue-less


def timeline(runs: list[Run], labels: list[str] | None = None, step: int | None = None, axes=None):
    """Per-rank lanes of compute and communication from ``--profile`` traces, one panel per run
    (pass FSDP first: it is drawn on top), all on one time axis: ms from the start of the step.

    ``step``: which profiled step (default: the first). Shaded bands: rank 0's forward, backward
    and optimizer step (``guide::*``). Communication = gloo's transfers on its own threads (NCCL
    kernels on a GPU); compute = the training thread's top-level operators (helpers.nb.traces).
    """
    from helpers.nb import traces

    labels = labels or [r.label for r in runs]
    if axes is None:
        _, axes = plt.subplots(len(runs), 1, sharex=True, figsize=(10, 1.2 + 1.5 * len(runs)), squeeze=False,
                               layout="constrained")  # room for each panel's title above the one before
        axes = axes[:, 0]
    for ax, run, label in zip(axes, runs, labels, strict=True):
        ev, ph = traces.events(run), traces.phases(run)
        s = step if step is not None else int(ev.step.min())
        ev, ph = ev[ev.step == s], ph[ph.step == s]
        t0 = ph.start_ms.min() if len(ph) else ev.start_ms.min()
        nranks = int(ev["rank"].max()) + 1
        for _, p in ph[ph["rank"] == 0].iterrows():
            ax.axvspan(p.start_ms - t0, p.end_ms - t0, color=PHASE_COLORS[p.phase], zorder=0)
            ax.text((p.start_ms + p.end_ms) / 2 - t0, 2 * nranks - 0.35, p.phase, ha="center", va="bottom",
                    fontsize=7, color="#555")
        ticks, names = [], []
        for r in range(nranks):
            for i, lane in enumerate(("compute", "comm")):
                y = 2 * (nranks - 1 - r) + (1 - i)
                sub = ev[(ev["rank"] == r) & (ev.lane == lane)]
                bars = list(zip(sub.start_ms - t0, sub.end_ms - sub.start_ms, strict=True))
                ax.broken_barh(bars, (y - 0.35, 0.7), color=LANE_COLORS[lane], linewidth=0)
                ticks.append(y)
                names.append(f"rank {r} {lane}")
        ax.set_yticks(ticks, names, fontsize=8)
        ax.set_ylim(-0.6, 2 * nranks)
        ax.grid(False)
        ax.set_title(f"{label}: step {s}", fontsize=10, loc="left")
    axes[-1].set_xlabel("ms from the start of the step")
    return axes


def collective_bars(table, ax=None):
    """All-gathers and reduce-scatters per step, one group of bars per setting (``traces.collective_table``)."""
    import numpy as np

    ax = ax or plt.subplots()[1]
    x = np.arange(len(table))
    ax.bar(x - 0.2, table["all_gathers"], width=0.4, label="all-gathers", color=NEUTRAL[0])
    ax.bar(x + 0.2, table["reduce_scatters"], width=0.4, label="reduce-scatters", color=NEUTRAL[1])
    ax.set_xticks(x, table.index, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="per step", title="collectives per step (rank 0)")
    ax.legend()
    return ax
def location_bars(runs: list[Run], labels: list[str] | None = None, axes=None, rank: int = 0, unit: float = 1e6):
    """Where one rank's state lives: a panel per location (device, host, disk), a stacked bar per run."""
    from helpers.core.mapping import CATEGORIES
    from helpers.job.observe.offload import LOCATIONS

    if axes is None:
        _, axes = plt.subplots(1, len(LOCATIONS), sharey=True, figsize=(12, 4.4))
    labels = labels or [r.label for r in runs]
    ticks = [lab.replace(" + ", " +\n").replace(", ", ",\n") for lab in labels]  # long run names on two lines
    for ax, where in zip(axes, LOCATIONS, strict=True):
        bottom = [0.0] * len(runs)
        for cat in CATEGORIES:
            mb = [r.summary["memory_location_bytes"][rank][cat][where] / unit for r in runs]
            ax.bar(labels, mb, bottom=bottom, label=cat, color=CATEGORY_COLORS[cat])
            bottom = [b + m for b, m in zip(bottom, mb, strict=True)]
        ax.set_title(where)
        ax.set_xticks(range(len(labels)), ticks, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("MB" if unit == 1e6 else f"x {unit:g} bytes")
    axes[-1].legend(fontsize=8)
    return axes
