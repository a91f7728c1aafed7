"""What the harness costs: its step time against minimal hand-written loops, both backends.

    python benchmarks/overhead.py                       # small model, fp32, 2 ranks, 3 rounds
    python benchmarks/overhead.py --model tiny --dtype bf16 --rounds 5

Runs, in one go and alternating (FSDP harness, FSDP minimal, DeepSpeed harness,
DeepSpeed minimal; the order rotates each round, so a slow spell on a shared
machine hits every variant): ``helpers.train`` with the guide's configs, and
``benchmarks/minimal.py`` with the same model, data, batch, optimizer and
precision. Each loop's time per step is wall time from one iteration's end to
the next (the harness: differences of ``elapsed_s`` in ``metrics.jsonl``, so
its probes, logging and bookkeeping between steps count), the first
``WARMUP_STEPS`` left out; per variant, the median over rounds of the per-run
medians. Prints harness / minimal per backend (target <= 1.05). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from helpers.core.metrics import WARMUP_STEPS  # noqa: E402

CONFIGS = {  # (backend, dtype) -> harness config + extra flags
    ("fsdp", "bf16"): ["launch_configs/fsdp/full_shard.yaml"],
    ("deepspeed", "bf16"): ["launch_configs/deepspeed/zero3.yaml"],
    ("fsdp", "fp32"): ["launch_configs/fsdp/full_shard_low_precision.yaml", "--model-dtype", "fp32"],
    ("deepspeed", "fp32"): ["launch_configs/deepspeed/zero3_fp32.yaml"],
}


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    e["GUIDE_PROGRESS"] = "0"
    return e


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_harness(a, backend: str, out: Path) -> tuple[list[float], list[float]]:
    """(loop seconds per step, the harness's own timed step) after warm-up."""
    config, *extra = CONFIGS[backend, a.dtype]
    cmd = [*torchrun(a.nproc), "-m", "helpers.train", "--config", config, "--out", str(out), "--model", a.model,
           "--steps", str(a.steps), "--micro-batch", str(a.micro_batch), "--seq-len", str(a.seq_len), *extra]
    subprocess.run(cmd, cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in recs]
    loop = [b - a_ for a_, b in zip(elapsed, elapsed[1:], strict=False)][WARMUP_STEPS - 1:]
    return loop, [r["step_time_s"] for r in recs][WARMUP_STEPS:]


def run_minimal(a, backend: str, out: Path) -> list[float]:
    cmd = [*torchrun(a.nproc), "benchmarks/minimal.py", "--backend", backend, "--dtype", a.dtype,
           "--model", a.model, "--steps", str(a.steps), "--micro-batch", str(a.micro_batch),
           "--seq-len", str(a.seq_len), "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["loop_s"][WARMUP_STEPS:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32",
                    help="bf16: the aligned pair (slow on CPUs without bf16 units); fp32: plain fp32 pair")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/runs/overhead", help="scratch directory for the runs")
    a = ap.parse_args()
    if a.steps <= WARMUP_STEPS + 1:
        ap.error(f"--steps {a.steps}: need more than {WARMUP_STEPS + 1} (the first {WARMUP_STEPS} are warm-up)")
    base = REPO / a.out
    base.mkdir(parents=True, exist_ok=True)
    variants = [("fsdp", "harness"), ("fsdp", "minimal"), ("deepspeed", "harness"), ("deepspeed", "minimal")]
    med: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    timed: dict[str, list[float]] = {"fsdp": [], "deepspeed": []}
    print(f"{a.model}, {a.dtype}, {a.nproc} ranks, {a.steps} steps x {a.micro_batch} x {a.seq_len} tokens, "
          f"{a.rounds} rounds (median loop time per step, ms)", flush=True)
    for r in range(a.rounds):
        order = variants[r % 4:] + variants[:r % 4]
        for backend, kind in order:
            out = base / f"{backend}_{kind}"
            if kind == "harness":
                loop, step = run_harness(a, backend, out)
                timed[backend].append(statistics.median(step))
            else:
                loop = run_minimal(a, backend, out.with_suffix(".json"))
            med[backend, kind].append(statistics.median(loop))
            print(f"  round {r + 1}  {backend:9s} {kind:7s} {med[backend, kind][-1] * 1e3:9.1f}", flush=True)
    print()
    for backend in ("fsdp", "deepspeed"):
        h, m = statistics.median(med[backend, "harness"]), statistics.median(med[backend, "minimal"])
        t = statistics.median(timed[backend])
        per_round = [x / y for x, y in zip(med[backend, "harness"], med[backend, "minimal"], strict=True)]
        print(f"{backend:9s} harness {h * 1e3:8.1f} ms  minimal {m * 1e3:8.1f} ms  harness/minimal {h / m:.3f} "
              f"(target <= 1.05; per round {', '.join(f'{x:.2f}' for x in per_round)}); "
              f"harness timed step alone {t * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
