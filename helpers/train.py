"""The job entry point: one code path for 1 rank, N ranks and N nodes.

    torchrun --standalone --nproc_per_node 2 -m helpers.train \\
        --config launch_configs/fsdp/full_shard.yaml --out runs/fsdp_tiny --steps 20

also ``python -m helpers.train ...`` (one rank, no launcher) and
``python -m helpers.launch --nnodes M ...`` (several nodes: torchrun with c10d
rendezvous). ``RANK``/``WORLD_SIZE`` from the launcher decide who does what;
only rank 0 prints and writes the run directory (see helpers.metrics).

Picks gloo + CPU (and ``DS_ACCELERATOR=cpu``) when no GPU is visible, nccl +
CUDA when one is. A bad config, override or ``--out`` exits with status 2 and
one ``error:`` line from rank 0, before any process group exists. A rank that
fails, dies or hangs ends the job with status 1, one ``error:`` block from
rank 0 naming the rank, and a failed ``summary.json`` (see helpers.guard).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import warnings
from datetime import timedelta
from functools import partial
from importlib import metadata

from .throughput import positive_tflops

T0 = time.perf_counter()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input (argparse prints usage + error)
        self.exit(2, f"error: {message} (see python -m helpers.train --help)\n")


def parse_args(argv=None) -> argparse.Namespace:
    ap = _Parser(prog="python -m helpers.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="Accelerate-format YAML (launch_configs/...)")
    ap.add_argument("--out", required=True, help="run directory to write")
    ap.add_argument("--model", help="preset (tiny, small, medium), config.json or pretrained dir")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--grad-accum", type=int)
    ap.add_argument("--grad-clip", type=float, help="max grad norm (FSDP); DeepSpeed reads its config")
    ap.add_argument("--timeout", type=float, help="seconds without a finished step before the job is "
                    "stopped as hung (start-up included; also the process-group timeout); default 600")
    ap.add_argument("--model-dtype", help="dtype the model is loaded in: auto (default: bf16; fp32 for "
                    "DeepSpeed without bf16), bf16, fp32")
    ap.add_argument("--peak-tflops", type=positive_tflops, help="the device's peak TFLOPS for MFU (default: "
                    "a table of GPUs; measured on a CPU), see helpers.throughput")
    ap.add_argument("--compile", action="store_true", default=None,
                    help="torch.compile: each transformer block (FSDP2) or the engine (DeepSpeed)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler trace per rank of a few steps "
                    "after warm-up into the run directory (helpers.profiling)")
    ap.add_argument("--checkpoint-dir", help="save checkpoints to DIR/step_K (see helpers.checkpoint)")
    ap.add_argument("--checkpoint-every", type=int, help="save every K steps (needs --checkpoint-dir)")
    ap.add_argument("--resume", help="checkpoint DIR/step_K to continue from; --steps stays the total")
    return ap.parse_args(argv)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


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


def versions() -> dict:
    out = {}
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.profile:
        from .profiling import quiet_cpp_warnings

        quiet_cpp_warnings()  # before torch is imported
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)

    # ---- validate everything before any process group or file exists
    from .config import load_job_config, unapplied_notes
    from .guard import JobGuard

    overrides = {k: getattr(args, k) for k in ("model", "steps", "lr", "seed", "micro_batch", "seq_len",
                                               "grad_accum", "grad_clip", "timeout", "model_dtype", "compile")}
    try:
        job = load_job_config(args.config, overrides, world_size=world_size)
        from .comm import check_local_device
        from .models import model_config, resolve_model  # imports torch: after the quick checks

        spec = resolve_model(job.train.model)
        check_local_device(local_rank)  # a GPU node: one GPU per rank
        if spec.kind != "preset":
            model_config(spec)  # a config.json that transformers cannot read is bad input too
        from .offload import prepare

        job.notes += prepare(job, args.out)  # NVMe swap dir inside the run; libaio checked
        resolved, ds_filled = resolve_job(job, world_size)
        check_observers(job, spec, args)  # --profile needs enough steps; the FSDP wrap classes exist
        guard = JobGuard(args.out, rank, world_size, timeout=job.train.timeout)
        from .checkpoint import check_args

        resume_meta = check_args(args, job, world_size)
        if rank == 0:
            guard.claim()  # --out: not a file, not another job's, not someone's directory
    except ValueError as e:  # ConfigError, ModelSpecError, OutDirError, a bad GUIDE_FAIL_* test hook
        fail_config(rank, str(e))

    if rank != 0:  # only rank 0 prints; errors still reach stderr
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed warns per gloo collective
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    import torch

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist_backend = "nccl" if use_cuda else "gloo"
    launched = "MASTER_ADDR" in os.environ
    if not launched:  # plain `python -m helpers.train`: a world of one, no port opened
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    _loopback_gloo()

    import torch.distributed as dist

    from .memory import PeakMemory, StepProbe
    from .metrics import RunDir, Timer, summarize_steps
    from .models import build_model, count_params, synthetic_batch
    from .offload import state_locations
    from .precision import DtypeProbe, UpdateTracker
    from .profiling import StepProfiler
    from .progress import Progress
    from .throughput import compute_dtype, device_peak, flops_per_token, fmt_flops, summary_keys

    run = RunDir(args.out, active=rank == 0)
    records: list[dict] = []
    summary = {
        "status": "failed", "reason": None, "failed_rank": None, "backend": job.backend,
        "config": args.config, "mode": mode_name(job), "mixed_precision": job.mixed_precision,
        "world_size": world_size, "num_nodes": _env_int("GROUP_WORLD_SIZE", 1) if "GROUP_WORLD_SIZE"
        in os.environ else max(1, world_size // _env_int("LOCAL_WORLD_SIZE", world_size)),
        "model": job.train.model, "num_params": None, "steps": 0,
        "tokens_per_step": job.train.micro_batch * job.train.grad_accum * job.train.seq_len * world_size,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "dist_backend": dist_backend, "versions": versions(), "checkpoints": [], "resumed_from": None, "loading": None,
    }

    def write_failed(failed_rank, reason, message):  # rank 0, called by the guard exactly once
        done = list(records)
        summary.update(status="failed", reason=reason, failed_rank=failed_rank, steps=len(done),
                       **summarize_steps(done, tokens_per_rank_step) if done else {})
        run.log(message, echo=False)
        _finish(run, summary)

    tokens_per_rank_step = job.train.micro_batch * job.train.grad_accum * job.train.seq_len
    guard.start(write_failed)
    # the watchdog (--timeout without a finished step) ends a hang and says so; the process-group timeout
    # is a little longer, so a stuck collective is reported as the hang it is, not as a gloo/nccl error
    timeout = timedelta(seconds=job.train.timeout + 30)
    try:
        store = {} if launched else dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(dist_backend, device_id=device if use_cuda else None, timeout=timeout, **store)
        guard.connect()
        if job.backend == "deepspeed":
            if not use_cuda:  # a build lock left by an interrupted build would make every rank wait for ever
                from .warmup import clear_stale_locks

                job.notes += clear_stale_locks()  # logged with the other notes below
            import deepspeed

            _quiet_deepspeed(rank)
            deepspeed.init_distributed(dist_backend=dist_backend, timeout=timeout)
        run.start({**resolved, "world_size": world_size, "device": summary["device"],
                   "dist_backend": dist_backend, "out": args.out})
        run.log(f"[{job.backend}] {summary['mode']} mixed_precision={job.mixed_precision} "
                f"world_size={world_size} device={summary['device']} ({dist_backend})")
        for note in job.notes + unapplied_notes(job) + (
                [f"filled DeepSpeed 'auto': {', '.join(ds_filled)}"] if ds_filled else []):
            run.log(f"note: {note}")
        peak_flops, peak_source = device_peak(device, compute_dtype(job), args.peak_tflops)
        run.log(f"peak {fmt_flops(peak_flops)} per device ({peak_source})" if peak_flops
                else f"note: no MFU: {peak_source}")

        t = job.train
        dtype = torch.bfloat16 if t.model_dtype == "bf16" else torch.float32
        from . import loading

        method = loading.method_for(job) if spec.kind == "pretrained" else None
        monitor = loading.LoadMonitor() if method else None
        if monitor:
            dist.barrier()
            monitor.__enter__()
        if method == "fsdp_ram_efficient":
            model = loading.meta_model(spec, dtype)
        elif method == "zero3_init":  # partitioned as it loads: the load ends here (initialize adds the optimizer)
            model = loading.zero3_model(spec, dtype, resolved["deepspeed"]["json"])
            monitor.__exit__(None, None, None)
        else:
            model = build_model(spec, dtype=dtype, seed=t.seed)
        summary["num_params"] = count_params(model)
        flops = flops_per_token(model, t.seq_len)
        peak = PeakMemory(device)
        model.register_forward_hook(peak.sample)  # activations are all alive at the end of forward
        dtypes = DtypeProbe(model)  # before the backend: sees the dtype the model was loaded in
        from . import checkpoint as ckpt

        resume_state = ckpt.before_backend(model, resume_meta, args.resume) \
            if resume_meta and job.backend == "deepspeed" else None
        engine = apply_backend(model, job, device)
        if method == "fsdp_ram_efficient":
            loading.fsdp_fill(engine, spec, dtype, device)
        if monitor:
            if method != "zero3_init":
                monitor.__exit__(None, None, None)
            summary["loading"] = {"method": method, "path": spec.path, "ranks": gather(monitor.result),
                                  "weights_match": loading.weights_match(engine, spec, dtype)}
            run.log(f"loaded {spec.path} ({method}): {monitor.seconds:.2f} s, peak RssAnon "
                    f"+{monitor.result['peak_rss_anon_bytes'] / 2**20:.0f} MiB on rank 0, weights match the file: "
                    f"{summary['loading']['weights_match']}")
        start = 0
        if resume_meta:
            start = ckpt.restore(engine, resume_meta, args.resume, resume_state)
            del resume_state
            summary["resumed_from"] = {"path": args.resume, "step": start, "format": resume_meta["format"],
                                       "backend": resume_meta["backend"]}
            run.log(f"resumed from {args.resume} ({resume_meta['format']}, {resume_meta['backend']}, "
                    f"{resume_meta['world_size']} ranks) at step {start}")
        ckpt_extra = {"param_shapes": ckpt.param_shapes(engine.module),
                      "model_config": json.loads(model.config.to_json_string())}
        dtypes.attach(engine)
        updates = UpdateTracker(engine, summary["num_params"])
        locate = partial(state_locations, accelerator=use_cuda, rank=rank,
                         ds_json=job.deepspeed.json if job.deepspeed else None)
        probe_step, probe = start + min(1, t.steps - start - 1), StepProbe(model, locate)  # step 1: Adam's states exist
        vocab = model.config.vocab_size
        run.log(f"model {t.model}: {summary['num_params'] / 1e6:.2f}M params; "
                f"{t.steps} steps x {t.grad_accum} x {t.micro_batch} x {t.seq_len} tokens per rank")

        peak.end_setup()  # the GPU allocator's peak counts training from here (set-up: setup_peak_memory_bytes)
        profiler = StepProfiler(args.out, rank, enabled=args.profile, use_cuda=use_cuda)
        every = max(1, t.steps // 10)
        bar = Progress(t.steps, active=rank == 0, initial=start)
        for step in range(start, t.steps):
            guard.fault_hook(step)  # GUIDE_FAIL_* test hooks; nothing otherwise
            batches = [
                synthetic_batch(step, seed=t.seed, rank=rank, world_size=world_size,
                                micro_batch=t.micro_batch, seq_len=t.seq_len, vocab_size=vocab,
                                micro_step=m, grad_accum=t.grad_accum).to(device)
                for m in range(t.grad_accum)
            ]
            if step == probe_step:
                dtypes.arm()
            updates.before()
            lr = getattr(engine, "current_lr", t.lr)  # a DeepSpeed JSON scheduler moves it
            with Timer(device) as timer:
                loss, grad_norm = engine.train_step(batches, probe if step == probe_step else None)
            peak.sample()
            profiler.step()
            if step == probe_step:
                summary.update(memory_summary(job, probe, peak, summary["num_params"], t.micro_batch))
            dist.all_reduce(loss)
            rec = {"step": step, "loss": loss.item() / world_size, "grad_norm": grad_norm, "lr": lr,
                   "step_time_s": timer.seconds,
                   "tokens_per_s": tokens_per_rank_step / timer.seconds, **updates.after(),
                   "elapsed_s": time.perf_counter() - T0}
            records.append(rec)
            run.step(rec)
            guard.progress(step + 1)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                saved = ckpt.save(engine, job, args.checkpoint_dir, step + 1, ckpt_extra,
                                  fault_hook=lambda s: guard.fault_hook(s, "save"))
                summary["checkpoints"].append(saved)
                run.log(f"saved {saved['path']} ({saved['format']}, {saved['seconds']:.2f} s)")
            if step % every == 0 or step == t.steps - 1:
                with bar.printing():
                    run.log(f"step {step:4d}  loss {rec['loss']:.4f}  grad_norm {grad_norm:.3f}  "
                            f"{rec['step_time_s'] * 1e3:7.1f} ms  {rec['tokens_per_s']:8.0f} tok/s/rank")
            bar.update(rec["loss"], rec["tokens_per_s"])  # after the step line: the bar stays last
        bar.close()
        summary["peak_memory_bytes"], summary["setup_peak_memory_bytes"] = gather(peak.peak), gather(peak.setup_peak)
        summary["dtypes"] = dtypes.result()
        summary["profiled_steps"] = profiler.finish()  # None without --profile
        summary.update(status="completed", steps=len(records), **summarize_steps(records, tokens_per_rank_step))
        summary.update(summary_keys(flops, summary["tokens_per_s_per_rank"], peak_flops, peak_source))
    except BaseException as e:  # noqa: BLE001 - reported by the guard, which ends the process with status 1
        if "bar" in locals():
            bar.close()  # the error block starts on a line of its own
        guard.fail(e)
    mfu = f", MFU {summary['mfu']:.2f}" if summary["mfu"] is not None else ""
    run.log(f"done: final loss {summary['final_loss']:.4f}, median step {summary['step_time_s'] * 1e3:.1f} ms, "
            f"{summary['tokens_per_s_per_rank']:.0f} tokens/s/rank{mfu}; wrote {args.out}")
    guard.finish(lambda: _finish(run, summary))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _finish(run, summary: dict) -> None:
    summary["wall_time_s"] = time.perf_counter() - T0
    run.finish(summary)  # before teardown: a rare abort in destroy_process_group must not lose it


def gather(obj) -> list:
    """One value per rank, in rank order (every rank calls this)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def memory_summary(job, probe, peak, num_params: int, micro_batch: int) -> dict:
    """Per-rank measured state next to the ZeRO model's prediction (summary.json keys)."""
    import torch.distributed as dist

    from .mapping import MODES, mode_key, theory_bytes
    from .offload import totals

    key = mode_key(job)
    shard_group = secondary = None
    grad_bytes = None
    if job.backend == "fsdp" and job.fsdp.sharding.startswith("HYBRID"):
        shard_group = job.fsdp.hybrid_shard_size
    if job.backend == "deepspeed":
        js = job.deepspeed.json
        hpz = int(js.get("zero_optimization", {}).get("zero_hpz_partition_size", 1))
        secondary = hpz if hpz > 1 else None
        if js.get("data_types", {}).get("grad_accum_dtype") == "fp32":
            grad_bytes = 4
    theory = theory_bytes(MODES[key], num_params, dist.get_world_size(), job.mixed_precision,
                          shard_group=shard_group, secondary_group=secondary, grad_dtype_bytes=grad_bytes,
                          model_dtype_bytes=4 if job.train.model_dtype == "fp32" else 2)
    return {
        "mode_key": key,
        "memory_bytes": gather(totals(probe.locations)),  # probe.state + swap files + host fp32 grads
        "memory_location_bytes": gather(probe.locations),
        "memory_theory_bytes": theory,
        "peak_memory_source": peak.source,
        "activation_bytes_per_sample": probe.activations.bytes / micro_batch,
    }


