"""What the guide says about torch, DeepSpeed, Accelerate and transformers, each checked against that library.

A sentence about a library (which class runs, a default, what a key does, what a save writes) is a *fact*:
an id, the sentence as the guide says it, the library and the version it was read from, where in that
library's source it lives, and a check that returns the evidence (a class name, a default, a warning, the
files a save writes). Facts live in one folder per library, one module per part of the guide
(``helpers/facts/deepspeed/precision_offload.py``, ...). A notebook
prints a fact's evidence next to the sentence that rests on it::

    facts.show("deepspeed.zero0_bf16_optimizer")

prints ``✓ DeepSpeed runs ZeRO-0 + bf16 through FP16_UnfusedOptimizer ... [optimizer=FP16_UnfusedOptimizer]``
with the library, version and source location, and raises ``FactFailed`` naming the fact and its sentence
when the installed library no longer behaves so: after a version bump, ``make test`` (tests/test_library_facts.py)
lists every sentence to rewrite. A fact that needs a GPU says so and is printed as "not run here".

Checks that only read the library (defaults, signatures, source) and checks that build something (a DeepSpeed
engine, an FSDP module, a checkpoint: ``runs=True``, with a one-rank gloo group) run together in one subprocess
(``python -m helpers.facts --json ID ...``), so that no library's warning lands in a notebook's output; their
verdicts are cached in ``build/facts/`` under a key made of the installed versions and these files' text, so a
notebook pays for them once per change (``make test`` checks them all first).

``python -m helpers.facts`` checks every fact and prints one line each (exit 1 when one fails).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

LIBRARIES = ("torch", "deepspeed", "accelerate", "transformers", "peft")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent  # the checkout: launch_configs/ and build/ are here
CACHE = REPO / "build" / "facts"


class FactFailed(AssertionError):
    """A sentence the guide says about a library no longer holds for the installed library."""


@dataclass(frozen=True)
class Fact:
    id: str
    says: str  # the sentence, as the guide says it
    library: str  # a distribution name (LIBRARIES)
    checked_on: str  # the version whose source the sentence was read from
    where: str  # the library's module and function that decide it
    check: Callable[[], tuple[bool, dict]] | None = field(repr=False, compare=False, default=None)
    runs: bool = False  # builds something (needs a process group): checked in a subprocess
    gpu_only: str = ""  # why it cannot be checked without a GPU (then ``check`` is None)


@dataclass
class Verdict:
    id: str
    holds: bool | None  # None: GPU-only, not run here
    evidence: dict
    version: str
    error: str = ""


REGISTRY: dict[str, Fact] = {}


def fact(id: str, says: str, library: str, checked_on: str, where: str, *, runs: bool = False):
    """Register the decorated function as the check of a fact; it returns ``(holds, evidence)``."""

    def register(check):
        _add(Fact(id, " ".join(says.split()), library, checked_on, where, check, runs))
        return check

    return register


def gpu_fact(id: str, says: str, library: str, checked_on: str, where: str, why: str) -> None:
    """Register a fact that only a GPU can show (printed as "not run here")."""
    _add(Fact(id, " ".join(says.split()), library, checked_on, where, None, False, why))


def _add(f: Fact) -> None:
    if f.library not in LIBRARIES:
        raise ValueError(f"fact {f.id}: library {f.library!r}; allowed: {', '.join(LIBRARIES)}")
    if f.id in REGISTRY:
        raise ValueError(f"fact {f.id} is registered twice")
    REGISTRY[f.id] = f


def load() -> dict[str, Fact]:
    """Every registered fact (imports the per-library modules once)."""
    for p in sorted(HERE.glob("*/[a-z]*.py")):  # helpers/facts/<library>/<part of the guide>.py
        importlib.import_module(f"{__name__}.{p.parent.name}.{p.stem}")
    return REGISTRY


def version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _get(id: str) -> Fact:
    facts = load()
    if id not in facts:
        raise KeyError(f"no library fact {id!r}; registered: {', '.join(sorted(facts))}")
    return facts[id]


def _run_one(f: Fact) -> Verdict:
    ver = version(f.library)
    if f.gpu_only:
        return Verdict(f.id, None, {"not run here": f.gpu_only}, ver)
    try:
        holds, evidence = f.check()
    except Exception as e:  # the library changed under the check: that is the news, said as a failed fact
        return Verdict(f.id, False, {}, ver, f"{type(e).__name__}: {e}")
    return Verdict(f.id, bool(holds), {str(k): _plain(v) for k, v in evidence.items()}, ver)


def _plain(v):
    """Evidence as JSON keeps it (verdicts travel from the checking process and are cached): numbers, text and
    lists of them as they are, anything else (an enum, a dtype, a class) as its str()."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


