"""DeepSpeed's CPU ops the guide builds itself: the shared-memory comm op and its own async_io build.

``python -m helpers.warmup`` builds them up front (see its docstring for what each costs); a job
that needs one builds it before its ``--timeout`` clock starts (``build_aio``). An interrupted
build leaves a ``lock`` file that would make every later job wait for ever: ``clear_stale_locks``
removes it and says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from helpers import set_ds_accelerator
from helpers.core.internals import extension_build_dir, register_loaded_op

AIO_OP = "async_io_guide"  # DeepSpeed's async_io op as helpers.job.observe.offload builds it (one file, no debug info)
OPS = ("deepspeed_shm_comm", AIO_OP)  # the CPU ops built here (names of their build dirs)


def clear_stale_locks(names=OPS, min_age_s: float = 60.0) -> list[str]:
    """Remove the build locks that an interrupted op build left behind; returns a note per lock removed.

    torch builds an op under a ``lock`` file in its build directory and removes it when done. A build that
    is interrupted (a notebook cell stopped during the first NVMe job, a killed job) leaves the file, and
    every later job that needs the op waits on it for ever. A lock is stale when no process works in that
    directory (ninja and the compilers run there) and it is older than ``min_age_s`` (the time between
    taking the lock and starting ninja)."""
    notes = []
    for name in names:
        d = Path(extension_build_dir(name))
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


def _aio_builder():
    """DeepSpeed's AsyncIOBuilder for this machine, building under the name ``AIO_OP``: its sources
    under ``py_lib/`` as one translation unit, without ``-g``.

    DeepSpeed compiles the op from 12 files with ``-O0 -g`` (its comment: for debugging; the op is bound
    by I/O). Nine of them include ``<torch/extension.h>``: each spends ~25 s parsing the same 420k lines
    of torch and pybind11 headers, and the debug information doubles that. Here the nine are compiled as
    one file (``_staged_aio_sources``) and without ``-g``; the other three (``common/``, plain C++ with
    file-level names that clash with py_lib's) as they are. Same code, same other flags; on 2 idle cores
    the build takes ~30 s instead of 230 s. Loading it first loads DeepSpeed's ``pin_memory`` op (its
    pinned-buffer manager), built as DeepSpeed builds it, ~25 s on first use: ~1 min in all. Its own
    name keeps this build apart from DeepSpeed's (a process without ``helpers``, sharing the build
    cache, compiles DeepSpeed's own rather than rebuilding this one)."""
    set_ds_accelerator()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    class GuideAsyncIO(AsyncIOBuilder):
        NAME = AIO_OP

        def cxx_args(self):
            return [a for a in super().cxx_args() if a != "-g"]

        def sources(self):
            root = _staged_aio_sources(super().sources(), super().include_paths())
            apart = [s for s in super().sources() if not s.startswith(UNITY_DIR)]  # common/: compiled alone
            return [str(root / UNITY_DIR / UNITY_FILE)] + [str(root / s) for s in apart]

        def include_paths(self):
            root = _staged_aio_sources(super().sources(), super().include_paths())
            return [str(root / p) for p in super().include_paths()]

    return GuideAsyncIO()


UNITY_DIR = "csrc/aio/py_lib/"  # the op's sources compiled as one file (all include torch's headers)
UNITY_FILE = "_all_py_lib.cpp"


