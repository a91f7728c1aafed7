"""The family sweep: every model of helpers.core.families trained under one launch config.

``--model PATH/config.json`` accepts any of them (helpers.core.models). Between them they cover
attention and MLP biases, tied embeddings, grouped-query attention, fused projections, q/k
norms and parallel residuals. The sweep trains every family for a few steps under one launch
config, in one process group (a job per family would pay torchrun's and DeepSpeed's start-up
ten times)::

    torchrun --standalone --nproc_per_node 2 -m helpers.families \
        --config launch_configs/deepspeed/zero3.yaml --out runs/families_zero3 --steps 3

It builds, shards and steps each model with the job's own functions (``build_model``,
``apply_backend``, ``train_step``, ``synthetic_batch``, the tensor tracer) and writes one run
directory per family, ``OUT/NAME`` (config.json, metrics.jsonl, summary.json,
tensor_trace.jsonl), so ``python -m helpers.compare`` reads them like any job's. The parity test
(tests/test_families.py) and the precision notebook expect the aligned pair
(``fsdp/full_shard.yaml``, ``deepspeed/zero3.yaml``) to be bit-identical for every family, unless
it is in ``KNOWN_EXCEPTIONS`` with its cause.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from helpers import set_ds_accelerator
from helpers.core.families import FAMILIES, write_config


def sweep(config: str, out: str, steps: int, names: list[str]) -> None:
    """Train each family ``steps`` steps under ``config`` (every rank calls this; rank 0 writes)."""
    import torch
    import torch.distributed as dist

    from helpers.core.config import load_job_config
    from helpers.core.metrics import RunDir
    from helpers.core.models import build_model, resolve_model, synthetic_batch
    from helpers.job.observe.tensor_trace import TensorTracer
    from helpers.job.run import apply_backend, sum_over_ranks

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for name in names:
        path = Path(out) / "configs" / f"{name}.json"
        if rank == 0:
            write_config(name, path.parent)
        dist.barrier()  # written before any rank reads it
        job = load_job_config(config, {"model": str(path), "steps": steps, "micro_batch": 2, "seq_len": 16},
                              world_size=world)
        t = job.train
        run = RunDir(Path(out) / name, active=rank == 0)
        run.start({**job.to_dict(), "world_size": world, "family": name})
        model = build_model(resolve_model(str(path)), torch.bfloat16 if t.model_dtype == "bf16" else torch.float32,
                            seed=t.seed)
        engine = apply_backend(model, job, device)
        tracer = TensorTracer(run.path, rank, world)
        tracer.on_train_begin(engine)
        losses = []
        for step in range(steps):
            tracer.on_step_begin(step)
            ids = synthetic_batch(step, seed=t.seed, rank=rank, world_size=world, micro_batch=t.micro_batch,
                                  seq_len=t.seq_len, vocab_size=model.config.vocab_size).to(device)
            loss = engine.train_step([ids])
            tracer.on_step_end(step)
            sums = sum_over_ranks({"loss": loss, **engine.step_sums()}, device)  # as helpers.train sums a step
            losses.append(sums["loss"] / world)
            run.step({"step": step, "loss": losses[-1], "grad_norm": engine.grad_norm(sums)})
        tracer.on_train_end()
        run.log(f"{name}: losses {losses}")
        run.finish({"status": "completed", "backend": job.backend, "config": config, "model": str(path),
                    "steps": steps, "losses": losses, "final_loss": losses[-1]})
        del engine, model
        dist.barrier()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.families", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names (default: all)")
    args = ap.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    bad = [n for n in names if n not in FAMILIES]
    if bad:
        print(f"error: --families {','.join(bad)}: allowed {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        set_ds_accelerator(cpu=True)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    from helpers.core.config import ConfigError, load_job_config

    try:
        backend_name = load_job_config(args.config).backend
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - only rank 0 prints
    dist.init_process_group(backend)
    if backend_name == "deepspeed":
        import deepspeed

        from helpers.job.run import _quiet_deepspeed

        deepspeed.init_distributed(dist_backend=backend)
        _quiet_deepspeed(dist.get_rank())
    sweep(args.config, args.out, args.steps, names)
    dist.destroy_process_group()
    return 0
