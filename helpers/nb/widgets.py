"""Optional ipywidgets panels for the notebooks: rerun an experiment, estimate memory.

    panel = widgets.ControlPanel("00", {"FSDP FULL_SHARD": "launch_configs/fsdp/full_shard.yaml", ...},
                                 args="--model tiny --steps $STEPS", plot=widgets.plot_losses)
    panel  # shows the controls; nothing runs until "Run" is clicked (or panel.run() is called)

``ControlPanel``: which configs (backend modes), world size, model preset and
learning rate, each defaulting to what the notebook ran; "Run" launches the same
``torchrun -m helpers.train`` jobs the notebook's ``%%bash`` cells do (the same
arguments until a control is changed), one after the other, into
``notebooks/runs/panel_<notebook>_<n>/`` (its own directories, never the
notebook's), with a progress bar that follows each job's ``metrics.jsonl``,
then redraws the side-by-side plot from the run directories.

``MemoryEstimator``: parameter count, world size, FSDP strategy / ZeRO stage,
offload and dtype -> the per-rank bytes ``helpers.core.mapping.theory_bytes``
predicts for both backends, next to the measured bars of notebook 01's runs
(``notebooks/runs/01_<mode>_<ranks>``) when they exist.

Building a panel never launches anything, so nbval can execute the cells.
"""

from __future__ import annotations

import base64
import io
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ipywidgets as w
import matplotlib.pyplot as plt

from helpers import nb
from helpers.core import mapping
from helpers.core.config import TrainOptions
from helpers.nb import results

RUNS: Path | None = None  # None: notebooks/runs under nb.ROOT (the repo, or the working copy)


def runs_dir() -> Path:
    return RUNS if RUNS is not None else nb.ROOT / "notebooks" / "runs"


# --------------------------------------------------------------------------- plots the panels can redraw


def plot_losses(runs: list[results.Run], fig) -> None:
    """Loss curves side by side with |difference| to the first run."""
    from helpers.nb import plots

    left, right = fig.subplots(1, 2)
    plots.loss_curves(runs, ax=left)
    if len(runs) > 1:
        styles = plots.run_styles([r.backend for r in runs])
        for r, kw in zip(runs[1:], styles[1:], strict=True):
            diff = (r.metrics["loss"] - runs[0].metrics["loss"]).abs()
            right.plot(r.metrics["step"], diff, label=r.label, **kw)
        right.set(xlabel="step", ylabel="|difference|", title=f"|loss - {runs[0].label}|")
        right.legend()
    else:
        right.set_axis_off()


def plot_memory(runs: list[results.Run], fig) -> None:
    """What rank 0 holds per run, next to the loss curves."""
    from helpers.nb import plots

    left, right = fig.subplots(1, 2)
    plots.run_memory_bars(runs, labels=[r.summary["mode_key"] for r in runs], ax=left)
    left.tick_params(axis="x", rotation=30)
    plots.loss_curves(runs, ax=right)


def plot_loading(runs: list[results.Run], fig) -> None:
    """Each run's peak memory while loading the model (RssAnon above the start), per rank (notebook 05)."""
    from helpers.nb import plots

    ax = fig.subplots()
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        ld = r.summary["loading"]
        peaks = [x["peak_rss_anon_bytes"] / 2**20 for x in ld["ranks"]]
        ax.bar([k + i * width for k in range(len(peaks))], peaks, width, label=ld["method"],
               color=plots.COLORS[r.backend], hatch="//" if ld["method"] == "naive" else None, edgecolor="white")
    ax.set(xlabel="rank", ylabel="peak while loading, MiB", title="loading: peak per rank")
    ax.legend()


def plot_locations(runs: list[results.Run], fig) -> None:
    """Where rank 0's state lives (device, host, disk), one bar per run (notebook 03)."""
    from helpers.job.observe.offload import LOCATIONS
    from helpers.nb import plots

    plots.location_bars(runs, labels=[r.summary["mode_key"] for r in runs], axes=fig.subplots(1, len(LOCATIONS)))


