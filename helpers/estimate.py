"""Will it fit? Per-rank bytes of a training job, by category, before running it.

    python -m helpers.estimate --config launch_configs/fsdp/full_shard.yaml --model medium \\
        --world-size 8 --micro-batch 4 --seq-len 2048 [--budget-gib 80] [--json]

``--model`` is a preset, a transformers ``config.json`` or a directory holding one: the model is
built on the meta device (no weights, no downloads). Everything is per rank, in bytes:

``params grads optimizer_states master_params``  the state at rest: the ZeRO model of
    ``helpers.core.mapping.theory_bytes`` (the one the jobs print next to their measurement), with FSDP2's
    per-parameter shards made exact from the model's shapes (dim 0 split in ``ceil(rows / shard group)``
    rows: the stored shard is padded, Adam's moments are not, so the last ranks may hold less), Adam's
    step counters (4 bytes per tensor), and ZeRO-3's "persistent" params (fewer elements than
    ``stage3_param_persistence_threshold``: kept whole on every rank). DeepSpeed's flat-buffer padding
    is left out (a few elements per rank).
``activations``  what autograd keeps for backward in one micro-batch (``activation_bytes``: the formula is
    ``helpers.core.footprint``'s module doc, where the categories are computed).
``activations_checkpointed``  the same with activation checkpointing: only each block's input, plus one
    block's full activations while it is recomputed. The peak uses this column only when the launch
    config turns checkpointing on.
``gathered_unit``  FSDP / ZeRO-3: the largest unit gathered whole in the compute dtype, with its
    unsharded gradient before the reduce-scatter (2 x); SHARD_GRAD_OP keeps every unit gathered from
    forward to backward (the whole model, plus one unit's gradient).
``gathered_at_backward``  DeepSpeed ZeRO-3 across ranks: the parameters still gathered from forward when
    backward starts (``zero3_kept_gathered``): once the first step has traced the module order, a
    parameter is not released after its forward if the step uses it again within
    ``stage3_max_reuse_distance`` elements, and every parameter is used again in backward; with the
    default distance (1e9) that is every parameter not kept whole anyway, in the compute dtype. It takes
    the gathered unit's place at the start of backward. On one rank a parameter is its own partition:
    nothing is copied (measured with ``benchmarks/peak_alive.py``, the allocations alive at the peak:
    ``small`` on two ranks holds 30 gathered tensors, the whole model in bf16, at the start of backward;
    on one rank none).
``comm_buckets``  DeepSpeed ZeRO-1/2/3's contiguous gradient bucket: ``reduce_bucket_size`` elements of
    the gradient dtype (two with ``overlap_comm`` on ZeRO-1/2), allocated whole, whatever the model size.
``reduce_scatter_copies``  DeepSpeed ZeRO-3 across ranks, at the end of backward: the bucket's gradients
    reduce-scattered in one call (up to ``reduce_bucket_size`` elements, here often the whole gradient),
    copied twice, in the gradient dtype: DeepSpeed interleaves every rank's slices into one new flat
    tensor (``reduce_scatter_coalesced``, a ``torch.cat``), and gloo's reduce-scatter clones its input
    (both alive at the peak of ``medium`` on 4 ranks, 414.5 MiB each, ``benchmarks/peak_alive.py``; nccl
    reduces from the input, so with ``--device cuda`` only the first copy counts: read, not run here).
``master_grads``  DeepSpeed ZeRO-0 under bf16: the fp32 master's gradients (4 bytes per param), counted
    at the optimizer step only (measured: the start of backward does not hold them; with them there,
    every ZeRO-0 row of ``benchmarks/estimate_grid.py`` was over-predicted by exactly their size).
``loss_transient``  the backward of the loss: the fp32 gradients of the log-probs and of the logits,
    2 x tokens x vocab x 4.
``optimizer_step``  the optimizer step's temporaries (``optimizer_temporary``); 0 when the optimizer is
    offloaded (they are on the host then).
``cublas_workspace``  ``--device cuda``: the cuBLAS workspaces torch allocates through its caching allocator
    (so ``max_memory_allocated`` counts them) at the first matmul and keeps: one per (cuBLAS handle,
    stream), two here (``cublas_workspace_bytes``); 0 on cpu.
``host`` / ``disk``  state offloaded (FSDP ``fsdp_offload_params``; DeepSpeed ``offload_optimizer`` /
    ``offload_param`` to cpu or nvme): moved out of the device categories.

``peak_bytes_per_rank`` is the largest of three moments. The start of backward: state on the
device + comm buckets + gathered unit (ZeRO-3 across ranks: gathered_at_backward instead; FULL_SHARD and
HYBRID_SHARD: the unit's weights only, as its gradients are made by the head's backward, once the loss
transient is freed: with them, the one-rank FULL_SHARD rows of ``benchmarks/estimate_grid.py`` were
over-predicted by their size) + activations + loss transient, less the gradients, which do
not exist yet (FSDP and DeepSpeed free them after each step; ZeRO-3 keeps one gradient buffer from
start-up; under NO_SHARD the output layer's gradient is counted); with checkpointing, the larger of
the checkpointed column without its one recomputed block + loss transient, and the column without
the head's part (the loss's backward is over before the first block is recomputed); on ZeRO-1/2 the
bucket is allocated at the first gradient, once the loss's gradients and the head's activations are
freed (the logits' gradient in the compute dtype and the head's weight gradient are alive), so there
the moment is the larger of the end of forward without the bucket and that one. FSDP, the end of
backward: the root unit (embeddings, head) is the last to reduce its gradients, when the activations
are gone; all of the state, with that unit's gathered weights and unsharded gradients (the gathered
unit), and across ranks the reduce-scatter's copy of those gradients (one more unit in the compute
dtype). (The estimator takes the largest unit for it: in the guide's models that is the root.)
DeepSpeed ZeRO-3 across ranks, the start of a forward: the state, the bucket and two copies of what it keeps
gathered (once the first step has traced the module order it gathers ahead: the all-gather's output buffers and
their concatenated copy; measured on ``small`` with LoRA on 2 ranks, where this moment is the peak). ZeRO-3 on one
rank gathers nothing (a parameter is its own partition): no gathered unit. DeepSpeed ZeRO-3 across ranks, the end
of backward: the state, the bucket, the reduce-scatter copies
and the largest parameter still gathered (the input embedding, the last one backward uses). The optimizer
step: all of the state, buckets, master_grads and optimizer_step, no
activations; every unit has been resharded by then (FSDP, ZeRO-3), except under NO_SHARD, where the
root unit's compute-dtype copy is still alive (measured).

Left out: the allocator's caching and fragmentation (a GPU's reserved memory sits above this), the
CUDA context (outside the allocator), temporaries of single ops (a matmul's output before it is saved),
gloo's and nccl's own buffers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from helpers import CHECKOUT
from helpers.core import mapping
from helpers.core.cli import OneLineParser
from helpers.core.footprint import (
    CUBLAS_DEFAULT,
    CUBLAS_WORKSPACES,
    PERSISTENCE_DEFAULT,
    STATE,
    EstimateError,
    Shapes,
    _cublas_workspaces,
    _shard_group,
    _zero,
    activation_bytes,
    activation_ratio,
    block_per_token,
    compute_bytes,
    cublas_workspace_bytes,
    head_per_token,
    is_persistent,
    model_shapes,
    offloaded,
    optimizer_temporary,
    persistence_threshold,
    split_state,
    state_per_rank,
    zero3_kept_gathered,
)

GIB = 2**30

# What callers (notebooks, tests, benchmarks) import from here, some of it defined in helpers.core.footprint.
__all__ = [
    "CUBLAS_DEFAULT", "CUBLAS_WORKSPACES", "GIB", "PERSISTENCE_DEFAULT", "STATE", "EstimateError", "Shapes",
    "activation_bytes", "against", "block_per_token", "checkpointing", "compute_bytes", "cublas_workspace_bytes",
    "errors", "estimate", "head_per_token", "is_persistent", "largest_micro_batch", "main", "model_shapes",
    "offloaded", "optimizer_temporary", "parse_args", "persistence_threshold", "run", "split_state",
    "state_per_rank", "table", "zero3_kept_gathered",
]


# --------------------------------------------------------------------------- the estimate


def checkpointing(job) -> bool:
    """Does the config turn activation checkpointing on (the same rule the jobs follow)?"""
    from helpers.job.recompute import requested

    return requested(job)


def estimate(job, shapes: Shapes, world_size: int, micro_batch: int, seq_len: int, device: str = "cpu") -> dict:
    """The per-rank estimate as one JSON-ready dict (``peak_bytes_per_rank`` and the categories).

    ``device``: "cpu" (gloo) or "cuda" (nccl): nccl reduce-scatters from its input, so ZeRO-3's reduce-scatter
    copies count once there (DeepSpeed's interleaving ``torch.cat``), twice under gloo, which clones the input.
    """
    key, c = mapping.mode_key(job), compute_bytes(job)
    zo = _zero(job)
    ratio = activation_ratio(shapes, micro_batch, seq_len, c)  # --peft: a frozen base saves less (1.0 otherwise)
    acts = int(ratio * activation_bytes(shapes.cfg, micro_batch, seq_len, c))
    acts_ckpt = activation_bytes(shapes.cfg, micro_batch, seq_len, c, checkpointed=True)
    unit = max(shapes.units)
    unit_t = shapes.unit_trainable(shapes.units.index(unit))  # its trainable elements: the ones with gradients
    trained = shapes.trainable_numel
    if key == "shard_grad_op":
        gathered = c * (shapes.numel + unit_t)
    elif key in ("full_shard", "hybrid_shard", "no_shard") or (key.startswith("zero3") and world_size > 1):
        gathered = c * (unit + unit_t)  # ZeRO-3 on one rank: a parameter is its own partition, nothing is gathered
    else:
        gathered = 0
    buckets = master_grads = 0
    stage = int(zo.get("stage", 0)) if job.backend == "deepspeed" else None
    grad_bytes = c
    if stage is not None and job.deepspeed.json.get("data_types", {}).get("grad_accum_dtype") == "fp32":
        grad_bytes = 4
    if stage and zo.get("contiguous_gradients", True):
        copies = 2 if stage < 3 and zo.get("overlap_comm", False) else 1
        buckets = copies * int(float(zo.get("reduce_bucket_size", 5e8))) * grad_bytes
    if stage == 0 and job.mixed_precision == "bf16":
        master_grads = 4 * trained  # the fp32 master's gradients (at the step; see the module doc)
    step_temp = 0 if "optimizer_states" in offloaded(key, job) else optimizer_temporary(job, shapes, world_size)
    tokens_v = micro_batch * seq_len * shapes.cfg.vocab_size
    held = c * zero3_kept_gathered(job, shapes, world_size)
    rs_copies, largest_param = 0, max(math.prod(s) for s in shapes.params)
    if held:  # ZeRO-3 across ranks: the bucket's reduce-scatter copies (see the module doc)
        copies = 1 if device == "cuda" else 2
        rs_copies = copies * grad_bytes * min(trained, int(float(zo.get("reduce_bucket_size", 5e8))))
    extra = {"activations": acts, "activations_checkpointed": acts_ckpt, "gathered_unit": gathered,
             "gathered_at_backward": held, "reduce_scatter_copies": rs_copies,
             "optimizer_step": step_temp, "comm_buckets": buckets, "master_grads": master_grads,
             "loss_transient": 8 * tokens_v, "cublas_workspace": _cublas_workspaces() if device == "cuda" else 0}
    moved = offloaded(key, job)
    grads_between_steps = stage == 3  # ZeRO-3's gradient partitions are one buffer made at start-up
    used = acts_ckpt if checkpointing(job) else acts
    ranks, peaks = [], []
    for state in state_per_rank(job, shapes, world_size):
        device, host, disk = split_state(state, moved)
        row = {**{k: int(v) for k, v in device.items()}, **extra,
               "host": int(sum(host.values())), "disk": int(sum(disk.values()))}
        state_bytes = int(sum(device.values()))
        at_rest = state_bytes + buckets + master_grads + gathered
        grads = 0 if grads_between_steps else row["grads"]
        if stage in (1, 2):  # the bucket is made at the first gradient, once the loss and the head are done
            head = head_per_token(shapes.cfg, c) * micro_batch * seq_len
            head_w = 0 if shapes.peft else c * shapes.cfg.vocab_size * shapes.cfg.hidden_size  # frozen: no d lm_head
            first_grad = c * tokens_v + head_w  # d logits, d lm_head
            backward = max(at_rest - grads - buckets + used, at_rest - grads + used - head + first_grad)
        else:  # NO_SHARD: the output layer's gradient is alive with the loss's (measured; sharded modes: later)
            head_grad = grads * shapes.cfg.vocab_size * shapes.cfg.hidden_size // shapes.numel
            head_grad = head_grad if key == "no_shard" and not shapes.peft else 0
            start = used + extra["loss_transient"] + head_grad
            if checkpointing(job):  # the loss's backward and a block's recompute come one after the other
                tokens = micro_batch * seq_len
                start -= block_per_token(shapes.cfg, c) * tokens
                start = max(start, acts_ckpt - head_per_token(shapes.cfg, c) * tokens)
            backward = at_rest - grads - master_grads + start  # ZeRO-0's fp32 gradients: made at the step
            if key in ("full_shard", "hybrid_shard"):  # the root unit's gradients come after the loss's backward
                backward -= c * unit_t
                if shapes.peft:  # a LoRA job peaks here: of the units only the tail (norm, head) is still gathered,
                    # and across ranks its all-gather buffer is alive next to its copy (benchmarks/peak_alive.py,
                    # small on 1 and 2 ranks)
                    backward -= c * (unit - shapes.tail * (1 + (_shard_group(job, key, world_size) > 1)))
            if held:  # ZeRO-3 across ranks: forward's gathered parameters, in the gathered unit's place
                backward += held - gathered
        if job.backend == "fsdp":  # the root (largest) unit reduce-scatters last; every unit is resharded after it
            group = _shard_group(job, key, world_size)
            end = state_bytes + c * unit + (1 + (group > 1)) * c * unit_t
            step = state_bytes + (c * unit if key == "no_shard" else 0) + step_temp
        else:
            step = at_rest - gathered + step_temp
            end = at_rest - gathered + c * largest_param + rs_copies if rs_copies else 0
        # ZeRO-3 across ranks, the start of a step's forward: once the first step has traced the module order, it
        # gathers ahead, and the all-gather's output buffers and their concatenated copy are alive together (two
        # copies of what it keeps gathered; benchmarks/peak_alive.py, small with LoRA on 2 ranks)
        forward = at_rest - gathered + 2 * held if held else 0
        peaks.append(max(backward, end, step, forward) + extra["cublas_workspace"])  # allocated at the first matmul
        ranks.append(row)
    return {"mode_key": key, "world_size": world_size, "micro_batch": micro_batch, "seq_len": seq_len,
            "num_params": shapes.numel, "trainable_params": trained, "activation_ratio": ratio,
            "activation_checkpointing": checkpointing(job),
            "categories_per_rank": ranks, "peak_bytes_per_rank": peaks}


def largest_micro_batch(job, shapes: Shapes, world_size: int, seq_len: int, budget: float,
                        device: str = "cpu") -> int:
    """The largest micro-batch whose predicted peak fits ``budget`` bytes on every rank (0: not even 1)."""
    def fits(b):
        return max(estimate(job, shapes, world_size, b, seq_len, device)["peak_bytes_per_rank"]) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- command line


def _positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return v
    return parse


def parse_args(argv=None):
    ap = OneLineParser(prog="python -m helpers.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="launch config (launch_configs/...)")
    ap.add_argument("--model", help="preset (tiny, small, medium), config.json or a directory; default: the config's")
    ap.add_argument("--world-size", type=_positive(int), required=True, help="ranks")
    ap.add_argument("--micro-batch", type=_positive(int), help="sequences per rank per forward")
    ap.add_argument("--seq-len", type=_positive(int), help="tokens per sequence")
    ap.add_argument("--budget-gib", type=_positive(float), help="device memory per rank: verdict and the "
                    "largest micro-batch that fits")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the job runs: cpu (gloo, the "
                    "default) or cuda (nccl: one reduce-scatter copy fewer under ZeRO-3)")
    ap.add_argument("--peft", help="a LoRA config (as helpers.train --peft takes it): the base frozen, the adapter "
                    "trained")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return ap.parse_args(argv)


def run(args) -> dict:
    """The estimate for parsed arguments; EstimateError / ConfigError on bad input."""
    from helpers.core.config import ConfigError, load_job_config
    from helpers.job.checks import resolve_job

    overrides = {"model": args.model, "micro_batch": args.micro_batch, "seq_len": args.seq_len}
    job = load_job_config(args.config, overrides, world_size=args.world_size)
    if job.train.seq_len < 2:
        raise ConfigError(f"--seq-len = {job.train.seq_len}: must be >= 2")
    peft = None
    if getattr(args, "peft", None):
        from helpers.core.models import resolve_model
        from helpers.job.lora import check_applies, read_config

        peft = read_config(args.peft)
        check_applies(peft, resolve_model(job.train.model), job, args.peft)
    shapes = model_shapes(job.train.model, job.fsdp.auto_wrap_policy if job.fsdp else "TRANSFORMER_BASED_WRAP", peft)
    if job.backend == "deepspeed":
        resolved, _ = resolve_job(job, args.world_size)
        job.deepspeed.json = resolved["deepspeed"]["json"]
    t = job.train
    out = {"config": args.config, "model": t.model, **estimate(job, shapes, args.world_size, t.micro_batch,
                                                               t.seq_len, getattr(args, "device", "cpu"))}
    if args.budget_gib:
        budget = args.budget_gib * GIB
        out.update(budget_gib=args.budget_gib, fits=max(out["peak_bytes_per_rank"]) <= budget,
                   largest_micro_batch=largest_micro_batch(job, shapes, args.world_size, t.seq_len, budget,
                                                             getattr(args, "device", "cpu")))
    return out


def errors(predicted: list[float], measured: list[float]) -> dict:
    """A prediction against a run, per rank: ``(predicted - measured) / measured`` on each rank, the rank
    where it errs most (``worst_rank``, ``error``) and the largest predicted peak against the largest
    measured one (``error_of_the_largest``: whether a job fits is decided on its largest rank). Used by
    ``benchmarks/estimate_grid.py`` and notebook 18."""
    per_rank = [(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    worst = max(range(len(per_rank)), key=lambda r: abs(per_rank[r]))
    return {"per_rank": per_rank, "worst_rank": worst, "error": per_rank[worst],
            "error_of_the_largest": (max(predicted) - max(measured)) / max(measured)}


def against(row: dict) -> dict:
    """The estimate for a measured run of a shipped mode, next to it: ``row`` has ``mode`` (a key of
    ``helpers.core.mapping.MODES``), ``model``, ``world_size``, ``micro_batch``, ``seq_len``, ``measured``
    and, for a LoRA job, ``peft`` (its config, relative to the repo)
    (``peak_tensor_bytes``, one per rank), and may have ``measured_repeat`` (the same job run again).
    Returns the prediction per rank, its comm buckets, ``errors`` (of the repeat too: ``error_repeat``,
    ``error_of_the_largest_repeat``) and ``error_without_buckets``, the worst rank's ``(predicted - measured)
    / (measured - buckets)``: DeepSpeed's ZeRO-1/2/3 bucket is counted exactly and can be most of a small
    model's peak, so this scores the rest. How ``benchmarks/estimate_grid.py`` scores a job, and how
    notebook 18 re-scores the grid's stored measurements with the estimator of the day."""
    config = CHECKOUT / mapping.MODES[row["mode"]].config
    e = run(argparse.Namespace(config=str(config), model=row["model"], world_size=row["world_size"],
                               micro_batch=row["micro_batch"], seq_len=row["seq_len"], budget_gib=None,
                               peft=str(CHECKOUT / row["peft"]) if row.get("peft") else None))
    predicted, buckets = e["peak_bytes_per_rank"], [c["comm_buckets"] for c in e["categories_per_rank"]]
    rest = max(((p - m) / (m - b) for p, m, b in zip(predicted, row["measured"], buckets, strict=True)), key=abs)
    return {"predicted": predicted, "comm_buckets": buckets, "error_without_buckets": rest,
            **errors(predicted, row["measured"]),
            **({f"{k}_repeat": v for k, v in errors(predicted, row["measured_repeat"]).items()
                if k in ("error", "error_of_the_largest")} if "measured_repeat" in row else {})}


def table(e: dict) -> str:
    cats = [*STATE, "comm_buckets", "master_grads", "gathered_unit", "gathered_at_backward", "reduce_scatter_copies",
            "optimizer_step", "activations",
            "activations_checkpointed", "loss_transient", "cublas_workspace", "host", "disk"]
    lines = [f"{e['mode_key']}, {e['num_params'] / 1e6:.2f}M params, {e['world_size']} ranks, micro-batch "
             f"{e['micro_batch']} x {e['seq_len']} tokens (MiB per rank)",
             "category                   " + " ".join(f"{'rank ' + str(r):>10}" for r in range(e["world_size"]))]
    for cat in cats:
        lines.append(f"{cat:26} " + " ".join(f"{row[cat] / 2**20:10.1f}" for row in e["categories_per_rank"]))
    used = "activations_checkpointed" if e["activation_checkpointing"] else "activations"
    lines.append(f"{'predicted peak':26} " + " ".join(f"{p / 2**20:10.1f}" for p in e["peak_bytes_per_rank"]))
    lines.append(f"(peak: the largest of the start of backward, device state less grads + comm_buckets + "
                 f"gathered_unit (ZeRO-3 across ranks: gathered_at_backward; FULL_SHARD and HYBRID_SHARD: its "
                 f"weights only) + {used} + loss_transient; the end of "
                 f"backward, under FSDP state + the largest unit's gathered weights, gradients and reduce-scatter "
                 f"copy, under ZeRO-3 across ranks state + comm_buckets + reduce_scatter_copies + the largest "
                 f"parameter; and the step, state + comm_buckets + master_grads + optimizer_step; each + "
                 f"cublas_workspace: "
                 f"python -m helpers.estimate's module doc)")
    if "budget_gib" in e:
        verdict = "fits" if e["fits"] else "does not fit"
        lines.append(f"budget {e['budget_gib']} GiB per rank: {verdict}; largest micro-batch that fits: "
                     f"{e['largest_micro_batch'] or 'none (not even 1)'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        e = run(args)
    except ValueError as err:  # ConfigError, EstimateError, ModelSpecError: one line
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(e) if args.json else table(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
