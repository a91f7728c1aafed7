"""Throughput and MFU: how much of the device a job's training steps use.

MFU (model FLOPs utilisation) = model FLOPs per token x tokens per second per
device / the device's peak FLOPs. The model FLOPs are what the model needs
(a formula, below), not what the hardware happened to execute (no recompute,
no padding, no optimizer), so MFU compares fairly across backends and
machines. ``helpers.train`` writes ``flops_per_token``, ``peak_flops``,
``peak_flops_source`` and ``mfu`` into ``summary.json``.

**FLOPs per token** (training: forward + backward) = ``6 N + 12 L H Q T``
(PaLM, appendix B; nanoGPT and torchtitan count the same way):

* ``6 N``: each weight does one multiply-add (2 FLOPs) per token forward and
  two backward (gradient of the input and of the weight). **N excludes the
  embedding tables** (``nn.Embedding``: token, and positions where a model
  has them): a lookup does no arithmetic, and in the guide's small presets
  the token embedding is 15-22% of the parameters, so counting it would
  inflate MFU by as much. N **includes the output projection** (``lm_head``):
  hidden x vocab multiply-adds per token, a real matmul (15% of ``medium``'s
  FLOPs) - also when it is tied to the embedding, then counted once.
  Norm weights are in N too (a rounding error).
* ``12 L H Q T``: attention scores ``QK^T`` and the weighted sum ``AV``, 2
  matmuls of ``H`` heads x head dim ``Q`` over ``T`` positions, per layer
  ``L``: 2 x 2 x H Q T forward, twice that backward. Not halved for the
  causal mask, as in PaLM, so numbers compare with published MFUs.

**Peak** (per device = per rank): on a GPU, the dense peak in the compute dtype
from ``GPU_PEAK_TFLOPS`` by device name (bf16 tensor cores; for an fp32 job plain
fp32, as torch keeps TF32 off by default, or TF32 = half the bf16 peak when it is
switched on); on a CPU, measured at job start by
``measure_cpu_peak``: rank 0 alone (the others wait) times a square matmul
in the job's compute dtype on the job's threads (``OMP_NUM_THREADS``, 1 in
the guide), best of a few calls over ``CPU_BENCH_SECONDS``. ``--peak-tflops``
overrides both (a GPU that is not in the table).
"""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING

from helpers.core.dtypes import short

if TYPE_CHECKING:  # torch is imported where it is used: train.py's argument parser imports this module
    import torch

# Dense (no sparsity) peak per GPU, TFLOPS, from the vendors' data sheets: (bf16 tensor cores, plain fp32;
# None where the sheet gives none we trust). First match wins, so the specific names come before the general
# ones. fp32 matters: torch runs fp32 matmuls in true fp32 by default (TF32 off), about 15x below bf16 on an
# H100. Extend it, or pass --peak-tflops.
GPU_PEAK_TFLOPS: list[tuple[str, float | None, float | None]] = [
    (r"\bMIG\b", None, None),  # a MIG slice ("NVIDIA H200 MIG 3g.71gb") has a fraction of the SMs: pass --peak-tflops
    (r"\bGH200\b", 989.0, 67.0),
    (r"\bH200\b.*\bNVL\b", 835.0, 60.0),  # the PCIe card: lower clocks and power than the SXM module
    (r"\bH200\b", 989.0, 67.0),
    (r"\bH100\b.*\bPCIe\b", 756.0, 51.0),
    (r"\bH100\b.*\bNVL\b", 835.0, 60.0),
    (r"\bH100\b", 989.0, 67.0),  # SXM (the name reads e.g. "NVIDIA H100 80GB HBM3")
    (r"\bH800\b", 989.0, 67.0),
    (r"\bA100\b", 312.0, 19.5),
    (r"\bA800\b", 312.0, 19.5),
    (r"\bL40S\b", 362.0, 91.6),
    (r"\bL4\b", 121.0, 30.3),
    (r"\bA10\b", 125.0, 31.2),
    (r"\bB200\b", 2250.0, None),
    (r"\bMI300X\b", 1307.0, 163.4),
]

CPU_BENCH_N = 512  # square matmul size: big enough for the best kernel, short in bf16 on a CPU without bf16 units
CPU_BENCH_SECONDS = 0.1  # best of ~80 calls: within 1% of a 0.5 s run on a 2-core box, 0.4 s less per job


