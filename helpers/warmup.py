"""Build DeepSpeed's CPU ops once, up front, so no notebook cell waits on gcc.

    python -m helpers.warmup            # what every DeepSpeed CPU job needs, and the NVMe-offload op

What it builds, and what each costs the first time on 2 idle cores:

* ``deepspeed_shm_comm`` (shared-memory collectives; every DeepSpeed CPU job), ~1 min;
* ``async_io`` (Linux async I/O; only NVMe offload, ``launch_configs/deepspeed/zero3_nvme.yaml``),
  ~5 min, and only where libaio's header is installed (``apt-get install libaio-dev``; ``make
  setup`` installs it when run as root). Without it this step is skipped with a note, and the
  offload notebook skips its NVMe run, saying why.

Nothing else is built: the CPU offload configs step a torch AdamW on the host
(``zero_force_ds_cpu_optimizer: false``), so DeepSpeed's ``cpu_adam`` op is never needed.
The builds are cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``);
a second call takes a few seconds. ``make setup`` runs this. On a GPU node DeepSpeed builds
its CUDA ops itself, when first used.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch

    if torch.cuda.is_available():
        print("warmup: a GPU is visible; DeepSpeed builds its CUDA ops when first used")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.perf_counter()
    print("warmup: building DeepSpeed's shared-memory comm op for CPU (cached after the first time)...",
          flush=True)
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
    print(f"warmup: done in {time.perf_counter() - t0:.1f} s")

    from .offload import aio_status

    usable, state = aio_status()
    if not usable:
        print(f"warmup: skipping DeepSpeed's async_io op (NVMe offload): {state}")
        return 0
    t0 = time.perf_counter()
    if state != "built":
        print("warmup: building DeepSpeed's async_io op for NVMe offload (~5 min on 2 cores, once)...", flush=True)
    from deepspeed.ops.op_builder import AsyncIOBuilder

    AsyncIOBuilder().load(verbose=False)
    print(f"warmup: async_io ready in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