def resolve_job(job, world_size: int) -> tuple[dict, list[str]]:
    """The config as it will run (DeepSpeed "auto" filled); raises ConfigError before anything starts."""
    from .config import ConfigError

    resolved, filled = job.to_dict(), []
    if job.backend == "deepspeed":
        import torch

        from .backends.deepspeed import resolved_ds_config
        from .models import model_config, resolve_model

        hidden = getattr(model_config(resolve_model(job.train.model)), "hidden_size", None)
        try:
            resolved["deepspeed"]["json"], filled = resolved_ds_config(
                job, world_size, hidden, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as e:
            raise ConfigError(f"{job.source}: {e}") from None
        resolved["deepspeed"]["filled"] = filled  # which "auto" values the job filled
    return resolved, filled


def check_observers(job, spec, args) -> None:
    """Bad --profile / wrap-policy input is refused before any rank starts (raises ConfigError)."""
    from .config import ConfigError
    from .profiling import MIN_STEPS

    if args.profile and job.train.steps < MIN_STEPS:
        raise ConfigError(f"--steps = {job.train.steps}: --profile records steps after warm-up and needs "
                          f"--steps >= {MIN_STEPS}")
    if job.backend == "fsdp":
        from .wrap import check_wrap_policy

        check_wrap_policy(job, spec)


def mode_name(job) -> str:
    if job.backend == "fsdp":
        return job.fsdp.sharding
    return f"ZeRO-{job.deepspeed.zero_stage}"


def apply_backend(model, job, device):
    if job.backend == "fsdp":
        from .backends.fsdp import apply_fsdp

        return apply_fsdp(model, job, device)
    from .backends.deepspeed import apply_deepspeed

    return apply_deepspeed(model, job, device)


def _quiet_deepspeed(rank: int) -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)


if __name__ == "__main__":
    code = main()
    # Everything is written and closed. Skip the interpreter's teardown: once in a while a C++
    # communication thread (gloo) still alive at finalization aborts the process ("terminate called
    # without an active exception", SIGABRT), and torchrun would report a finished run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