def _cache_key() -> str:
    h = hashlib.sha256()
    for lib in LIBRARIES:
        h.update(f"{lib}={version(lib)};".encode())
    for p in sorted(HERE.rglob("*.py")):
        h.update(p.relative_to(HERE).as_posix().encode() + p.read_bytes())
    return h.hexdigest()[:16]


def _run_in_subprocess(ids: list[str]) -> dict[str, Verdict]:
    """Check the facts that build something, in one fresh process (a one-rank gloo group of its own)."""
    # the building checks run on the CPU, on a GPU node too: they show library logic, not device speed
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    p = subprocess.run([sys.executable, "-m", __name__, "--json", *ids], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith('{"id"')]  # the libraries print too
    got = {v["id"]: Verdict(**v) for v in map(json.loads, lines)}
    if p.returncode != 0 or set(got) != set(ids):
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"facts: the checking process failed (exit {p.returncode}) after "
                           f"{len(got)} of {len(ids)} facts: " + " | ".join(tail))
    return got


def check(ids: list[str] | None = None, *, cache: bool = True, refresh: bool = False,
          here: bool = False) -> dict[str, Verdict]:
    """Verdicts of ``ids`` (every fact when None), checked together in one fresh subprocess: it has a one-rank
    gloo group of its own, and the libraries' warnings and the profiler's messages stay out of the caller's
    output (a notebook's cells).

    ``cache``: reuse and store the verdicts (build/facts/, keyed by the installed versions and these files'
    text); ``refresh``: check them again even when stored; ``here``: check the reading facts in this process
    (a test that changes a library's attribute first)."""
    facts = load()
    ids = list(facts) if ids is None else list(ids)
    for i in ids:
        _get(i)
    out = {}
    if here:
        if "DS_ACCELERATOR" not in os.environ:  # DeepSpeed picks its accelerator on import: the CPU one without a GPU
            import torch

            os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
        out = {i: _run_one(facts[i]) for i in ids if not facts[i].runs}
    rest = [i for i in ids if i not in out]
    if rest:
        path = CACHE / f"{_cache_key()}.json"
        known = json.loads(path.read_text()) if cache and not refresh and path.is_file() else {}
        todo = [i for i in rest if i not in known]
        if todo:
            fresh = _run_in_subprocess(todo)
            known.update({i: asdict(v) for i, v in fresh.items()})
            if cache:
                CACHE.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.NamedTemporaryFile("w", dir=CACHE, delete=False, suffix=".tmp")
                with tmp:
                    json.dump(known, tmp)
                os.replace(tmp.name, path)  # notebooks run side by side: whole files only
        out.update({i: Verdict(**known[i]) for i in rest})
    return {i: out[i] for i in ids}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def line(f: Fact, v: Verdict) -> str:
    ev = ", ".join(f"{k}={_fmt(x)}" for k, x in v.evidence.items())
    src = f"{f.library} {v.version}" + ("" if v.version == f.checked_on else f", read on {f.checked_on}")
    if v.holds is None:
        return f"· {f.says}  (not run here: {f.gpu_only}; {src}, {f.where})"
    mark = "✓" if v.holds else "✗"
    return f"{mark} {f.says}  [{ev or v.error}]  ({src}, {f.where})"


def show(*ids: str, here: bool = False) -> None:
    """Print each fact's sentence with its evidence; raise ``FactFailed`` naming every one that fails."""
    verdicts = check(list(ids), here=here)
    facts = load()
    for i, v in verdicts.items():
        print(line(facts[i], v))
    failed = [i for i, v in verdicts.items() if v.holds is False]
    if failed:
        raise FactFailed("; ".join(
            f"library fact {i} no longer holds on {facts[i].library} {verdicts[i].version}: "
            f"'{facts[i].says}' [{verdicts[i].error or verdicts[i].evidence}]" for i in failed)
            + ". Rewrite the sentences that cite it.")


def evidence(id: str) -> dict:
    """The evidence of one fact (checked), for a notebook that computes with it."""
    v = check([id])[id]
    if v.holds is False:
        show(id)
    return v.evidence


def one_rank_group() -> None:
    """A gloo process group of one rank in this process (for checks that build an engine), made once."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port opened