def plot_throughput(runs: list[results.Run], fig) -> None:
    """Tokens/s per rank and MFU per run (notebook 07)."""
    from helpers.nb import plots

    left, right = fig.subplots(1, 2)
    labels, backends = [r.label for r in runs], [r.backend for r in runs]
    plots.backend_bars(left, labels, [r.summary["tokens_per_s_per_rank"] for r in runs], backends)
    left.set(ylabel="tokens/s per rank", title="throughput (median step)")
    plots.backend_bars(right, labels, [100 * r.summary["mfu"] if r.summary["mfu"] is not None else None
                                       for r in runs], backends, missing="no MFU\n(peak unknown)")
    right.set(ylabel="MFU (%)", title="model FLOPs utilization")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)


# --------------------------------------------------------------------------- control panel


LR_CHOICES = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]  # exact values: nothing snaps


class ControlPanel(w.VBox):
    """Rerun a notebook's experiment with other settings and redraw its figure.

    ``args`` is the notebook's own argument string, written as in its ``%%bash`` cell
    (``"$ARGS --steps $STEPS"``) and expanded from the environment the notebook set. With the
    controls untouched, ``command`` is the notebook's command token for token (only ``--out``
    differs); a changed control replaces or adds its one flag.
    """

    def __init__(self, notebook: str, configs: dict[str, str], args: str = "--model tiny --steps 20",
                 plot: Callable = plot_losses, selected: list[str] | None = None, ranks: int | None = None):
        self.notebook, self.configs, self.plot_fn, self.args = notebook, configs, plot, args
        self.base = shlex.split(os.path.expandvars(args))
        defaults = TrainOptions()
        self.steps = int(_flag(self.base, "--steps") or defaults.steps)
        self.model_default = _flag(self.base, "--model") or defaults.model
        lr = _flag(self.base, "--lr")
        self.lr_default = float(lr) if lr is not None else defaults.lr
        self.modes = w.SelectMultiple(options=list(configs), value=tuple(selected or list(configs)[:2]),
                                      description="modes", rows=min(6, len(configs)))
        self.ranks_default = ranks or nb.nproc()
        sizes = sorted(set(nb.world_sizes([1, 2, 4])) | {self.ranks_default})  # GPU node: up to its GPUs
        self.world = w.Dropdown(options=sizes, value=self.ranks_default, description="ranks")
        models = list(dict.fromkeys([self.model_default, "tiny", "small"]))
        self.model = w.Dropdown(options=models, value=self.model_default, description="model")
        rates = sorted(set(LR_CHOICES) | {self.lr_default})
        self.lr = w.Dropdown(options=[(f"{v:g}", v) for v in rates], value=self.lr_default, description="lr")
        self.button = w.Button(description="Run", button_style="primary", icon="play")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="idle", bar_style="")
        self.status = w.HTML("")
        self.out = w.Output()
        self.button.on_click(lambda _: self.run())
        super().__init__([w.HBox([self.modes, w.VBox([self.world, self.model, self.lr])]),
                          w.HBox([self.button, self.progress]), self.status, self.out])

    def __repr__(self) -> str:  # what a saved notebook shows before the cell has run in this session
        return f"(control panel of notebook {self.notebook}: run this cell to show it)"

    def jobs(self) -> list[tuple[str, str, Path]]:
        """(label, config, run dir) for the current selection; refuses what cannot run, with a reason."""
        out = []
        for i, label in enumerate(self.modes.value):
            cfg = self.configs[label]
            need = next((m.min_world_size for m in mapping.MODES.values() if m.config == cfg), 1)
            if self.world.value < need:
                raise ValueError(f"{label} needs {need} ranks; ranks = {self.world.value}")
            out.append((label, cfg, runs_dir() / f"panel_{self.notebook}_{i}"))
        if not out:
            raise ValueError("select at least one mode")
        return out

    def train_args(self) -> list[str]:
        """The notebook's arguments with the changed controls applied (``--config``/``--out`` aside)."""
        toks = list(self.base)
        if self.model.value != self.model_default:
            _set_flag(toks, "--model", self.model.value)
        if self.lr.value != self.lr_default:
            _set_flag(toks, "--lr", repr(self.lr.value))
        return toks

    def command(self, cfg: str, run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(self.world.value), "-m", "helpers.train", "--config", cfg,
                "--out", str(run_dir), *self.train_args()]

    def run(self) -> list[results.Run]:
        """Launch the jobs one by one (progress follows metrics.jsonl), then redraw. Returns the runs."""
        try:
            jobs = self.jobs()
        except ValueError as e:
            self.status.value = f"<b>not run:</b> {e}"
            return []
        self.button.disabled = True
        self.progress.max, self.progress.value, self.progress.bar_style = len(jobs) * self.steps, 0, "info"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
        try:
            for n, (label, cfg, run_dir) in enumerate(jobs):
                self.progress.description = f"{n + 1}/{len(jobs)}"
                self.status.value = f"running <code>{label}</code> -> {run_dir}"
                proc = subprocess.Popen(self.command(cfg, run_dir), cwd=nb.ROOT, env=env, text=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                while proc.poll() is None:
                    self.progress.value = n * self.steps + _steps_done(run_dir)
                    time.sleep(0.5)
                err = proc.stderr.read()
                if proc.returncode != 0:
                    line = next((x for x in err.splitlines() if x.startswith("error")), err.strip()[-300:])
                    self.progress.bar_style = "danger"
                    self.status.value = f"<b>{label} failed</b> (exit {proc.returncode}): {line}"
                    return []
            self.progress.value, self.progress.bar_style = self.progress.max, "success"
            runs = results.load_runs(*[d for _, _, d in jobs])
            self.redraw(runs)
            self.status.value = "done: " + "; ".join(
                f"{r.label}: loss {r.summary['losses'][0]:.3f} -> {r.summary['final_loss']:.3f}" for r in runs)
            return runs
        finally:
            self.button.disabled = False

    def redraw(self, runs: list[results.Run]) -> None:
        fig = plt.figure(figsize=(11, 4))
        self.plot_fn(runs, fig)
        _show(self.out, fig)


def _show(out: w.Output, fig) -> None:
    """Replace what ``out`` shows with ``fig`` as a PNG (one output, in a kernel or not), then close it."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    out.outputs = ({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": "<figure>"}},)


def _flag(toks: list[str], name: str) -> str | None:
    return toks[toks.index(name) + 1] if name in toks[:-1] else None


def _set_flag(toks: list[str], name: str, value: str) -> None:
    if name in toks[:-1]:
        toks[toks.index(name) + 1] = value
    else:
        toks += [name, value]


def _steps_done(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        return 0


# --------------------------------------------------------------------------- memory estimator

PAIRS = {  # label -> (FSDP mode, DeepSpeed mode), from mapping.COUNTERPARTS
    f"{mapping.MODES[f].fsdp1} / {mapping.MODES[d].zero}": (f, d) for f, d, _ in mapping.COUNTERPARTS
}
DTYPES = {  # label -> (mixed_precision, bytes per element of the model dtype)
    "bf16 mixed (fp32 shards / master)": ("bf16", 2),
    "fp32": ("no", 4),
    "bf16 only (FSDP low precision)": ("no", 2),
}


def estimate(num_params: int, world_size: int, pair: str, offload: bool, dtype: str) -> dict[str, dict]:
    """Predicted per-rank bytes per category, on the device and on the host, for both backends: the state
    part of ``helpers.estimate`` (the same ZeRO model and offload rules) from a parameter count alone."""
    from helpers.core.footprint import offloaded, split_state

    f_key, d_key = PAIRS[pair]
    mp, model_bytes = DTYPES[dtype]
    out = {}
    for key in (f_key, d_key):
        mode = mapping.MODES[key]
        group = world_size // 2 if mode.min_world_size > 1 else None
        ds_mp = "bf16" if mode.backend == "deepspeed" and dtype.startswith("bf16") else mp
        theory = mapping.theory_bytes(mode, num_params, world_size, ds_mp, shard_group=group,
                                      secondary_group=group if mode.backend == "deepspeed" else None,
                                      model_dtype_bytes=model_bytes)
        device, host, _ = split_state(theory, offloaded(key, offload=offload))  # as python -m helpers.estimate
        out[key] = {"device": device, "host": host}
    return out


class MemoryEstimator(w.VBox):
    """Predicted per-rank bytes for both backends; measured bars from notebook 01 beside them."""

    def __init__(self, num_params: int = 7_000_000_000):
        self.params = w.FloatLogSlider(value=num_params, base=10, min=5, max=12, step=0.05,
                                       description="params", readout_format=".2s")
        self.world = w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=8, description="ranks")
        self.pair = w.Dropdown(options=list(PAIRS), value="FULL_SHARD / ZeRO-3", description="mode")
        self.offload = w.Checkbox(value=False, description="offload to CPU")
        self.dtype = w.Dropdown(options=list(DTYPES), value=list(DTYPES)[0], description="dtype")
        self.out = w.Output()
        for c in (self.params, self.world, self.pair, self.offload, self.dtype):
            c.observe(lambda _: self.redraw(), names="value")
        super().__init__([w.HBox([w.VBox([self.params, self.world]), w.VBox([self.pair, self.dtype, self.offload])]),
                          self.out])
        self.redraw()

    def __repr__(self) -> str:
        return "(memory estimator: run this cell to show it)"

    def measured(self) -> list[results.Run]:
        """Notebook 01's runs of this pair at this world size (or at 2 ranks), when they exist."""
        keys = PAIRS[self.pair.value]
        for ws in (self.world.value, 2):
            found = []
            for key in keys:
                try:
                    found.append(results.load_run(runs_dir() / f"01_{key}_{ws}"))
                except results.RunError:
                    pass
            if found:
                return found
        return []

    def redraw(self) -> None:
        from helpers.nb.plots import CATEGORY_COLORS

        est = estimate(int(self.params.value), self.world.value, self.pair.value, self.offload.value,
                       self.dtype.value)
        runs = self.measured()
        fig, axes = plt.subplots(1, 2 if runs else 1, figsize=(11 if runs else 6, 4), squeeze=False)
        ax = axes[0][0]
        labels = [f"{mapping.MODES[k].backend}\n{k}" for k in est]
        _stack(ax, labels, [e["device"] for e in est.values()], 2**30, CATEGORY_COLORS)
        host = [sum(e["host"].values()) / 2**30 for e in est.values()]
        ax.set(ylabel="GiB per rank on the device",
               title=f"predicted: {self.params.value / 1e9:.2f}B params, {self.world.value} ranks")
        for i, h in enumerate(host):
            if h:
                ax.annotate(f"+{h:.1f} GiB on host", (i, 0), xytext=(0, 4), textcoords="offset points",
                            ha="center", fontsize=9)
        ax.legend(fontsize=8)
        if runs:
            ax2 = axes[0][1]
            labels, bars = [], []
            for r in runs:
                s = r.summary
                labels += [f"{s['mode_key']}\nmeasured", f"{s['mode_key']}\npredicted"]
                bars += [s["memory_bytes"][0], s["memory_theory_bytes"]]
            _stack(ax2, labels, bars, 2**20, CATEGORY_COLORS)
            ax2.set(ylabel="MiB on rank 0", title=f"notebook 01: {runs[0].summary['num_params'] / 1e6:.2f}M params, "
                                                  f"{runs[0].summary['world_size']} ranks")
        _show(self.out, fig)


def _stack(ax, labels, values: list[dict], unit: float, colors) -> None:
    bottom = [0.0] * len(labels)
    for cat in mapping.CATEGORIES:
        v = [d.get(cat, 0) / unit for d in values]
        ax.bar(labels, v, bottom=bottom, label=cat, color=colors[cat])
        bottom = [b + x for b, x in zip(bottom, v, strict=True)]
