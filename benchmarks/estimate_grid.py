"""Predicted vs measured peak tensor memory per rank: ``helpers.estimate`` against real jobs.

    python benchmarks/estimate_grid.py --quick --out runs/estimate_grid.json   # 14 tiny jobs on 2 ranks
    python benchmarks/estimate_grid.py --out runs/estimate_grid.json           # every mode x tiny, small,
                                                                               # medium x 1/2/4 ranks x 2 micro-batches
    python benchmarks/estimate_grid.py --recheck benchmarks/estimate_grid.json # no jobs: stored measurements,
                                                                               # today's estimator

Every row is a real ``helpers.train`` job (3 steps: the peak is read through step 1) next to
``python -m helpers.estimate`` for the same config, model, ranks, micro-batch and sequence length.
The error of a row is its worst rank's ``(predicted - measured) / measured``. DeepSpeed's ZeRO-1/2/3
rows hold a whole ``reduce_bucket_size`` gradient bucket (about 1 GB in bf16 by default) that dwarfs a
small model, so the table also gives the error of everything else (``err w/o buckets``): that column is
the model's real test on those rows. ``largest rank`` compares the largest predicted peak with the
largest measured one: whether the job fits is decided there, and ranks that hold the same state can
measure peaks a gathered unit apart (when each frees a collective's buffer). Writes the rows as JSON
(``--out``: the machine and versions under ``measured_with``, one object per job under ``rows``) and
prints the table, with the worst and median error. ``--reuse`` keeps the run directories of completed
jobs; ``--append`` adds the rows to an existing ``--out`` (a row of the same job replaced), so a grid can
be measured in parts. ``--repeat`` runs every row over 10% on its worst rank a second time
(``measured_repeat``): identical jobs' peaks move by which rank frees a collective's buffer first.
``--scored FILE`` also writes the table as JSON: each row's measured and predicted peak per rank, with
its errors (``helpers.estimate.against``).

``benchmarks/estimate_grid.json`` is such a file, measured on a 2-core CPU (gloo): notebook 18 re-scores
its measurements with the estimator of the day (``helpers.estimate.against``), as ``--recheck`` does.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from helpers import estimate as est  # noqa: E402
from helpers.core.mapping import MODES  # noqa: E402

QUICK = dict(modes=[k for k, m in MODES.items() if m.min_world_size <= 2], models=["tiny"], ranks=[2],
             micro_batches=[2, 8])
FULL = dict(modes=list(MODES), models=["tiny", "small", "medium"], ranks=[1, 2, 4], micro_batches=[2, 8])


def run_job(config: str, out: Path, ranks: int, model: str, micro_batch: int, seq_len: int, reuse: bool,
            peft: str | None = None) -> dict:
    summary = out / "summary.json"
    if reuse and summary.is_file() and json.loads(summary.read_text()).get("status") == "completed":
        return json.loads(summary.read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "helpers.train", "--config", config, "--out", str(out), "--model", model, "--steps", "3",
           "--micro-batch", str(micro_batch), "--seq-len", str(seq_len), *(["--peft", peft] if peft else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(summary.read_text())


def measure(mode: str, model: str, ranks: int, micro_batch: int, seq_len: int, runs: Path, reuse: bool,
            repeat: bool, peft: str | None = None) -> dict:
    """One row of measurements (what ``--out`` stores): the job's peak per rank, and its repeat's."""
    name = f"{mode}_{model}_{ranks}r_b{micro_batch}"
    s = run_job(MODES[mode].config, runs / name, ranks, model, micro_batch, seq_len, reuse, peft)
    row = {"mode": mode, "model": model, "world_size": ranks, "micro_batch": micro_batch, "seq_len": seq_len,
           "measured": s["peak_tensor_bytes"], "measured_state": [sum(m.values()) for m in s["memory_bytes"]],
           "measured_activations": s["activation_bytes_per_sample"] * micro_batch,
           "device": f"{s['device']} ({s['dist_backend']})", "versions": s["versions"],
           **({"peft": peft} if peft else {})}
    if repeat and abs(est.against(row)["error"]) > 0.10:
        again = run_job(MODES[mode].config, runs / f"{name}_repeat", ranks, model, micro_batch, seq_len, reuse, peft)
        row["measured_repeat"] = again["peak_tensor_bytes"]
    return row


def score(row: dict) -> dict:
    """A row of measurements next to today's estimator."""
    return row | est.against(row)


