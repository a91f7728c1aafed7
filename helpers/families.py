"""Tiny ``config.json`` models of the causal-LM families transformers builds from a config.

``--model PATH/config.json`` accepts any of them (helpers.models). Between them they cover
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
import json
import os
import sys
from pathlib import Path

_W = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)

# name -> (config.json, what the family adds to the sweep)
FAMILIES: dict[str, tuple[dict, str]] = {
    "llama": ({"model_type": "llama", **_W, "tie_word_embeddings": False}, "no biases, untied"),
    "llama_tied": ({"model_type": "llama", **_W, "tie_word_embeddings": True}, "tied embeddings"),
    "mistral": ({"model_type": "mistral", **_W, "num_key_value_heads": 2}, "GQA"),
    "qwen2": ({"model_type": "qwen2", **_W, "num_key_value_heads": 2}, "q/k/v biases, GQA"),
    "qwen3": ({"model_type": "qwen3", **_W, "num_key_value_heads": 2, "head_dim": 16}, "q/k RMSNorm, GQA"),
    "gemma": ({"model_type": "gemma", **_W, "num_key_value_heads": 1, "head_dim": 16},
              "tied, scaled embeddings, multi-query"),
    "phi3": ({"model_type": "phi3", **_W, "num_key_value_heads": 2, "pad_token_id": None, "bos_token_id": 1,
              "eos_token_id": 2},
             "fused qkv and gate_up projections"),
    "gpt2": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "bos_token_id": 0,
              "eos_token_id": 0},
             "biases everywhere (Conv1D), LayerNorm, tied, learned positions"),
    "gpt_neox": ({"model_type": "gpt_neox", **_W, "tie_word_embeddings": False},
                 "biases (nn.Linear), parallel residual, partial rotary"),
    "starcoder2": ({"model_type": "starcoder2", **_W, "num_key_value_heads": 2, "use_bias": True,
                    "bos_token_id": 0, "eos_token_id": 0},  # its defaults (50256) lie outside our 128-token vocab
                   "biases (nn.Linear), GQA, LayerNorm"),
}

# family -> why the aligned pair cannot be bit-identical for it (none known with the shipped configs)
KNOWN_EXCEPTIONS: dict[str, str] = {}


def write_config(name: str, directory: str | Path) -> Path:
    """Write FAMILIES[name]'s config.json to DIRECTORY/NAME.json; returns the path."""
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(FAMILIES[name][0], indent=2))
    return path


def sweep(config: str, out: str, steps: int, names: list[str]) -> None:
    """Train each family ``steps`` steps under ``config`` (every rank calls this; rank 0 writes)."""
    import torch
    import torch.distributed as dist

    from .config import load_job_config
    from .metrics import RunDir
    from .models import build_model, resolve_model, synthetic_batch
    from .tensor_trace import TensorTracer
    from .train import apply_backend, sum_over_ranks

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
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    from .config import ConfigError, load_job_config

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

        from .train import _quiet_deepspeed

        deepspeed.init_distributed(dist_backend=backend)
        _quiet_deepspeed(dist.get_rank())
    sweep(args.config, args.out, args.steps, names)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as helpers.train: skip a teardown that gloo's threads can abort
