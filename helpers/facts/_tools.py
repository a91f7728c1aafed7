"""Small builders the fact checks share: a one-rank DeepSpeed engine, a one-rank FSDP2 model, source lookups.

Every function here imports its library when called, so that reading the registry costs nothing.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path


def resolve(dotted: str):
    """The object at ``package.module.Class.attr`` (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"nothing importable in {dotted!r}")


def source_has(dotted: str, *snippets: str) -> tuple[bool, dict]:
    """Whether the source of ``dotted`` (a function, class or module) contains every snippet, whitespace-insensitive.

    For behaviour that a small run cannot show on a CPU: the fact then rests on the pinned code's text, and a
    version that rewrites it fails the fact, so that a person reads the new code."""
    src = " ".join(inspect.getsource(_unwrapped(resolve(dotted), dotted.rsplit(".", 1)[-1])).split())
    missing = [s for s in snippets if " ".join(s.split()) not in src]
    return not missing, ({"missing": missing} if missing else {"source has": " | ".join(snippets)})


def _unwrapped(obj, name: str):
    """The function ``name`` a decorator wrapped: ``__wrapped__``, or (DeepSpeed's ``instrument_w_nvtx`` has no
    functools.wraps) the function of that name in the wrapper's closure."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if getattr(obj, "__name__", name) == name:
        return obj
    for cell in getattr(obj, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__name__ == name:
            return inner
    return obj


def field_default(dotted_cls: str, name: str):
    """A pydantic model's or dataclass's default for field ``name``."""
    cls = resolve(dotted_cls)
    if hasattr(cls, "model_fields"):
        return cls.model_fields[name].default
    return cls.__dataclass_fields__[name].default


def messages(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """``fn(*args, **kwargs)``'s result (or the exception it raised) and the warnings and log records it emitted."""
    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root, grab = logging.getLogger(), Grab(level=logging.DEBUG)
    root.addHandler(grab)
    old = root.level
    root.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            try:
                out = fn(*args, **kwargs)
            except Exception as e:  # the exception is the evidence
                out = e
        seen += [str(w.message) for w in ws]
    finally:
        root.removeHandler(grab)
        root.setLevel(old)
    return out, seen


def linear_stack(n: int = 2, width: int = 16, bias: bool = True, dtype=None):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=bias) for _ in range(n)])
    return model.to(dtype) if dtype is not None else model


def ds_engine(zero: dict, *, bf16: bool = True, model=None, **config):
    """``deepspeed.initialize`` on ``model`` (default: two Linear layers) with the torch AdamW the guide's jobs
    pass, one micro-batch of 1, clipping off unless ``config`` says; needs ``helpers.facts.one_rank_group()``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    model = model if model is not None else linear_stack()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "bf16": {"enabled": bf16},
           "zero_optimization": zero, "steps_per_print": 10**12, **config}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def fsdp2(model=None, *, units: bool = True, **fully_shard_kwargs):
    """``fully_shard`` each child (when ``units``) and the root of ``model`` (default: two Linear layers) on a
    one-rank CPU mesh; needs ``helpers.facts.one_rank_group()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = model if model is not None else linear_stack()
    mesh = init_device_mesh("cpu", (1,))
    if units:
        for child in model.children():
            fully_shard(child, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


def scratch(prefix: str) -> Path:
    """A temporary directory for a check that saves something, removed when the checking process ends."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, d, True)
    return d
