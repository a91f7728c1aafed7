"""Small conveniences for the notebooks' first cell."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from helpers import CHECKOUT
from helpers.nb.plots import use_style

REPO = CHECKOUT
ROOT = REPO  # where jobs run from: the repo, or a working copy (helpers.workcopy) after setup()


def find_root(cwd: Path) -> Path:
    """The working copy a kernel started in (its notebooks/ folder or the copy itself), else the repo."""
    from helpers.nb.workcopy import MARKER

    return next((d for d in (cwd, cwd.parent) if (d / MARKER).is_file()), REPO)


def setup(default_size: str = "full") -> str:
    """Prepare a notebook kernel; return the size knob ("full" or "quick").

    * puts this Python's ``bin/`` first on PATH, so ``%%bash`` cells find the
      same ``torchrun`` and packages as the kernel;
    * one thread per rank (a 2-core laptop runs 2 ranks), quiet DeepSpeed
      warnings, CPU accelerator for DeepSpeed when there is no GPU;
    * the shared figure style;
    * the working directory: the repo, or the working copy the notebook was
      opened from (``make lab``: ``work/``, whose runs and saves git ignores).

    The size comes from ``GUIDE_SIZE`` (``make test`` sets ``quick``).
    """
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no per-rank "Loading weights" bars in outputs
    os.environ.setdefault("GUIDE_PROGRESS", "0")  # a job's step lines are its progress here; no bar lines in outputs
    global ROOT
    ROOT = find_root(Path.cwd())  # a notebook in work/notebooks/ runs from work/: runs land there
    os.chdir(ROOT)  # launch commands use repo-relative paths, like the README
    use_style()
    size = os.environ.get("GUIDE_SIZE", default_size)
    if size not in ("full", "quick"):
        raise ValueError(f"GUIDE_SIZE = {size!r}: allowed values are full, quick")
    return size


CPU_RANKS = 2  # gloo ranks on a machine without a GPU: one per core of the 2-core box the guide is written on


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def nproc(cpu_ranks: int = CPU_RANKS) -> int:
    """Ranks for one job on this machine: one per GPU on a GPU node (nccl), else ``cpu_ranks`` gloo ranks."""
    return gpu_count() or cpu_ranks


def world_sizes(wanted: list[int]) -> list[int]:
    """The rank counts of ``wanted`` this machine can run: all on a CPU (gloo ranks may share cores), those up
    to the number of GPUs on a GPU node (nccl refuses two ranks on one GPU)."""
    gpus = gpu_count()
    return [n for n in wanted if not gpus or n <= gpus]


def bitwise_parity_expected(world_size: int, deterministic: bool = False) -> bool:
    """Whether aligned FSDP and ZeRO-3 should give bit-identical losses at ``world_size`` ranks here.

    On the CPU (gloo) the notebooks measure it at 1, 2 and 4 ranks. On a GPU two conditions (not yet run on one):
    the jobs ran with ``--deterministic`` (without it cuBLAS may pick split-K reductions and SDPA's flash and
    memory-efficient backward add with atomics, so even one backend twice may part in the last bit), and at
    most 2 ranks (under nccl a sum of two values is the same in any order; beyond, NCCL picks ring or tree by
    size and the two backends reduce differently shaped buckets). Otherwise the notebooks check closeness.
    """
    return gpu_count() == 0 or (deterministic and world_size <= 2)


def bitwise_repeat_expected(deterministic: bool = False) -> bool:
    """Whether one backend's run equals itself bit for bit (a resume, activation checkpointing on/off, a rerun
    compared with ``helpers.compare``): always on the CPU; on a GPU only with ``--deterministic`` (see above)."""
    return gpu_count() == 0 or deterministic
