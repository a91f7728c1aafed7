"""Short dtype names, as the guide writes them (summary.json, traces, log lines): torch.bfloat16 -> "bf16".

Keyed by ``str(dtype)``, so importing this module does not import torch (helpers.train's argument
parser imports modules that use it)."""

from __future__ import annotations

SHORT = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64"}


def short(dtype) -> str | None:
    """torch.bfloat16 -> "bf16", torch.int64 -> "int64"; None stays None."""
    return None if dtype is None else SHORT.get(str(dtype), str(dtype).replace("torch.", ""))