def table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [f"{'mode':14} {'model':7} {'ranks':>5} {'batch':>5} {'measured MiB (rank 0)':>22} "
             f"{'predicted':>10} {'error':>7} {'err w/o buckets':>16} {'largest rank':>13}"]
    for r in rows:
        lines.append(f"{r['mode']:14} {r['model']:7} {r['world_size']:5d} {r['micro_batch']:5d} "
                     f"{r['measured'][0] / mib:22.2f} {r['predicted'][0] / mib:10.2f} {100 * r['error']:6.1f}% "
                     f"{100 * r['error_without_buckets']:15.1f}% {100 * r['error_of_the_largest']:12.1f}%"
                     + (f"   repeated: {100 * r['error_repeat']:.1f}%" if "error_repeat" in r else ""))
    apart = [r for r in rows if abs(r["error"]) > 0.10 >= abs(r["error_of_the_largest"])]
    if apart:
        lines.append(f"over 10% on their worst rank but within 10% on the largest: {len(apart)} rows; their ranks "
                     f"hold the same state and peak apart (which rank frees a collective's buffer first; the "
                     f"estimator gives one value): " + ", ".join(f"{r['mode']} {r['model']} {r['world_size']}r "
                                                                  f"b{r['micro_batch']}" for r in apart))
    for key, name in (("error", "error"), ("error_without_buckets", "error without buckets"),
                      ("error_of_the_largest", "error of the largest rank")):
        errs = [abs(r[key]) for r in rows]
        worst = max(rows, key=lambda r, k=key: abs(r[k]))
        lines.append(f"{name}: worst {100 * max(errs):.1f}% ({worst['mode']} {worst['model']} "
                     f"{worst['world_size']} ranks, micro-batch {worst['micro_batch']}), "
                     f"median {100 * statistics.median(errs):.1f}%, rows {len(rows)}, within 10%: "
                     f"{sum(e <= 0.10 for e in errs)}")
    return "\n".join(lines)


def key(r: dict) -> tuple:
    return r["mode"], r["model"], r["world_size"], r["micro_batch"], r["seq_len"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small subset (default when no grid flag is given "
                    "is the full grid: many jobs, long on a shared 2-core box)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES))
    ap.add_argument("--models", nargs="+")
    ap.add_argument("--ranks", nargs="+", type=int)
    ap.add_argument("--micro-batches", nargs="+", type=int)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--peft", help="a LoRA config: every job fine-tunes it (helpers.train --peft), every estimate "
                    "takes it (benchmarks/estimate_grid_lora.json: --modes full_shard shard_grad_op zero2 zero3 "
                    "--models tiny small --ranks 1 2 --micro-batches 2 --peft launch_configs/peft/lora.json)")
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--runs", help="directory for the run directories (default: next to --out)")
    ap.add_argument("--reuse", action="store_true", help="keep completed run directories instead of rerunning")
    ap.add_argument("--append", action="store_true", help="add the rows to --out's (same job: replaced)")
    ap.add_argument("--repeat", action="store_true", help="run each row over 10%% on its worst rank once more")
    ap.add_argument("--recheck", metavar="JSON", help="no jobs: score this file's measurements with today's "
                    "estimator and print the table")
    ap.add_argument("--scored", metavar="JSON", help="also write the scored rows: measured and predicted peak "
                    "per rank, and the errors")
    a = ap.parse_args()
    if a.recheck:
        doc = json.loads(Path(a.recheck).read_text())
        print(f"measured with: {doc['measured_with']}")
        return report([score(r) for r in doc["rows"]], a.scored)
    if not a.out:
        ap.error("--out is required (or --recheck)")
    grid = dict(QUICK if a.quick else FULL)
    for k in grid:
        grid[k] = getattr(a, k) or grid[k]
    out = Path(a.out).resolve()
    runs = Path(a.runs).resolve() if a.runs else out.parent / (out.stem + "_runs")
    rows = []
    for model in grid["models"]:
        for ranks in grid["ranks"]:
            for mode in grid["modes"]:
                if MODES[mode].min_world_size > ranks:
                    continue
                for b in grid["micro_batches"]:
                    rows.append(measure(mode, model, ranks, b, a.seq_len, runs, a.reuse, a.repeat, a.peft))
                    print(table([score(rows[-1])]).splitlines()[1], flush=True)
    if a.append and out.is_file():
        new = {key(r) for r in rows}
        rows = [r for r in json.loads(out.read_text())["rows"] if key(r) not in new] + rows
    machine = f"{os.cpu_count()} CPU cores ({platform.machine()}), jobs on {rows[-1]['device']}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("{\n" + f' "measured_with": {json.dumps({"machine": machine, "versions": rows[-1]["versions"]})},\n'
                   + ' "rows": [\n' + ",\n".join("  " + json.dumps(r) for r in rows) + "\n ]\n}\n")
    return report([score(r) for r in rows], a.scored)


def report(scored: list[dict], path: str | None) -> int:
    print(table(scored))
    if path:
        Path(path).write_text(json.dumps(scored, indent=1))
        print(f"wrote {path}: measured and predicted peak per rank, with the errors, for {len(scored)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
