"""The run directory: what a job writes, and the one documented schema for it.

A job started with ``--out DIR`` writes, from rank 0 only:

``DIR/config.json``
    The fully resolved job: the parsed launch config, CLI overrides, the
    DeepSpeed JSON with every "auto" filled (and ``deepspeed.filled``: which), world size, device.
``DIR/metrics.jsonl``
    One JSON object per optimizer step, keys in ``STEP_KEYS``.
``DIR/log.txt``
    What rank 0 printed, plus notes from the config translation.
``DIR/summary.json``
    Written atomically (temp file + rename) when the job ends, keys in
    ``SUMMARY_KEYS``. A job that fails writes ``"status": "failed"`` and the
    reason (also when stopped by SIGTERM or --timeout); a job whose rank 0 is
    killed outright (SIGKILL) writes nothing, so a directory without a summary
    is an incomplete run, never a completed one.
``DIR/tensor_trace.jsonl``
    Only with ``--trace-tensors``: per step, an exact fingerprint and the dtype of every
    parameter's weight, local and reduced gradient and update (helpers.job.observe.tensor_trace), which
    ``python -m helpers.compare`` reads.
``DIR/activation_trace.jsonl``
    Only with ``--trace-activations``: per step, rank and micro-batch, an exact fingerprint of every module's
    output and of the gradient reaching it (helpers.job.observe.activation_trace); helpers.compare reads it.
``DIR/error_rank{r}.txt``
    Written by rank ``r`` (any rank) when it fails, times out or is stopped:
    reason, step, where, traceback. Rank 0 reads them to name the failed rank.
``DIR/.lock``
    Held (``flock``) by rank 0 while the job runs, so a second job cannot
    write the same directory (see helpers.job.guard).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

TRACE_FILE = "tensor_trace.jsonl"  # --trace-tensors (helpers.job.observe.tensor_trace; helpers.compare reads it)
ACTIVATION_FILE = "activation_trace.jsonl"  # --trace-activations (helpers.job.observe.activation_trace)
STAGES = ("weight", "grad_local", "grad_reduced", "update")  # a traced step's stages, in the order it makes them
WARMUP_STEPS = 2  # steps left out of the summary's step time (see SUMMARY_KEYS["step_time_s"])

STEP_KEYS = {
    "step": "optimizer step, from 0",
    "loss": "causal-LM loss, mean over the step's micro-batches and over ranks (ranks summed in fp64)",
    "grad_norm": "global L2 norm of the gradients before clipping (fp64, like DeepSpeed)",
    "lr": "learning rate used for the step",
    "step_time_s": "wall time of the step on rank 0 (forward, backward, optimizer)",
    "tokens_per_s": "tokens one rank processed per second in this step",
    "updated_fraction": "share of parameter elements the optimizer step changed, in the tensor it updates "
                        "(FSDP: the shard; DeepSpeed: the fp32 master); all ranks' local shards, summed "
                        "(job.observe.precision.UpdateTracker); null without --track-updates (log.txt says so), "
                        "above 50M params, for DeepSpeed ZeRO 0-2 and with the optimizer on NVMe",
    "updated_fraction_compute": "the same, for the values rounded to the compute dtype (what forward uses)",
    "elapsed_s": "seconds from process start to the end of this step on rank 0; its differences are the whole "
                 "loop's time per step, the harness's own work between steps included (benchmarks/overhead.py)",
}

SUMMARY_KEYS = {
    "status": '"completed" or "failed"',
    "reason": "why a failed run failed (null when completed)",
    "failed_rank": "rank whose failure ended the job (null when completed, and when no one rank is "
                   "known to be at fault: a timeout, a stop signal)",
    "backend": '"fsdp" or "deepspeed"',
    "config": "path of the launch config",
    "mode": "sharding mode, e.g. FULL_SHARD or ZeRO-3",
    "mixed_precision": '"no" or "bf16"',
    "world_size": "number of ranks",
    "num_nodes": "number of nodes (torchrun --nnodes)",
    "model": "--model value",
    "num_params": "parameters of the unsharded model",
    "steps": "optimizer steps run",
    "tokens_per_step": "tokens per optimizer step, all ranks together",
    "losses": "loss of every step (same values as metrics.jsonl)",
    "final_loss": "loss of the last step",
    "step_time_s": f"median step time; the first {WARMUP_STEPS} steps (warm-up) excluded when there are more: "
                   "step 0 pays first-touch allocations, kernel selection and lazily created optimizer state, "
                   "step 1 runs the memory and dtype probes (helpers.job.observe: memory, precision)",
    "tokens_per_s_per_rank": "tokens per second per rank at the median step time",
    "flops_per_token": "model training FLOPs per token, 6 N (N without embeddings) + 12 L H Q T attention "
                       "(helpers.job.observe.throughput)",
    "peak_flops": "peak FLOP/s of one device (rank) in the compute dtype: a GPU table, a CPU matmul measured "
                  "at job start, or --peak-tflops; null for a GPU not in the table",
    "peak_flops_source": "where peak_flops came from (table, measured: how, or --peak-tflops)",
    "mfu": "model FLOPs utilisation: flops_per_token x tokens_per_s_per_rank / peak_flops (null without a peak)",
    "wall_time_s": "seconds from process start to the summary",
    "started_at": "when the process started (seconds since the epoch, rank 0's clock): the order jobs ran in",
    "mode_key": "key of the sharding mode in helpers.core.mapping.MODES (e.g. full_shard, zero3)",
    "memory_bytes": "per rank (list): bytes of params, grads, optimizer_states, master_params held "
                    "after backward, before the optimizer step of step 1 (helpers.job.observe.memory), wherever they "
                    "live (NVMe swap files included); memory_location_bytes says where",
    "memory_location_bytes": "per rank (list): the same bytes split by location, {category: {device, host, "
                             "disk}}: device = accelerator (on a CPU-only run: not offloaded), host = host "
                             "memory the backend offloaded to, disk = this rank's NVMe swap files "
                             "(helpers.job.observe.offload)",
    "swap_buffer_bytes": "per rank (list): bytes of the page-locked host buffers DeepSpeed's NVMe swappers "
                         "hold, {params, optimizer} (0 without NVMe): RAM the swapped state passes "
                         "through, not in memory_bytes (helpers.job.observe.offload.swap_buffer_bytes)",
    "memory_theory_bytes": "the same four categories predicted by the ZeRO model (helpers.core.mapping)",
    "peak_memory_bytes": "per rank (list): peak memory of training, after set-up, checkpoint saves left out "
                         "(see peak_memory_source, save_peak_memory_bytes)",
    "save_peak_memory_bytes": "per rank (list): peak memory of the checkpoint saves (the one after the last step "
                              "included), left out of peak_memory_bytes and peak_tensor_bytes: on GPU "
                              "cuda.max_memory_allocated during the saves, on CPU RssAnon at each save's end "
                              "(a lower bound; RssAnon a save leaves behind still shows in later samples); "
                              "null without saves",
    "setup_peak_memory_bytes": "per rank (list): peak memory of the set-up (build, load, shard); on CPU the "
                               "RssAnon when training starts",
    "peak_memory_source": "cuda.max_memory_allocated on GPU; RssAnon sampled per phase on CPU",
    "peak_tensor_bytes": "per rank (list): peak bytes of the rank's own tensors from the first step through "
                         "step 1, set-up and checkpoint saves excluded; on CPU counted from allocator events "
                         "(identical jobs can differ by ~10%: buffer lifetimes follow gloo's threads; null with "
                         "--profile; helpers.job.observe.tensor_peak)",
    "peak_tensor_source": "profiler memory events (CPU allocator) on CPU; cuda.max_memory_allocated on GPU",
    "activation_bytes_per_sample": "bytes autograd saved for backward in one forward, per sequence (with "
                                   "activation checkpointing: what the checkpointed blocks hold, their inputs)",
    "memory_budget_bytes": "--memory-budget-gib in bytes per rank (null without it); on a GPU the allocator's "
                           "limit, on a CPU compared with peak_tensor_bytes after the probe step",
    "memory_budget_fits": "true: every rank's peak stayed within memory_budget_bytes; false: the job stopped "
                          "because one did not (status failed, reason says which rank); null: no budget",
    "job_key": "sha256 of what decides the result: flags but --out/--reuse, the files they name, ranks, nodes, "
               "host, helpers/ and launch_configs/ (helpers.job.reuse); --reuse DIR copies DIR when it matches",
    "reused_from": "the run directory this run was copied from by --reuse (helpers.job.reuse); null when it ran",
    "reuse_key": "a copy's: the job key the job that asked for --reuse computed from its own flags, files, ranks "
                 "and code (job_key is the source's, copied); null when it ran",
    "deterministic": "true: a GPU job ran with --deterministic (torch.use_deterministic_algorithms, "
                     "CUBLAS_WORKSPACE_CONFIG); false otherwise, and always on a CPU, where it changes nothing",
    "optimizer_impl": "how the optimizer stepped, read from it: for-loop (the default, --optimizer-impl; the "
                      "mode FSDP/DeepSpeed parity holds in), foreach or fused (fewer kernels, for throughput; "
                      "parity not promised), torch-default (a DeepSpeed JSON optimizer: torch picks), null",
    "memory_split_bytes": "per rank (list): the state of memory_bytes' probe split into trainable and frozen, "
                          "each {params, grads, optimizer_states, master_params} in bytes (frozen: weights only; "
                          "all zeros without --peft; helpers.job.observe.memory.state_split)",
    "memory_theory_split_bytes": "the ZeRO model's per-rank bytes, trainable and frozen (helpers.core.mapping."
                                 "job_theory_split): a frozen parameter holds only its weight",
    "peft": "--peft (LoRA): trainable_params and frozen_params (elements, before wrapping) and the LoraConfig as "
            "PEFT writes it (config); null without --peft (helpers.job.lora)",
    "audit": "the post-wrap audit (helpers.job.audit): passed, parameters, numel, trainable_numel, tied (the "
             "names that are one parameter, still one after wrapping) and dtypes (parameters per stored dtype, "
             "each the one the config asks for); null when the job failed before wrapping ended",
    "attn_implementation": "the attention implementation the model runs: the config's choice, else sdpa where the "
                           "model class supports it, else eager (helpers.core.models)",
    "effective": "the settings the job ran with, read from its engine and optimizer (helpers.job.observe.settings): "
                 "attention, optimizer and its hyperparameters, units, prefetch, clipping (max_norm, norm_dtype), "
                 "accumulation, micro-batch, checkpoint format, offload, unit input casting",
    "activation_checkpointing": "null, or the one mechanism that recomputes activations, e.g. \"fsdp "
                                "checkpoint_wrapper per LlamaDecoderLayer (2 blocks)\" or \"transformers "
                                "gradient_checkpointing (2 blocks)\" (helpers.job.recompute)",
    "dtypes": "dtype of one parameter (param) at each stage of a step, read from the live objects on "
              "rank 0: loaded, stored_param, master_param, optimizer_param, forward_weight, "
              "grad_before_reduce, reduce_dtype, stored_grad, optimizer_grad, optimizer_states "
              "(helpers.job.observe.precision.DtypeProbe)",
    "profiled_steps": "steps recorded by --profile in DIR/trace_rank{r}.json (helpers.job.observe.profiling); "
                      "null without --profile",
    "device": '"cpu" or the GPU name',
    "dist_backend": '"gloo" or "nccl"',
    "versions": "torch, deepspeed, transformers versions",
    "checkpoints": "checkpoints this job saved (list): step, path, format (sharded | full | deepspeed), "
                   "seconds (rank 0, barrier to barrier), bytes on disk, saved_dtypes, seconds_16bit (DeepSpeed "
                   "save_16bit_model, or null); with --peft also adapter (and with --save-naive-adapter "
                   "adapter_naive): tensors, numel and empty, what was written (helpers.job.checkpoint)",
    "resumed_from": "null, or the checkpoint the job started from: path, step, format, backend",
    "loading": "null (random init), or for --model DIR: method (naive | fsdp_ram_efficient | zero3_init), "
               "path, ranks (per rank: seconds, peak_rss_anon_bytes and peak_rss_file_bytes above the "
               "start, after_rss_anon_bytes, from model creation until the weights are sharded: through the "
               "backend's sharding for naive and fsdp_ram_efficient, through from_pretrained for zero3_init), "
               "weights_match (every rank's piece of every parameter equals, element by element, the same "
               "slice of the file, rounded to the load dtype), mismatched (the first 5 names that do not) "
               "(helpers.loading)",
}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    """Rank 0's writer for one run directory. Other ranks get a RunDir that writes nothing."""

    RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "log.txt")

    def __init__(self, path: str | os.PathLike, active: bool):
        self.path, self.active = Path(path), active
        self._metrics = self._log = None

    def start(self, config: dict) -> None:
        """Empty the directory (if it is an earlier run of ours), then write config.json."""
        if not self.active:
            return
        p = self.path
        # the job's lock and the other ranks' error reports stay (helpers.job.guard)
        old = [c for c in p.iterdir() if c.name != ".lock" and not c.name.startswith("error_rank")] \
            if p.is_dir() else []
        if old:
            if not (p / "config.json").exists():
                raise FileExistsError(
                    f"--out {p}: directory exists, is not empty and is not a run directory; "
                    "pick a new path so nothing else is overwritten"
                )
            for c in old:
                shutil.rmtree(c) if c.is_dir() and not c.is_symlink() else c.unlink()
        p.mkdir(parents=True, exist_ok=True)
        _atomic_write(p / "config.json", json.dumps(config, indent=2, default=str))
        self._metrics = open(p / "metrics.jsonl", "w")
        self._log = open(p / "log.txt", "w")

    def log(self, line: str, echo: bool = True) -> None:
        if not self.active:
            return
        if echo:
            print(line, flush=True)
        if self._log:
            self._log.write(line + "\n")
            self._log.flush()

    def step(self, record: dict) -> None:
        if self._metrics:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def finish(self, summary: dict) -> None:
        """Write summary.json atomically; every key must be in SUMMARY_KEYS."""
        if not self.active:
            return
        unknown = set(summary) - set(SUMMARY_KEYS)
        assert not unknown, f"undocumented summary keys: {sorted(unknown)}"
        for f in (self._metrics, self._log):
            if f:
                f.close()
        if self.path.is_dir():
            _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2))


def summarize_steps(records: list[dict], tokens_per_rank_step: int) -> dict:
    """Median step time (the first WARMUP_STEPS excluded when there are more) and the tokens/s it implies."""
    times = [r["step_time_s"] for r in records]
    steady = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times[-1:]
    median = statistics.median(steady) if steady else float("nan")
    return {
        "losses": [r["loss"] for r in records],
        "final_loss": records[-1]["loss"] if records else None,
        "step_time_s": median,
        "tokens_per_s_per_rank": tokens_per_rank_step / median if steady else None,
    }


class Timer:
    """Wall time of a block; waits for the GPU so asynchronous kernels are counted."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.t0

    def _sync(self):
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
