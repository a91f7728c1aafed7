"""Build DeepSpeed's CPU ops once, up front, so no notebook cell waits on gcc.

    python -m helpers.warmup            # what every DeepSpeed CPU job needs (~1 min the first time)

The builds are cached under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``); a second call takes a second or two. ``make
setup`` runs this. On a GPU node DeepSpeed builds its CUDA ops itself.
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
