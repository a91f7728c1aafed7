"""The job entry point: one code path for 1 rank, N ranks and N nodes.

    torchrun --standalone --nproc_per_node 2 -m helpers.train \\
        --config launch_configs/fsdp/full_shard.yaml --out runs/fsdp_tiny --steps 20

also ``python -m helpers.train ...`` (one rank, no launcher) and
``python -m helpers.launch --nnodes M ...`` (several nodes: torchrun with c10d
rendezvous). ``RANK``/``WORLD_SIZE`` from the launcher decide who does what;
only rank 0 prints and writes the run directory (see helpers.core.metrics).

``main`` is the job's phases, one function each: validate -> start -> connect ->
build (and load) -> wrap (the backend) -> restore (``--resume``) -> the loop ->
summarise -> finish. Every measurement (memory, dtypes, updates, loading, profiler,
progress, checkpoints, throughput) is an observer called around them
(helpers.job.observe.observers); each step sums its numbers over ranks in one all-reduce.

Picks gloo + CPU (and ``DS_ACCELERATOR=cpu``) when no GPU is visible, nccl +
CUDA when one is. A bad config, override or ``--out`` exits with status 2 and
one ``error:`` line from rank 0, before any process group exists. A rank that
fails, dies or hangs ends the job with status 1, one ``error:`` block from
rank 0 naming the rank, and a failed ``summary.json`` (see helpers.job.guard).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
import warnings
from datetime import timedelta
from functools import partial

from helpers import set_ds_accelerator
from helpers.job import reuse
from helpers.job.args import OVERRIDES, parse_args
from helpers.job.backends import apply_backend, optimizer_impl
from helpers.job.checks import check_observers, checkpointing_notes, resolve_job
from helpers.job.state import JobState, base_summary, env_int

T0, STARTED_AT = time.perf_counter(), time.time()  # the summary records both: run time, and start order


def _loopback_gloo() -> None:
    """Keep gloo's sockets on the loopback interface when the rendezvous is on this host only."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        local = all(info[4][0] in ("127.0.0.1", "::1") or info[4][0].startswith("127.")
                    for info in socket.getaddrinfo(addr, None))
    except OSError:
        return
    names = [n for _, n in socket.if_nameindex() if n in ("lo", "lo0")] if hasattr(socket, "if_nameindex") else []
    if local and names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", names[0])


