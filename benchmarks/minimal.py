"""The shortest honest training loops, the yardstick for benchmarks/overhead.py.

    torchrun --standalone --nproc_per_node 2 benchmarks/minimal.py --backend fsdp --out /tmp/min.json
    torchrun --standalone --nproc_per_node 2 benchmarks/minimal.py --backend deepspeed --out /tmp/min.json

Same model (helpers.core.models preset, same seed), same data (helpers.core.models.synthetic_batch),
same optimizer (torch AdamW, foreach=False), precision and FSDP units as the harness's configs,
written out by hand: no config parsing, no probes, no guard, no run directory. Rank 0 writes the wall
time of each loop iteration (batch, forward, backward, optimizer step, loss to the host) to
``--out`` as JSON. Not a test; CPU and GPU alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from helpers.core.models import build_model, decoder_layers, resolve_model, synthetic_batch


def fsdp_model(model, dtype, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if dtype == torch.bfloat16:  # aligned mode: fp32 shards, bf16 compute (launch_configs/fsdp/full_shard.yaml)
        model.float()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # the units accelerate launch makes under FSDP2 (helpers.job.wrap.plan), written out: each decoder block, the
    # input embedding (resharded after forward), the final norm with the output layer (kept), then the root
    for block in decoder_layers(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model.get_input_embeddings(), mesh=mesh, mp_policy=mp)
    fully_shard([model.model.norm, model.get_output_embeddings()], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["fsdp", "deepspeed"], required=True)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (bf16: aligned mode)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    model = build_model(resolve_model(a.model), dtype=dtype, seed=0).to(device)
    if a.backend == "fsdp":
        model = fsdp_model(model, dtype, device)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=False)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        from deepspeed.utils import logger

        logger.setLevel("ERROR")
        cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
               "train_batch_size": a.micro_batch * world, "gradient_clipping": 0.0,
               "bf16": {"enabled": a.dtype == "bf16"}, "zero_optimization": {"stage": 3},
               "zero_allow_untested_optimizer": True, "steps_per_print": 10**12}
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=False)
        model, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    vocab = (model.module if a.backend == "deepspeed" else model).config.vocab_size
    times, t_prev = [], time.perf_counter()
    for step in range(a.steps):
        ids = synthetic_batch(step, seed=0, rank=rank, world_size=world, micro_batch=a.micro_batch,
                              seq_len=a.seq_len, vocab_size=vocab).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        if a.backend == "fsdp":
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.backward(loss)
            model.step()
        last = loss.item()  # waits for the device, like printing the loss would
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"backend": a.backend, "dtype": a.dtype, "model": a.model, "world_size": world,
                       "loop_s": times, "final_loss": last}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written and closed. Skip the interpreter's teardown, as helpers.train does: once in a
    # while a C++ communication thread (gloo) still alive at finalization aborts the process ("terminate
    # called without an active exception", SIGABRT), and torchrun would report the finished run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
