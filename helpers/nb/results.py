"""Load run directories (written by helpers.train) for tables and plots.

Plots and check cells read runs through here, never stdout. A run that
failed, or that has no summary (still running, or killed), is refused with
a message naming it, so a figure never shows stale or partial data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


class RunError(RuntimeError):
    """A run directory that cannot be used; the message says which and why."""


@dataclass
class Run:
    name: str
    path: Path
    config: dict
    summary: dict
    metrics: pd.DataFrame  # one row per step, columns helpers.core.metrics.STEP_KEYS

    @property
    def backend(self) -> str:
        return self.summary["backend"]

    @property
    def label(self) -> str:
        s = self.summary
        return f"{s['backend']} {s['mode']} ({s['world_size']} ranks)"


def load_run(path: str | Path) -> Run:
    p = Path(path)
    if not p.is_dir():
        raise RunError(f"run {p}: no such run directory (did its launch cell run?)")
    if not (p / "summary.json").is_file():
        raise RunError(f"run {p} is incomplete: no summary.json (still running, or killed); rerun its cell")
    summary = json.loads((p / "summary.json").read_text())
    if summary.get("status") != "completed":
        who = f" on rank {summary['failed_rank']}" if summary.get("failed_rank") is not None else ""
        raise RunError(f"run {p} failed{who}: {summary.get('reason')}; see {p / 'log.txt'}; rerun its cell")
    config = json.loads((p / "config.json").read_text())
    lines = (p / "metrics.jsonl").read_text().splitlines()
    metrics = pd.DataFrame([json.loads(line) for line in lines if line.strip()])
    if len(metrics) != summary["steps"]:
        raise RunError(f"run {p}: metrics.jsonl has {len(metrics)} steps, summary says {summary['steps']}")
    return Run(p.name, p, config, summary, metrics)


def load_runs(*paths: str | Path) -> list[Run]:
    return [load_run(p) for p in paths]


def summary_table(runs: list[Run], keys=("backend", "mode", "world_size", "num_params", "final_loss",
                                          "step_time_s", "tokens_per_s_per_rank")) -> pd.DataFrame:
    return pd.DataFrame([{k: r.summary.get(k) for k in keys} for r in runs], index=[r.name for r in runs])


def memory_table(runs: list[Run]) -> pd.DataFrame:
    """Long table: one row per (run, rank, category) with measured and theory bytes."""
    rows = []
    for r in runs:
        s = r.summary
        for rank, measured in enumerate(s["memory_bytes"]):
            for cat, value in measured.items():
                rows.append({"run": r.name, "backend": s["backend"], "mode": s["mode_key"],
                             "world_size": s["world_size"], "rank": rank, "category": cat,
                             "measured": value, "theory": s["memory_theory_bytes"][cat]})
    return pd.DataFrame(rows)
