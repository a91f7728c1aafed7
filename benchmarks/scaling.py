"""Step time, tokens/s and MFU vs model size and ranks, both backends, into one CSV.

    python benchmarks/scaling.py --models tiny small medium --world-sizes 2 --out runs/scaling_size.csv
    python benchmarks/scaling.py --models small --world-sizes 1 2 4 --out runs/scaling_ranks.csv

Every point is a real ``helpers.train`` job (FSDP FULL_SHARD next to DeepSpeed
ZeRO-3, run back to back so a slow spell on a shared machine hits both); its
run directory stays under ``--runs``, and the CSV holds one row per job, read
from the run's ``summary.json`` (``helpers.nb.results``), which is what
notebooks/17_scaling plots. ``--dtype bf16`` is the aligned pair of
notebook 00 (fsdp/full_shard.yaml, deepspeed/zero3.yaml); ``fp32`` (the default) the
plain fp32 pair, much faster on CPUs without bf16 instructions. Not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from helpers.nb.results import load_run  # noqa: E402

CONFIGS = {  # (backend, dtype) -> config + extra flags (as benchmarks/overhead.py)
    ("fsdp", "bf16"): ["launch_configs/fsdp/full_shard.yaml"],
    ("deepspeed", "bf16"): ["launch_configs/deepspeed/zero3.yaml"],
    ("fsdp", "fp32"): ["launch_configs/fsdp/full_shard_low_precision.yaml", "--model-dtype", "fp32"],
    ("deepspeed", "fp32"): ["launch_configs/deepspeed/zero3_fp32.yaml"],
}
COLUMNS = ["backend", "dtype", "model", "world_size", "num_params", "flops_per_token", "tokens_per_step",
           "step_time_s", "tokens_per_s_per_rank", "tokens_per_s", "peak_flops", "mfu", "final_loss", "run"]


def row(run, dtype: str) -> dict:
    s = run.summary
    return {"backend": s["backend"], "dtype": dtype, "model": s["model"], "world_size": s["world_size"],
            "num_params": s["num_params"], "flops_per_token": s["flops_per_token"],
            "tokens_per_step": s["tokens_per_step"], "step_time_s": s["step_time_s"],
            "tokens_per_s_per_rank": s["tokens_per_s_per_rank"],
            "tokens_per_s": s["tokens_per_s_per_rank"] * s["world_size"], "peak_flops": s["peak_flops"],
            "mfu": s["mfu"], "final_loss": s["final_loss"], "run": os.path.relpath(run.path, REPO)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small", "medium"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("--steps", type=int, default=6, help="the first 2 are warm-up, left out of the medians")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--runs", help="directory for the run directories (default: next to --out)")
    a = ap.parse_args()
    import pandas as pd

    out = Path(a.out).resolve()
    runs = Path(a.runs).resolve() if a.runs else out.with_suffix("")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning")}
    rows = []
    for model in a.models:
        for ws in a.world_sizes:
            for backend in ("fsdp", "deepspeed"):
                config, *extra = CONFIGS[backend, a.dtype]
                run_dir = runs / f"{backend}_{a.dtype}_{model}_{ws}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}",
                       "-m", "helpers.train", "--config", config, "--out", str(run_dir), "--model", model,
                       "--steps", str(a.steps), "--micro-batch", str(a.micro_batch), "--seq-len", str(a.seq_len),
                       *extra]
                proc = subprocess.run(cmd, cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, text=True)
                if proc.returncode != 0:
                    print(f"error: {backend} {model} on {ws} ranks failed (exit {proc.returncode}); "
                          f"see {run_dir}/log.txt", file=sys.stderr)
                    return 1
                r = row(load_run(run_dir), a.dtype)
                rows.append(r)
                print(f"{backend:9s} {model:6s} {ws} ranks  step {r['step_time_s'] * 1e3:8.1f} ms  "
                      f"{r['tokens_per_s_per_rank']:8.0f} tokens/s/rank  MFU {r['mfu']:.3f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=COLUMNS).to_csv(out, index=False)
    print(f"wrote {os.path.relpath(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
