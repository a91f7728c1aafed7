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

``python -m helpers.X`` with a Python that lacks the guide's packages (``/usr/bin/python3`` outside the venv)
stops here, before X is imported, with one line saying to activate the venv (``require_venv``).
"""

import importlib.util
import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
# The import names of pyproject.toml's dependencies (pyyaml is yaml); tests/test_papercuts.py keeps them in step.
PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "peft", "safetensors", "yaml", "numpy", "pandas",
            "matplotlib", "tqdm")


def missing_packages() -> list[str]:
    """The guide's packages this Python cannot import (found without importing them)."""
    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


def require_venv() -> None:
    """Exit 2 with one line when this Python lacks the guide's packages: the venv is not active."""
    missing = missing_packages()
    if not missing:
        return
    venv = CHECKOUT / ".venv"
    shown = ".venv" if Path.cwd() == CHECKOUT else str(venv)
    todo = (f"activate its venv first: source {shown}/bin/activate" if (venv / "bin" / "python").exists() else
            f"run make setup first (it creates {shown}), then source {shown}/bin/activate")
    names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    print(f"error: {sys.executable} lacks the guide's packages ({names}): {todo}", file=sys.stderr)
    sys.exit(2)


# While `python -m helpers.X` looks for X, sys.argv[0] is "-m" (Python's documented behaviour): every command
# of the guide checks its Python here, before X's own imports can fail with a traceback.
if sys.argv[:1] == ["-m"]:
    require_venv()

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
