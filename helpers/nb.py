"""Small conveniences for the notebooks' first cell."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .plots import use_style

REPO = Path(__file__).resolve().parent.parent


def setup(default_size: str = "full") -> str:
    """Prepare a notebook kernel; return the size knob ("full" or "quick").

    * puts this Python's ``bin/`` first on PATH, so ``%%bash`` cells find the
      same ``torchrun`` and packages as the kernel;
    * one thread per rank (a 2-core laptop runs 2 ranks), quiet DeepSpeed
      warnings, CPU accelerator for DeepSpeed when there is no GPU;
    * the shared figure style.

    The size comes from ``GUIDE_SIZE`` (``make test`` sets ``quick``).
    """
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    os.chdir(REPO)  # launch commands use repo-relative paths, like the README
    use_style()
    size = os.environ.get("GUIDE_SIZE", default_size)
    if size not in ("full", "quick"):
        raise ValueError(f"GUIDE_SIZE = {size!r}: allowed values are full, quick")
    return size


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
