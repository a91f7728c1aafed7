"""The guide's helpers: job entry, backends, measurements, plots.

DeepSpeed JIT-builds its CPU ops into ``$TORCH_EXTENSIONS_DIR``; torch's default,
``~/.cache/torch_extensions``, is shared by every checkout of a user. Two checkouts (two
``.venv`` paths) compile different command lines into the same build directory, so each
rebuilds the op (half a minute or more, inside a job) whenever a job of the other ran in between.
Unless it is set, each checkout builds into its own ``build/torch_extensions`` (git ignores it).

The build runs the first ``ninja`` on ``PATH``. The venv has its own (a pip dependency of
DeepSpeed); a machine may have another (``/usr/bin/ninja``, an older version). Two ninja versions
write build logs the other cannot read, and each then rebuilds the op from scratch: ``async_io``
took minutes inside CI's tests after the warmup had built it with the other ninja. So the venv's
``bin`` (where this Python lives) goes first on ``PATH`` when it has a ninja, whether or not the
venv is activated.
"""

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(CHECKOUT / "build" / "torch_extensions"))

_BIN = os.path.dirname(sys.executable)
if os.path.exists(os.path.join(_BIN, "ninja")) and os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


def set_ds_accelerator(cpu: bool | None = None) -> None:
    """Tell DeepSpeed its accelerator, unless ``DS_ACCELERATOR`` is set already: "cpu" when ``cpu`` (default:
    when torch sees no GPU), else "cuda".

    DeepSpeed reads the variable once, at its first ``get_accelerator()``, which importing most of it (or
    transformers, which imports it when installed) triggers; so this runs before DeepSpeed is imported. Unset
    on a CPU-only machine, DeepSpeed guesses the CPU and says so with a warning on every rank."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if cpu else "cuda")