def _staged_aio_sources(sources: list[str], include_paths: list[str]) -> Path:
    """A copy of the async_io op's source folders (paths relative to ``deepspeed/ops``) in the op's build
    directory, made so that the ``py_lib`` sources compile as one file: every header gets ``#pragma once``
    (DeepSpeed's have no include guards, which a file including several sources needs) and
    ``UNITY_FILE`` includes the sources. Made once per DeepSpeed version, atomically (every rank of a job
    calls this; the first to finish renames its copy into place, the others drop theirs)."""

    import deepspeed

    build = Path(extension_build_dir(AIO_OP))
    root = build / f"src-deepspeed-{deepspeed.__version__}"
    if root.is_dir():
        return root
    ops = Path(deepspeed.__file__).parent / "ops"
    tmp = Path(tempfile.mkdtemp(dir=build, prefix=".src-"))
    for top in sorted({"/".join(p.split("/")[:2]) for p in sources + include_paths}):  # csrc/aio, csrc/pin_memory
        shutil.copytree(ops / top, tmp / top)
    for h in tmp.rglob("*.h"):
        h.write_text("#pragma once\n" + h.read_text())
    together = sorted(Path(s).name for s in sources if s.startswith(UNITY_DIR))
    (tmp / UNITY_DIR / UNITY_FILE).write_text("".join(f'#include "{name}"\n' for name in together))
    try:
        tmp.rename(root)
    except OSError:  # another rank's copy is in place
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def load_aio():
    """Load (building it on first use) the async_io op and hand it to DeepSpeed as its own.

    DeepSpeed's swappers call ``AsyncIOBuilder().load()``, which returns an op already in
    ``OpBuilder._loaded_ops`` under its name; this process's load puts ours there first."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    module = _aio_builder().load(verbose=False)
    register_loaded_op(AsyncIOBuilder.NAME, module)
    return module


def build_aio() -> list[str]:
    """Load DeepSpeed's async_io op for this rank, building it on first use (before the job's --timeout
    clock starts), saying so.

    ``make setup`` does not build it (~1 min on 2 cores, for one notebook cell); the first NVMe job
    does, once per checkout (cached under $TORCH_EXTENSIONS_DIR; ``python -m helpers.warmup --nvme`` builds
    it ahead, e.g. before a workshop). Every rank calls this; torch's build lock makes one build and the
    others wait for it. Returns a note for log.txt when this job built it."""
    if built(AIO_OP):
        load_aio()
        return []
    import time

    notes = clear_stale_locks((AIO_OP,))
    if int(os.environ.get("RANK", "0")) == 0:
        print("note: building DeepSpeed's async_io op for NVMe offload: first use on this machine, about 1 min "
              "on 2 cores, once (python -m helpers.warmup --nvme builds it ahead)", flush=True)
    t0 = time.perf_counter()
    load_aio()
    return notes + [f"built DeepSpeed's async_io op for NVMe offload in {time.perf_counter() - t0:.0f} s "
                    "(first use on this machine; cached from now on)"]


def aio_status() -> tuple[bool, str]:
    """(usable, what to expect): can DeepSpeed's async_io op load here, and is it built yet?"""
    b = _aio_builder()
    if not b.is_compatible(verbose=False):
        return False, "libaio is not installed (Debian/Ubuntu: apt-get install libaio-dev)"
    return True, ("built" if built(AIO_OP) else
                  "not built yet: the first NVMe job compiles it, once (its log.txt says how long it took)")


def timed_load(name: str, load) -> tuple[object, str]:
    """``load()`` (a load of op ``name``: torch builds it first when it is missing or its sources changed), and
    what happened: "built in N s" when the op's library was written, else "already built (loaded in N s)"."""
    before = _libraries(name)
    t0 = time.perf_counter()
    module = load()
    took = time.perf_counter() - t0
    return module, (f"built in {took:.0f} s" if _libraries(name) != before else
                    f"already built (loaded in {took:.1f} s)")


def _libraries(name: str) -> list[tuple[str, int]]:
    """The op's built libraries (``name.so``, ``name_v1.so`` after a rebuild of changed sources), each with its
    modification time."""
    try:
        d = Path(extension_build_dir(name))
    except Exception:  # noqa: BLE001 - an unusable cache dir: nothing built
        return []
    return sorted((so.name, so.stat().st_mtime_ns) for so in d.glob(f"{name}*.so"))


def built(name: str) -> bool:
    """Has op ``name`` been built here (its library is in the build cache)?"""
    return bool(_libraries(name))
