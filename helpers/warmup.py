"""Build DeepSpeed's CPU ops once, up front, so no notebook cell waits on gcc.

    python -m helpers.warmup            # what every DeepSpeed CPU job needs (make setup runs this)
    python -m helpers.warmup --nvme     # also the NVMe-offload op (before a workshop, say)

What it builds, and what each costs the first time on 2 idle cores:

* ``deepspeed_shm_comm`` (shared-memory collectives; every DeepSpeed CPU job), about 30 s;
* with ``--nvme``: ``async_io`` (Linux async I/O; only NVMe offload,
  ``launch_configs/deepspeed/zero3_nvme.yaml``), ~1 min (mostly built as one file, without debug info:
  ``helpers.job.ops._aio_builder``), and only where libaio's header is
  installed (``apt-get install libaio-dev``; ``make setup`` installs it when run as root). Without
  ``--nvme`` the first NVMe job builds it, saying so, before its ``--timeout`` clock starts
  (``helpers.job.ops.build_aio``). Without libaio the offload notebook skips its NVMe run, saying why.

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

import argparse
import contextlib
import io
import sys

from helpers import set_ds_accelerator
from helpers.job.ops import clear_stale_locks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.warmup", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nvme", action="store_true", help="also build the NVMe-offload op (async_io)")
    nvme = parser.parse_args(argv).nvme
    import torch

    if torch.cuda.is_available():
        print("warmup: a GPU is visible; DeepSpeed builds its CUDA ops when first used")
        return 0
    set_ds_accelerator(cpu=True)
    for note in clear_stale_locks():
        print(f"warmup: {note}")
    print(f"warmup: DeepSpeed's shared-memory comm op: {shm_op()}")

    from helpers.job.ops import AIO_OP, aio_status, load_aio, timed_load

    usable, state = aio_status()
    if not usable:
        print(f"warmup: skipping DeepSpeed's async_io op (NVMe offload): {state}" if nvme else
              f"warmup: NVMe offload unavailable: {state}")
        return 0
    if not nvme:
        print(f"warmup: DeepSpeed's async_io op (NVMe offload only): {'already built' if state == 'built' else state}")
        return 0
    if state != "built":
        print("warmup: building DeepSpeed's async_io op for NVMe offload (~1 min on 2 cores, once)...", flush=True)
    print(f"warmup: DeepSpeed's async_io op (NVMe offload): {timed_load(AIO_OP, load_aio)[1]}")
    return 0


def shm_op() -> str:
    """Load DeepSpeed's shared-memory comm op, building it when it is not built yet; what happened, in words."""
    from deepspeed.comm.torch import build_shm_op

    from helpers.job.ops import OPS, built, timed_load

    if not built(OPS[0]):
        print("warmup: building DeepSpeed's shared-memory comm op for CPU (about 30 s on 2 cores, once)...",
              flush=True)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # DeepSpeed says "built successfully" when it only loads a built op too
        module, what = timed_load(OPS[0], build_shm_op)
    print("".join(ln for ln in said.getvalue().splitlines(True)
                  if "built successfully" not in ln and not ln.startswith("Time to load")), end="")
    return what if module is not None else "not available here (DeepSpeed finds it incompatible with this machine)"


if __name__ == "__main__":
    sys.exit(main())