def _numel(p) -> int:
    """Elements of a parameter, also when ZeRO-3 init has already partitioned it (``ds_numel``)."""
    return getattr(p, "ds_numel", p.numel())


def embedding_params(model: torch.nn.Module) -> int:
    """Elements of the embedding tables (lookups, no FLOPs), except a table shared with the output layer."""
    import torch

    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shared = {id(out.weight)} if out is not None else set()
    return sum(_numel(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
               for p in m.parameters(recurse=False) if id(p) not in shared)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> int:
    """Training FLOPs per token: 6 N (N without embeddings) + 12 L H Q T (see the module docstring)."""
    cfg = model.config
    n = sum(_numel(p) for p in model.parameters()) - embedding_params(model)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 6 * n + 12 * cfg.num_hidden_layers * heads * head_dim * seq_len


def gpu_peak(name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOPs of a GPU named ``name`` (torch.cuda.get_device_name) in ``dtype`` ("bf16" or "fp32";
    "tf32": half the bf16 tensor-core peak), or None if unknown."""
    for pattern, bf16, fp32 in GPU_PEAK_TFLOPS:
        if re.search(pattern, name):
            tflops = {"bf16": bf16, "fp32": fp32, "tf32": bf16 / 2 if bf16 else None}[dtype]
            return tflops * 1e12 if tflops else None
    return None


def cuda_matmul_dtype(dtype: torch.dtype) -> str:
    """What a matmul in ``dtype`` runs as on a GPU: bf16, fp32, or tf32 (fp32 with TF32 switched on)."""
    import torch

    if dtype != torch.float32:
        return "bf16"
    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def measure_cpu_peak(dtype: torch.dtype, seconds: float = CPU_BENCH_SECONDS, n: int = CPU_BENCH_N) -> float:
    """Best FLOP/s of an n x n matmul (``F.linear``, the op a Linear layer runs) on this process's threads."""
    import torch

    x, w = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    flops = 2 * n**3
    torch.nn.functional.linear(x, w)  # first call: kernel selection, page faults
    best, calls, t_end = 0.0, 0, time.perf_counter() + seconds
    while calls < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = max(best, flops / (time.perf_counter() - t0))
        calls += 1
    return best


def device_peak(device: torch.device, dtype: torch.dtype, override_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s per device, where it came from). Call on every rank: on a CPU rank 0 measures alone."""
    import torch

    if override_tflops is not None:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    if device.type == "cuda":
        name, kind = torch.cuda.get_device_name(device), cuda_matmul_dtype(dtype)
        peak = gpu_peak(name, kind)
        if peak is None:
            return None, (f"no dense {kind} peak for GPU {name!r} in helpers.job.observe.throughput.GPU_PEAK_TFLOPS; "
                          "pass --peak-tflops")
        return peak, f"table: {name}, dense {kind}"
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if ranks > 1:
        dist.barrier()  # everyone is past start-up: rank 0 measures a quiet machine
    peak = measure_cpu_peak(dtype) if not dist.is_initialized() or dist.get_rank() == 0 else None
    if ranks > 1:
        dist.barrier()
    return peak, (f"measured: {CPU_BENCH_N}x{CPU_BENCH_N} {short(dtype)} matmul, {torch.get_num_threads()} thread(s), "
                  "rank 0 alone, best call")


def fmt_flops(flops: float) -> str:
    """``2.55 GFLOP/s``, ``989 TFLOP/s``."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP/s"


def compute_dtype(job) -> torch.dtype:
    """The dtype the matmuls run in: bf16 with mixed precision or a bf16 model, else fp32."""
    import torch

    return torch.bfloat16 if job.mixed_precision == "bf16" or job.train.model_dtype == "bf16" else torch.float32


def summary_keys(flops: int, tokens_per_s_per_rank: float | None, peak: float | None, source: str) -> dict:
    """summary.json's throughput keys (see helpers.core.metrics.SUMMARY_KEYS)."""
    mfu = None
    if peak and tokens_per_s_per_rank and math.isfinite(tokens_per_s_per_rank):
        mfu = flops * tokens_per_s_per_rank / peak
    return {"flops_per_token": flops, "peak_flops": peak, "peak_flops_source": source, "mfu": mfu}