def fail_config(rank: int, msg: str, grace_s: float = 15.0) -> None:
    """Exit 2 with one ``error:`` line, from rank 0 only.

    Every rank checks the same input, so the other ranks wait for rank 0 to fail too (torchrun then
    stops them): exiting first would let torchrun stop rank 0 before it printed. A rank still alive
    after ``grace_s`` (rank 0 did not see the problem, e.g. a file missing on this node only) says it.
    """
    if rank != 0:
        time.sleep(grace_s)
    print(f"error: {msg}" if rank == 0 else f"error: rank {rank}: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None) -> int:
    args = parse_args(argv)
    note = reuse.try_reuse(args) if args.reuse else None  # --reuse DIR: the same job, completed there, is copied
    if args.reuse and note is None:
        return 0
    s = validate(args)  # bad input: one line, exit 2, before anything starts
    s.job.notes += [note] if note else []
    start(s)  # from here on, a failure on any rank ends the job with status 1 and a failed summary
    return run(s)


def run(s: JobState, join: bool = True, leave: bool = True) -> int:
    """The job's phases after start. ``join``/``leave``: open and close the process group; the family sweep
    (helpers.job.sweep) runs several jobs in one group, each through these same phases."""
    obs = s.observers
    try:
        connect(s, join)  # process group(s), run directory, the first log lines
        obs.on_load_begin(s)
        build(s)  # the model: random init, or --model DIR the way the config loads it
        obs.on_model_built(s)
        wrap(s)  # the backend: FSDP2 fully_shard or deepspeed.initialize
        obs.on_engine_ready(s)
        restore(s)  # --resume: model, optimizer, data position, RNG
        obs.on_train_begin(s)
        train_loop(s)
        obs.on_train_end(s)
        summarise(s)
    except BaseException as e:  # noqa: BLE001 - reported by the guard, which ends the process with status 1
        obs.close(s)
        s.guard.fail(budget_verdict(s, e))
    finish(s, leave)
    return 0


def validate(args: argparse.Namespace, refuse=fail_config) -> JobState:
    """Every input checked before any process group or file exists; bad input exits 2 (``refuse``: fail_config;
    the config sweep, helpers.job.sweep, passes one that raises, to go on with the next config)."""
    from helpers.job.observe.profiling import quiet_cpp_warnings

    quiet_cpp_warnings()  # before torch is imported: the tensor-peak profiler (every CPU job) and --profile
    rank, world_size = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    from helpers.core.config import load_job_config
    from helpers.core.metrics import RunDir
    from helpers.job.guard import JobGuard, refuse_if_busy

    try:
        if rank == 0:
            refuse_if_busy(args.out)  # another job's --out: at once, before torch loads (guard.claim below takes it)
        job = load_job_config(args.config, {k: getattr(args, k) for k in OVERRIDES}, world_size=world_size)
        from helpers.core.models import model_config, resolve_model  # imports torch: after the quick checks
        from helpers.job.comm import check_local_device

        spec = resolve_model(job.train.model)
        job.notes += check_local_device(env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", 1))  # GPUs, cores
        if spec.kind != "preset":
            model_config(spec)  # a config.json that transformers cannot read is bad input too
        from helpers.job.observe.offload import prepare

        job.notes += prepare(job, args.out, env_int("LOCAL_RANK", 0))  # node-local NVMe swap dir; libaio checked
        job.notes += checkpointing_notes(job, spec)
        resolved, ds_filled = resolve_job(job, world_size)
        check_observers(job, spec, args)  # --profile needs enough steps; the FSDP wrap classes exist
        guard = JobGuard(args.out, rank, world_size, timeout=job.train.timeout)
        from helpers.job.checkpoint import check_args

        resume_meta = check_args(args, job, world_size)
        from helpers.job.lora import check_args as check_peft

        peft = check_peft(args, job, spec, resume_meta)  # --peft FILE: read, and tried on a meta copy
        if rank == 0:
            guard.claim()  # --out: not a file, not another job's, not someone's directory
    except ValueError as e:  # ConfigError, ModelSpecError, OutDirError, a bad GUIDE_FAIL_* test hook
        refuse(rank, str(e))
    return JobState(args, job, spec, rank, world_size, guard, RunDir(args.out, active=rank == 0), resolved,
                    ds_filled, resume_meta, peft)


def start(s: JobState) -> None:
    """Only rank 0 prints; the device (nccl + CUDA when a GPU is visible, else gloo + CPU); the observers;
    the guard (watchdog, SIGTERM, the failed summary)."""
    if s.rank != 0:  # only rank 0 prints; errors still reach stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed warns per gloo collective
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    import torch

    if torch.cuda.is_available():
        s.device = torch.device("cuda", env_int("LOCAL_RANK", 0))
        if s.args.deterministic:  # before the first cuBLAS handle, which reads the workspace setting
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)  # strict: SDPA then picks deterministic backward kernels
        torch.cuda.set_device(s.device)
    else:
        set_ds_accelerator(cpu=True)
        s.device = torch.device("cpu")
        if s.args.deterministic:
            s.job.notes.append("--deterministic: nothing to change on a CPU (the guide's CPU ops give the same "
                               "bits run to run)")
    from helpers.job.observe.observers import default_observers

    s.observers = default_observers(s)
    s.summary = base_summary(s)
    s.guard.start(partial(write_failed, s))


def connect(s: JobState, join: bool = True) -> None:
    """The process group (DeepSpeed's too; unless ``join`` is False: an earlier job of this process opened
    it), the run directory with config.json, the job's first log lines."""
    if join:
        _join(s)
    s.guard.connect()
    job = s.job
    device = s.summary["device"]
    s.run.start({**s.resolved, "world_size": s.world_size, "device": device, "dist_backend": s.dist_backend,
                 "out": s.args.out})
    if s.rank == 0:  # the run directory exists (emptied of an earlier run): link the node-local swap dirs into it
        from helpers.job.observe.offload import link_swap_dirs

        link_swap_dirs(job, s.args.out)
    s.run.log(f"[{job.backend}] {s.summary['mode']} mixed_precision={job.mixed_precision} "
              f"world_size={s.world_size} device={device} ({s.dist_backend})")
    from helpers.core.config import LAUNCHER_ONLY, unapplied_notes

    for note in job.notes + unapplied_notes(job) + (
            [f"filled DeepSpeed 'auto': {', '.join(s.ds_filled)}"] if s.ds_filled else []):
        # keys for accelerate launch's own process start (every shipped YAML has three): log.txt only
        s.run.log(f"note: {note}", echo=not note.endswith(LAUNCHER_ONLY))


def _join(s: JobState) -> None:
    import torch.distributed as dist

    launched = "MASTER_ADDR" in os.environ
    if not launched:  # plain `python -m helpers.train`: a world of one, no port opened
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    _loopback_gloo()
    # the watchdog (--timeout without a finished step) ends a hang and says so; the process-group timeout
    # is a little longer, so a stuck collective is reported as the hang it is, not as a gloo/nccl error
    timeout = timedelta(seconds=s.job.train.timeout + 30)
    store = {} if launched else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(s.dist_backend, device_id=s.device if s.use_cuda else None, timeout=timeout, **store)
    if s.job.backend == "deepspeed":
        if not s.use_cuda:  # a build lock left by an interrupted build would make every rank wait for ever
            from helpers.job.ops import clear_stale_locks

            s.job.notes += clear_stale_locks()  # logged with the other notes (connect)
        import deepspeed

        _quiet_deepspeed(s.rank)
        with _without_build_line():
            deepspeed.init_distributed(dist_backend=s.dist_backend, timeout=timeout)


def build(s: JobState) -> None:
    """The model in the --model-dtype dtype: random init (a preset or config.json), or --model DIR loaded
    the way the config says (helpers.loading: every rank whole, on the meta device, or in ZeRO-3 Init)."""
    from helpers.core.models import build_model, count_params
    from helpers.job import loading

    if s.load_method == "fsdp_ram_efficient":
        s.model = loading.meta_model(s.spec, s.model_dtype)  # filled by wrap, once sharded
    elif s.load_method == "zero3_init":
        s.model = loading.zero3_model(s.spec, s.model_dtype, s.resolved["deepspeed"]["json"])
    else:
        s.model = build_model(s.spec, dtype=s.model_dtype, seed=s.job.train.seed)
    if s.peft is not None:  # the adapter goes in before any wrapping; the base is frozen
        from helpers.job.lora import attach

        attach(s)
    s.summary["num_params"] = count_params(s.model)
    from helpers.job.audit import snapshot

    s.before_wrap = snapshot(s.model)  # what the post-wrap audit compares against


def wrap(s: JobState) -> None:
    """The backend (FSDP2 or DeepSpeed) around the model; RAM-efficient loading fills the shards after."""
    if s.resume_meta and s.job.backend == "deepspeed":  # DeepSpeed: the checkpoint is read before initialize
        from helpers.job.checkpoint import before_backend

        s.resume_state = before_backend(s.model, s.resume_meta, s.args.resume)
    s.engine = apply_backend(s.model, s.job, s.device)
    s.summary["activation_checkpointing"] = s.engine.activation_checkpointing  # helpers.job.recompute
    s.summary["optimizer_impl"] = optimizer_impl(s.engine.optimizer)
    s.run.log(f"activation checkpointing: {s.engine.activation_checkpointing or 'off (every activation is kept)'}")
    if s.load_method == "fsdp_ram_efficient":
        from helpers.job.loading import fsdp_fill

        fsdp_fill(s.engine, s.spec, s.model_dtype, s.device, offload=s.job.fsdp.offload_params)
    from helpers.job.audit import audit, log_line

    s.summary["audit"] = audit(s.engine.module, s.before_wrap, s.job, (s.resolved.get("deepspeed") or {}).get("json"))
    s.run.log(log_line(s.summary["audit"]))


def restore(s: JobState) -> None:
    """--resume DIR/step_K: model, optimizer, data position and RNG as saved; the loop starts at step K."""
    if not s.resume_meta:
        return
    from helpers.job.checkpoint import restore as restore_checkpoint

    meta, path = s.resume_meta, s.args.resume
    s.start_step = restore_checkpoint(s.engine, meta, path, s.resume_state)
    s.resume_state = None
    s.summary["resumed_from"] = {"path": path, "step": s.start_step, "format": meta["format"],
                                 "backend": meta["backend"]}
    s.run.log(f"resumed from {path} ({meta['format']}, {meta['backend']}, {meta['world_size']} ranks) "
              f"at step {s.start_step}")


def train_loop(s: JobState) -> None:
    """The steps: the batches, one optimizer step, one all-reduce of the step's numbers, one metrics row.
    Everything else (probes, profiler, checkpoints, progress) is an observer's hook around it."""
    from helpers.core.metrics import Timer
    from helpers.core.models import synthetic_batch

    t, obs, engine = s.job.train, s.observers, s.engine
    s.in_loop = True
    vocab = s.model.config.vocab_size
    s.run.log(f"model {t.model}: {s.summary['num_params'] / 1e6:.2f}M params; "
              f"{t.steps} steps x {t.grad_accum} x {t.micro_batch} x {t.seq_len} tokens per rank")
    for step in range(s.start_step, t.steps):
        s.guard.fault_hook(step)  # GUIDE_FAIL_* test hooks; nothing otherwise
        batches = [synthetic_batch(step, seed=t.seed, rank=s.rank, world_size=s.world_size, micro_batch=t.micro_batch,
                                   seq_len=t.seq_len, vocab_size=vocab, micro_step=m, grad_accum=t.grad_accum
                                   ).to(s.device) for m in range(t.grad_accum)]
        s.probe = None
        obs.on_step_begin(s, step)
        lr = getattr(engine, "current_lr", t.lr)  # a DeepSpeed JSON scheduler moves it
        # the step's one all-reduce is timed too: it carries FSDP's gradient-norm sum (no clipping), which DeepSpeed
        # reduces in its own step, so both count the same work (--track-updates' counts too: not a throughput run)
        with Timer(s.device) as timer:
            loss = engine.train_step(batches, s.probe)
            sums = sum_over_ranks({"loss": loss, **engine.step_sums(), **obs.step_sums(s)}, s.device)
        row = {"step": step, "loss": sums["loss"] / s.world_size, "grad_norm": engine.grad_norm(sums), "lr": lr,
               "step_time_s": timer.seconds, "tokens_per_s": s.tokens_per_rank_step / timer.seconds,
               **obs.step_row(s, sums), "elapsed_s": time.perf_counter() - T0}
        s.records.append(row)
        s.run.step(row)
        s.guard.progress(step + 1)
        obs.on_step_end(s, step, row)


def budget_verdict(s: JobState, e: BaseException) -> BaseException:
    """--memory-budget-gib on a GPU: an out-of-memory is the budget's answer, one line (JobStop), not a traceback."""
    import torch

    if s.args.memory_budget_gib and isinstance(e, torch.cuda.OutOfMemoryError):
        from helpers.job.guard import JobStop

        when = f"at step {s.start_step + len(s.records)}" if s.in_loop else \
            "during set-up (building, loading or sharding the model, before step 0)"
        return JobStop(f"out of memory under --memory-budget-gib {s.args.memory_budget_gib:g} {when} "
                       f"(rank {s.rank})")
    return e


def sum_over_ranks(values: dict, device) -> dict[str, float]:
    """Each rank's numbers (tensors or floats) summed over all ranks in one fp64 all-reduce."""
    import torch
    import torch.distributed as dist

    vec = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values.values()])
    dist.all_reduce(vec)
    return dict(zip(values, vec.tolist(), strict=True))


