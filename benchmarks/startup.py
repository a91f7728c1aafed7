"""Job start-up against a bare torchrun, both backends (goal: <= 1.5x).

    python benchmarks/startup.py              # 3 rounds, interleaved
    python benchmarks/startup.py --rounds 5 --nproc 2

Per round, in rotating order: a bare 2-rank torchrun whose ranks import torch, join a gloo
group and all-reduce once; the same with the libraries each backend's job cannot start without
imported first (the "floor": FSDP2 and transformers' Llama; DeepSpeed and transformers' Llama);
and a 1-step `tiny` job of `helpers.train` per backend. Prints the median wall time of each, the
ratio job / bare (the goal) and job / floor (what the harness adds to its libraries' imports), with
the spread over rounds. Not a test: run it on an idle box.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BARE = ("import os, torch, torch.distributed as d; d.init_process_group('gloo'); "
        "t = torch.ones(1); d.all_reduce(t); d.destroy_process_group()")
LIBS = {"fsdp": "import torch.distributed.fsdp, transformers.models.llama.modeling_llama; ",
        "deepspeed": "import deepspeed, transformers.models.llama.modeling_llama; "}
CONFIGS = {"fsdp": "launch_configs/fsdp/full_shard.yaml", "deepspeed": "launch_configs/deepspeed/zero3.yaml"}


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd[:8])} ... failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning", "GUIDE_PROGRESS": "0"}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    names = ["bare", *(f"floor_{b}" for b in CONFIGS), *CONFIGS]
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if name == "bare":
                    cmd = [*run, "--no-python", sys.executable, "-c", BARE]
                elif name.startswith("floor_"):
                    cmd = [*run, "--no-python", sys.executable, "-c", LIBS[name[6:]] + BARE]
                else:
                    cmd = [*run, "-m", "helpers.train", "--config", CONFIGS[name], "--out",
                           str(Path(tmp) / f"{name}_{r}"), "--model", "tiny", "--steps", "1"]
                times[name].append(timed(cmd, env))
                print(f"round {r + 1}: {name:<9} {times[name][-1]:5.1f} s", flush=True)
    bare = statistics.median(times["bare"])
    print(f"\nbare torchrun ({args.nproc} ranks): median {bare:.1f} s  (range {min(times['bare']):.1f}-"
          f"{max(times['bare']):.1f})")
    for b in CONFIGS:
        t, floor = times[b], times[f"floor_{b}"]
        ratios = [x / y for x, y in zip(t, times["bare"], strict=True)]
        over_floor = [x / y for x, y in zip(t, floor, strict=True)]
        print(f"{b:<9} 1-step tiny job: median {statistics.median(t):.1f} s, x{statistics.median(t) / bare:.2f} "
              f"bare (per-round ratios {min(ratios):.2f}-{max(ratios):.2f}; goal <= 1.5)")
        print(f"{'':<9} its floor (bare + {LIBS[b].strip('; ')}): median {statistics.median(floor):.1f} s; "
              f"job / floor x{statistics.median(t) / statistics.median(floor):.2f} (per round "
              f"{min(over_floor):.2f}-{max(over_floor):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
