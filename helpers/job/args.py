"""The job's command line (``python -m helpers.train --help``): flags, their one-line errors, and which
flags override the launch config."""

from __future__ import annotations

import argparse
import math

from helpers.core.cli import OneLineParser

OVERRIDES = ("model", "steps", "lr", "seed", "micro_batch", "seq_len", "grad_accum", "grad_clip", "timeout",
             "model_dtype", "compile", "optimizer_impl")  # the flags that override the launch config (helpers.config)



def positive_number(flag: str, rule: str):
    """argparse type for a flag that takes a finite number > 0; bad input names the flag, the value and ``rule``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{flag} = {text!r}: must be {rule}")
        return value

    return parse


PEAK_TFLOPS = positive_number("--peak-tflops", "a number of TFLOPS > 0, the device's dense peak in the compute "
                              "dtype (e.g. 312 for an A100 in bf16)")
BUDGET_GIB = positive_number("--memory-budget-gib", "a number of GiB > 0 (the tensor memory each rank may use, "
                             "e.g. 0.5)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(prog="python -m helpers.train",
                 description="The job entry point: one code path for 1 rank, N ranks and N nodes.")
    ap.add_argument("--config", required=True, help="Accelerate-format YAML (launch_configs/...)")
    ap.add_argument("--out", required=True, help="run directory to write")
    ap.add_argument("--reuse", metavar="DIR", help="a completed run of this same job in DIR (same flags but "
                    "--out, same files, ranks, host and code) is copied to --out instead of training again; "
                    "otherwise the job runs and a note: says why (helpers.job.reuse)")
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
    ap.add_argument("--peak-tflops", type=PEAK_TFLOPS, help="the device's peak TFLOPS for MFU (default: "
                    "a table of GPUs; measured on a CPU), see helpers.job.observe.throughput")
    ap.add_argument("--optimizer-impl", help="how AdamW steps on both backends: for-loop (default; the parity "
                    "mode, FSDP and DeepSpeed give the same bits), foreach or fused (fewer kernels, for fair "
                    "throughput on a GPU; parity not promised)")
    ap.add_argument("--compile", action="store_true", default=None,
                    help="torch.compile: each transformer block (FSDP2) or the engine (DeepSpeed)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler trace per rank of a few steps "
                    "after warm-up into the run directory (helpers.job.observe.profiling)")
    ap.add_argument("--trace-tensors", action="store_true", help="exact fingerprint of every parameter's weight, "
                    "gradient (before and after reduction) and update per step into DIR/tensor_trace.jsonl "
                    "(helpers.job.observe.tensor_trace; python -m helpers.compare reads it)")
    ap.add_argument("--trace-activations", action="store_true", help="exact fingerprint of every module's output "
                    "and output gradient per step, rank and micro-batch into DIR/activation_trace.jsonl "
                    "(helpers.job.observe.activation_trace): helpers.compare names the first module that differs")
    ap.add_argument("--peft", help="LoRA fine-tuning: a LoRA config as PEFT writes it (adapter_config.json, a "
                    "directory holding one, or a JSON file with its keys); the base is frozen, only the adapter "
                    "trains, and checkpoints also hold it in PEFT's format (helpers.job.lora)")
    ap.add_argument("--save-naive-adapter", action="store_true", help="with --peft and --checkpoint-dir: also "
                    "write DIR/step_K/adapter_naive/, what a plain save on rank 0 writes without gathering "
                    "(empty tensors under ZeRO-3, rank 0's shard under FSDP): the trap, shown")
    ap.add_argument("--checkpoint-dir", help="save checkpoints to DIR/step_K (see helpers.job.checkpoint)")
    ap.add_argument("--checkpoint-every", type=int, help="save every K steps (needs --checkpoint-dir)")
    ap.add_argument("--resume", help="checkpoint DIR/step_K to continue from; --steps stays the total")
    ap.add_argument("--memory-budget-gib", type=BUDGET_GIB, help="tensor memory per rank, in GiB: on a GPU the "
                    "allocator's limit (an out-of-memory stops the job with one line), on a CPU checked against "
                    "peak_tensor_bytes after step 1 (helpers.job.observe.tensor_peak)")
    ap.add_argument("--track-updates", action="store_true", help="updated_fraction per step in metrics.jsonl "
                    "(helpers.job.observe.precision.UpdateTracker: copies every shard each step; null without it)")
    ap.add_argument("--deterministic", action="store_true", help="on a GPU: torch.use_deterministic_algorithms"
                    "(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8, so a rerun, a resume or the aligned pair can be bit "
                    "for bit (SDPA's flash and memory-efficient backward then take their deterministic paths); "
                    "costs speed (slower attention and embedding backward) and a little memory (cuBLAS workspaces); "
                    "on a CPU the guide's ops are deterministic already and it changes nothing")
    return ap.parse_args(argv)
