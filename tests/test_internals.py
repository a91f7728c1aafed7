"""Every private library API helpers reads (helpers.core.internals.PRIVATE_APIS) is still in the installed libraries,
and no other module of helpers uses a private name directly."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported (see helpers.set_ds_accelerator)

from helpers.core import internals  # noqa: E402

HELPERS = Path(internals.__file__).resolve().parent.parent


def _sets_on_objects(cls: type, attr: str) -> bool:
    """Does ``cls`` (or a base) declare ``attr`` for its objects: an annotation or an assignment in its source?"""
    assigned = re.compile(rf"self\.{attr}\s*(:[^=\n]+)?=(?!=)|__setattr__\(\s*['\"]{attr}['\"]")
    for klass in cls.__mro__:
        if attr in klass.__dict__.get("__annotations__", {}):
            return True
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):  # a class without Python source (C++, builtins)
            continue
    return False


def resolve(where: str) -> None:
    """Raise LookupError saying what is missing, unless ``where`` (see internals.reads) is in the library."""
    if "#" in where:
        module, text = where.split("#", 1)
        if text not in inspect.getsource(importlib.import_module(module)):
            raise LookupError(f"{text!r} is no longer in the source of {module}")
        return
    module, path = where.split(":")
    obj = importlib.import_module(module)
    parts = path.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif i == len(parts) - 1 and isinstance(obj, type) and _sets_on_objects(obj, part):
            return
        else:
            raise LookupError(f"{module}.{'.'.join(parts[:i + 1])} is gone")


@pytest.mark.parametrize(("library", "where", "user"), internals.PRIVATE_APIS,
                         ids=[w for _, w, _ in internals.PRIVATE_APIS])
def test_private_api_is_still_there(library, where, user):
    assert hasattr(internals, user), f"PRIVATE_APIS names internals.{user}, which does not exist"
    try:
        resolve(where)
    except (LookupError, ImportError) as e:
        pytest.fail(f"{library} {importlib.metadata.version(library)}: private API {where} changed ({e}); "
                    f"helpers.core.internals.{user} reads it (read from the version in internals' docstring)")


def test_the_check_catches_a_missing_name():
    for where in ("torch.nn:Module._no_such_attribute", "torch.nn#no such text", "torch._no_such_module:x"):
        with pytest.raises((LookupError, ImportError)):
            resolve(where)


def _private_names() -> set[str]:
    """The underscore names PRIVATE_APIS lists (attributes and module parts), as they would be written in code."""
    out = set()
    for _, where, _ in internals.PRIVATE_APIS:
        words = re.split(r"[.:#\s=\"]+", where)
        out |= {w for w in words if w.startswith("_") and not w.startswith("__")}
    return out


def test_only_internals_uses_private_names():
    names, hits = _private_names(), []
    for path in sorted(HELPERS.rglob("*.py")):
        rel = path.relative_to(HELPERS.parent)
        if rel.parts[1] == "facts" or path.name == "internals.py":
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NAME and tok.string in names:
                hits.append(f"{rel}:{tok.start[0]}: {tok.string}")
            elif tok.type == tokenize.STRING and any(re.search(rf"['\"]{n}['\"]", tok.string) for n in names):
                hits.append(f"{rel}:{tok.start[0]}: {tok.string}")
    assert not hits, "private library names used outside helpers/core/internals.py:\n" + "\n".join(hits)
