"""Build DeepSpeed's CPU ops once, up front, so no notebook cell waits on gcc.

    python -m helpers.warmup            # what every DeepSpeed CPU job needs (make setup runs this)
    python -m helpers.warmup --nvme     # also the NVMe-offload op (before a workshop, say)

What it builds, and what each costs the first time on 2 idle cores:

* ``deepspeed_shm_comm`` (shared-memory collectives; every DeepSpeed CPU job), about 30 s;
* with ``--nvme``: ``async_io`` (Linux async I/O; only NVMe offload,
  ``launch_configs/deepspeed/zero3_nvme.yaml``), ~1 min (mostly built as one file, without debug info:
  ``helpers.offload._aio_builder``), and only where libaio's header is
  installed (``apt-get install libaio-dev``; ``make setup`` installs it when run as root). Without
  ``--nvme`` the first NVMe job builds it, saying so, before its ``--timeout`` clock starts
  (``helpers.offload.build_aio``). Without libaio the offload notebook skips its NVMe run, saying why.

Nothing else is built: the CPU offload configs step a torch AdamW on the host
(``zero_force_ds_cpu_optimizer: false``), so DeepSpeed's ``cpu_adam`` op is never needed.
The builds are cached under ``$TORCH_EXTENSIONS_DIR`` (default: the checkout's ``build/torch_extensions``);
a second call takes a few seconds. On a GPU node DeepSpeed builds its CUDA ops itself, when
first used.

A build that was interrupted leaves a ``lock`` file that would make every later job wait on it
for ever: this step, and every DeepSpeed CPU job, removes such a lock first
(``clear_stale_locks``) and says so.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

AIO_OP = "async_io_guide"  # DeepSpeed's async_io op as helpers.offload builds it (one file, no debug info)
OPS = ("deepspeed_shm_comm", AIO_OP)  # the CPU ops built here (names of their build dirs)


def clear_stale_locks(names=OPS, min_age_s: float = 60.0) -> list[str]:
    """Remove the build locks that an interrupted op build left behind; returns a note per lock removed.

    torch builds an op under a ``lock`` file in its build directory and removes it when done. A build that
    is interrupted (a notebook cell stopped during the first NVMe job, a killed job) leaves the file, and
    every later job that needs the op waits on it for ever. A lock is stale when no process works in that
    directory (ninja and the compilers run there) and it is older than ``min_age_s`` (the time between
    taking the lock and starting ninja)."""
    from torch.utils.cpp_extension import _get_build_directory

    notes = []
    for name in names:
        d = Path(_get_build_directory(name, verbose=False))
        lock = d / "lock"
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age < min_age_s or _someone_works_in(d):
            continue
        lock.unlink(missing_ok=True)
        notes.append(f"removed {lock}: left by an interrupted build of DeepSpeed's {name} op "
                     f"({age / 60:.0f} min old, no build running); DeepSpeed checks or rebuilds the op now")
    return notes


def _someone_works_in(d: Path) -> bool:
    """Is any process's working directory ``d``? (Linux /proc; elsewhere assume yes: never remove.)"""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return True
    target = os.path.realpath(d)
    for p in proc.iterdir():
        if p.name.isdigit():
            try:
                if os.readlink(p / "cwd") == target:
                    return True
            except OSError:  # gone, or not ours to read
                continue
    return False


def main() -> int:
    import torch

    if torch.cuda.is_available():
        print("warmup: a GPU is visible; DeepSpeed builds its CUDA ops when first used")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for note in clear_stale_locks():
        print(f"warmup: {note}")
    t0 = time.perf_counter()
    print("warmup: building DeepSpeed's shared-memory comm op for CPU (cached after the first time)...",
          flush=True)
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
    print(f"warmup: done in {time.perf_counter() - t0:.1f} s")

    from .offload import aio_status

    usable, state = aio_status()
    if "--nvme" not in sys.argv[1:]:
        print(f"warmup: DeepSpeed's async_io op (NVMe offload only): {state}" if usable else
              f"warmup: NVMe offload unavailable: {state}")
        return 0
    if not usable:
        print(f"warmup: skipping DeepSpeed's async_io op (NVMe offload): {state}")
        return 0
    t0 = time.perf_counter()
    if state != "built":
        print("warmup: building DeepSpeed's async_io op for NVMe offload (~1 min on 2 cores, once)...", flush=True)
    from .offload import load_aio

    load_aio()
    print(f"warmup: async_io ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