def summarise(s: JobState) -> None:
    """The completed run's summary: its steps, each observer's keys; rank 0's last line."""
    from helpers.core.metrics import summarize_steps

    s.summary.update(status="completed", steps=len(s.records), **summarize_steps(s.records, s.tokens_per_rank_step))
    s.summary.update(s.observers.summary(s))
    sm = s.summary
    mfu = f", MFU {sm['mfu']:.2f}" if sm["mfu"] is not None else ""
    s.run.log(f"done: final loss {sm['final_loss']:.4f}, median step {sm['step_time_s'] * 1e3:.1f} ms, "
              f"{sm['tokens_per_s_per_rank']:.0f} tokens/s/rank{mfu}; wrote {s.args.out}")


def finish(s: JobState, leave: bool = True) -> None:
    """Write summary.json, release --out, leave the process group (``leave``; else the next job of this
    process uses it, and this job's watchdog stops)."""
    import torch.distributed as dist

    s.observers.close(s)
    s.guard.finish(lambda: _write_summary(s), last=leave)
    if leave and dist.is_initialized():
        dist.destroy_process_group()


def write_failed(s: JobState, failed_rank, reason, message) -> None:
    """Rank 0, called by the guard exactly once: the failed summary, with what was measured until then."""
    from helpers.core.metrics import summarize_steps

    done = list(s.records)
    s.summary.update(s.observers.summary(s))
    s.summary.update(status="failed", reason=reason, failed_rank=failed_rank, steps=len(done),
                     **summarize_steps(done, s.tokens_per_rank_step) if done else {})
    if s.args.memory_budget_gib and "--memory-budget-gib" in str(reason):  # any rank's budget stop
        s.summary["memory_budget_fits"] = False
    s.run.log(message, echo=False)
    _write_summary(s)


def _write_summary(s: JobState) -> None:
    s.summary.update(wall_time_s=time.perf_counter() - T0, started_at=STARTED_AT)
    s.run.finish(s.summary)  # before teardown: a rare abort in destroy_process_group must not lose it


@contextlib.contextmanager
def _without_build_line():
    """DeepSpeed prints "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" on every rank
    whenever it loads its shared-memory op, built now or long ago; anything else it prints goes through."""
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        kept = [ln for ln in out.getvalue().splitlines(keepends=True) if not ln.endswith("built successfully\n")]
        sys.stdout.write("".join(kept))


def _quiet_deepspeed(rank: int) -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
