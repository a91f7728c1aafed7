"""Offload: where each kind of training state lives - accelerator, host memory or disk.

``state_locations(engine, accelerator)`` splits the bytes of ``helpers.memory``'s four
categories (params, grads, optimizer_states, master_params) over ``LOCATIONS``:

``device``  accelerator memory (GPU); on a CPU-only run, where training keeps what it
            did not offload;
``host``    host memory the backend offloaded to: FSDP2's ``CPUOffloadPolicy`` (params,
            their grads and optimizer states, all together), DeepSpeed's
            ``offload_optimizer`` (fp32 master, Adam's states, reduced gradient
            partitions) and ``offload_param`` (bf16 parameter partitions, except the small
            "persistent" ones ZeRO-3 keeps whole next to the compute);
``disk``    DeepSpeed's NVMe swap files of this rank, measured as file sizes on disk
            (``nvme_path/zero_stage_3/{bfloat16params,optimizer}/rank{r}/*.swp``).

On a GPU run a tensor's place is read from the tensor itself (``t.device``: cuda is
device, cpu is host), with one exception: torch's Adam/AdamW keeps each parameter's
``state["step"]`` counter on the CPU by design (a 0-dim tensor, unless ``capturable`` or
``fused``), offload or not. Those few bytes count where the rest of that optimizer state
lives ("device" unless the backend offloaded it), so "all on the device" stays true of a
run that offloads nothing. On a CPU-only machine both are the same RAM, so the place is the
backend's own bookkeeping: the tensors it put in its offload path are "host". That shows
*where* each backend puts what, not a saving (see notebooks/03_offload).

Also here: ``prepare(job, out)`` (before any rank starts) gives each run its own swap
directory on the node's own disk (a relative ``nvme_path``: under the system temp dir, linked from the
run directory by ``link_swap_dirs``), refuses NVMe offload without libaio and builds DeepSpeed's async I/O op on its
first use (``build_aio``), and ``aio_status()`` says whether that op can be used and is built.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .mapping import CATEGORIES
from .memory import _ds_tensors, _fsdp_tensors, _local
from .warmup import AIO_OP  # our build of DeepSpeed's async_io op (its build dir under $TORCH_EXTENSIONS_DIR)

LOCATIONS = ("device", "host", "disk")

# swap file -> category, by DeepSpeed's file names (runtime/swap_tensor/*):
#   {dtype}params/rank{r}/{ds_id}_param.tensor.swp          bf16 parameter partition
#   optimizer/rank{r}/{ds_id}.tensor.swp                    fp32 master partition
#   optimizer/rank{r}/{state}-{ds_id}.tensor.swp            Adam's exp_avg / exp_avg_sq
#   optimizer/rank{r}/{ds_id}_gradient_{off}_{n}.tensor.swp fp32 gradients handed to the optimizer


def _swap_category(path: Path) -> str:
    name = path.name
    if path.parent.parent.name.endswith("params"):
        return "params"
    if "_gradient_" in name:
        return "grads"
    if "-" in name.split(".")[0]:
        return "optimizer_states"
    return "master_params"


def swap_dirs(ds_json: dict) -> list[Path]:
    """The nvme_path directories a DeepSpeed config swaps to (empty without NVMe offload)."""
    zo = ds_json.get("zero_optimization", {})
    out = []
    for what in ("offload_param", "offload_optimizer"):
        sec = zo.get(what) or {}
        if sec.get("device") == "nvme" and sec.get("nvme_path"):
            p = Path(sec["nvme_path"])
            if p not in out:
                out.append(p)
    return out


def swap_file_bytes(ds_json: dict, rank: int, params_on_disk: set[int] | None = None) -> dict[str, int]:
    """Bytes per category in this rank's swap files on disk. With ``params_on_disk`` (the ``ds_id`` of
    every parameter whose partition lives on NVMe), a parameter's file counts only if it is one of them:
    ZeRO-3 swaps partitions out as it builds the model, then reads them back into a host buffer for good
    while ``offload_param.max_in_cpu`` allows (1e9 elements by default), and leaves the file behind."""
    out = dict.fromkeys(CATEGORIES, 0)
    for base in swap_dirs(ds_json):
        for f in (base / "zero_stage_3").glob(f"*/rank{rank}/*.swp"):
            cat = _swap_category(f)
            if cat == "params" and params_on_disk is not None and int(f.name.split("_")[0]) not in params_on_disk:
                continue
            out[cat] += f.stat().st_size
    return out


def _fsdp_offloaded(engine) -> set[int]:
    """Storage addresses FSDP2 keeps in its offload path (params, their grads, optimizer states)."""
    from torch.distributed.fsdp import FSDPModule

    offloaded = set()
    for m in engine.model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group else []:
            if not fp.offload_to_cpu:
                continue
            p = fp.sharded_param
            ts = [p, p.grad, *engine.optimizer.state.get(p, {}).values()]
            offloaded |= {_local(t).untyped_storage().data_ptr() for t in ts if torch.is_tensor(t)}
    return offloaded


def _ds_offloaded(engine) -> tuple[set[int], set[int], set[int]]:
    """(storages DeepSpeed put in host memory, storages of params whose partition is on NVMe, those
    params' ds_id)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    zopt = engine.engine.optimizer
    groups = _ds_tensors(engine)
    host: list = []
    if getattr(zopt, "offload_optimizer", False) or getattr(zopt, "cpu_offload", False):
        host += groups["grads"] + _ds_fp32_grads(engine) + groups["optimizer_states"] + groups["master_params"]
    on_disk, on_disk_ids = [], set()
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)
        if t is None:
            continue
        if getattr(t, "final_location", None) == OffloadDeviceEnum.nvme:
            on_disk.append(t)  # counted from its swap file; a live buffer is scratch
            on_disk_ids.add(p.ds_id)
        elif getattr(zopt, "offload_param", False) and not getattr(p, "ds_persist", False):
            host.append(t)
    ptr = lambda ts: {t.untyped_storage().data_ptr() for t in ts if torch.is_tensor(t) and t.numel()}  # noqa: E731
    return ptr(host), ptr(on_disk), on_disk_ids


def _ds_fp32_grads(engine) -> list:
    """The fp32 gradient partitions DeepSpeed holds next to its master when read (after backward).
    An offloaded optimizer keeps them in a separate host buffer, alive between steps; without offload
    the masters carry no gradient then (ZeRO makes it during the step and frees it: read, not assumed).
    With the optimizer on NVMe the same fp32 copy is made at the end of backward, piece by piece: the
    pieces of at least the swap minimum go to gradient swap files (counted from the files), the
    others wait in host memory for the step (``unswapped_gradients``), counted here."""
    zopt = engine.engine.optimizer
    masters = getattr(zopt, "fp32_partitioned_groups_flat", None) or getattr(
        zopt, "single_partition_of_fp32_groups", [])
    grads = [m.grad for m in masters if m.grad is not None]
    swap_info = getattr(getattr(zopt, "optimizer_swapper", None), "swap_params_info", {})
    return grads + [t for info in swap_info.values() for t in info.unswapped_gradients.values()]


def state_locations(engine, accelerator: bool, rank: int = 0, ds_json: dict | None = None) -> dict:
    """{category: {location: bytes}} for this rank; totals per category match helpers.memory.state_bytes
    plus what is on disk."""
    if engine.backend == "fsdp":
        groups, offloaded, skip = _fsdp_tensors(engine), _fsdp_offloaded(engine), set()
    else:
        groups, (offloaded, skip, on_disk_ids) = _ds_tensors(engine), _ds_offloaded(engine)
        groups["grads"] = groups["grads"] + _ds_fp32_grads(engine)
    out = {cat: dict.fromkeys(LOCATIONS, 0) for cat in CATEGORIES}
    seen: set[int] = set()
    for cat in CATEGORIES:  # the same walk as memory.state_bytes: each storage once
        for t in groups[cat]:
            if not torch.is_tensor(t):
                continue
            t = _local(t)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if t.numel() == 0 or storage.nbytes() == 0 or ptr in seen or ptr in skip:
                continue
            seen.add(ptr)
            if t.device.type != "cpu":
                where = "device"
            elif ptr in offloaded:
                where = "host"
            elif accelerator and not (cat == "optimizer_states" and t.dim() == 0):  # torch Adam's step: see above
                where = "host"
            else:
                where = "device"
            out[cat][where] += storage.nbytes()
    if engine.backend == "deepspeed" and ds_json:
        for cat, n in swap_file_bytes(ds_json, rank, params_on_disk=on_disk_ids).items():
            out[cat]["disk"] += n
    return out


def swap_buffer_bytes(engine) -> dict[str, int]:
    """Bytes of the page-locked host buffers DeepSpeed's NVMe swappers hold on this rank, {params, optimizer}
    (0 without NVMe): the parameter swapper's (``offload_param``: ``buffer_count`` x ``buffer_size``,
    allocated when ZeRO-3 starts, whether or not a parameter is swapped) and the optimizer swapper's.
    Not state: the I/O buffers the swapped state passes through, in RAM next to it."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    if engine.backend != "deepspeed":
        return {"params": 0, "optimizer": 0}
    swappers = {id(s): s for p in engine.module.parameters() if (s := getattr(p, "nvme_swapper", None)) is not None}
    manager = getattr(getattr(engine.engine.optimizer, "optimizer_swapper", None), "swap_buffer_manager", None)
    return {"params": nbytes(s.buffers for s in swappers.values()),
            "optimizer": nbytes(getattr(manager, "all_buffers", []))}


def totals(locations: dict) -> dict[str, int]:
    """Bytes per category wherever they live."""
    return {cat: sum(where.values()) for cat, where in locations.items()}


# --------------------------------------------------------------------------- before the job


def local_swap_dir(out: str, path: str) -> Path:
    """The node-local home of a relative nvme_path: under the system temp dir, one per user and run directory
    (two jobs never share an --out, see helpers.guard); DeepSpeed keeps each rank's files in its own rank{r}."""
    key = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"fsdp-deepspeed-guide-{os.getuid()}" / "nvme_swap" / key / path


def prepare(job, out: str, local_rank: int = 0) -> list[str]:
    """Give a relative nvme_path a home on this node's own disk; refuse NVMe without libaio.

    A path inside --out would put the swap files wherever the run directory is: on a cluster, a shared
    (network) filesystem, which every node then swaps through. The node's first rank (``local_rank`` 0)
    removes what an earlier run into the same --out left there. ``job.deepspeed.swap_links`` remembers
    each relative path and its home, for ``link_swap_dirs``.
    Raises helpers.config.ConfigError (one line) before any rank starts. Returns notes for log.txt.
    """
    from .config import ConfigError

    if job.backend != "deepspeed":
        return []
    zo = job.deepspeed.json.get("zero_optimization", {})
    notes = []
    for what in ("offload_param", "offload_optimizer"):
        sec = zo.get(what) or {}
        if sec.get("device") != "nvme":
            continue
        path = sec.get("nvme_path")
        if not path:
            raise ConfigError(f"{job.source}: zero_optimization.{what}.device = nvme needs an nvme_path "
                              "(a directory on a local drive)")
        if not os.path.isabs(path):
            home = local_swap_dir(out, path)
            if local_rank == 0 and path not in job.deepspeed.swap_links and home.exists():
                shutil.rmtree(home)  # an earlier run into this --out: its swap files
            sec["nvme_path"] = str(home)
            job.deepspeed.swap_links[path] = str(home)
            notes.append(f"{what}.nvme_path {path!r} is relative: swapping to {home} on each node's own disk "
                         f"(the system temp dir, not --out, which may be a shared filesystem); {path} in the run "
                         "directory links there on rank 0's node; the next run into this --out removes the files")
    if notes:
        ok, why = aio_status()
        if not ok:
            raise ConfigError(f"{job.source}: offload to nvme needs DeepSpeed's async_io op, which cannot be "
                              f"built here: {why}")
        notes += build_aio()
    return notes




def link_swap_dirs(job, out: str) -> None:
    """Rank 0, once the run directory exists: ``out/<relative nvme_path>`` links to its node-local home."""
    for path, home in (job.deepspeed.swap_links if job.deepspeed else {}).items():
        link = Path(out) / path
        if not link.exists() and not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(home, target_is_directory=True)


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
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
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
    import shutil
    import tempfile

    import deepspeed
    from torch.utils.cpp_extension import _get_build_directory

    build = Path(_get_build_directory(AIO_OP, verbose=False))
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
    from deepspeed.ops.op_builder.builder import OpBuilder

    module = _aio_builder().load(verbose=False)
    OpBuilder._loaded_ops[AsyncIOBuilder.NAME] = module
    return module


def build_aio() -> list[str]:
    """Load DeepSpeed's async_io op for this rank, building it on first use (before the job's --timeout
    clock starts), saying so.

    ``make setup`` does not build it (~1 min on 2 cores, for one notebook cell); the first NVMe job
    does, once per checkout (cached under $TORCH_EXTENSIONS_DIR; ``python -m helpers.warmup --nvme`` builds
    it ahead, e.g. before a workshop). Every rank calls this; torch's build lock makes one build and the
    others wait for it. Returns a note for log.txt when this job built it."""
    if _built(AIO_OP):
        load_aio()
        return []
    import time

    from .warmup import clear_stale_locks

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
    return True, ("built" if _built(AIO_OP) else
                  "not built yet: the first NVMe job compiles it (~1 min on 2 cores, once)")


def _built(name: str) -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    try:
        d = Path(_get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - an unusable cache dir just means "not built"
        return False
    return any(d.glob(f"{name}*.so"))


# --------------------------------------------------------------------------- reading runs


def settings_table(configs: dict):
    """One row per config (dict label -> path under launch_configs/, no suffix): its offload keys."""
    import pandas as pd

    from .config import load_job_config

    rows = {}
    for label, path in configs.items():
        job = load_job_config(f"launch_configs/{path}.yaml")
        if job.fsdp:
            on = job.fsdp.offload_params
            rows[label] = {"key": f"fsdp_offload_params: {str(on).lower()}",
                           "optimizer states to": "host" if on else "-", "params to": "host" if on else "-"}
        else:
            ds = job.deepspeed
            name = {"none": "-", "cpu": "host", "nvme": "disk"}
            rows[label] = {"key": f"offload_optimizer: {ds.offload_optimizer_device}, "
                                  f"offload_param: {ds.offload_param_device}",
                           "optimizer states to": name[ds.offload_optimizer_device],
                           "params to": name[ds.offload_param_device]}
    return pd.DataFrame(rows).T


def where(run, category: str, rank: int = 0) -> dict[str, int]:
    """{location: bytes} of one category in a finished run, locations holding nothing left out."""
    return {loc: n for loc, n in run.summary["memory_location_bytes"][rank][category].items() if n}


def location_table(runs: dict, rank: int = 0, unit: float = 1e6):
    """One row per run (dict label -> Run), one column per category: 'host 41.7' (MB), places joined by ' + '."""
    import pandas as pd

    rows = {}
    for label, run in runs.items():
        rows[label] = {cat: " + ".join(f"{loc} {n / unit:.1f}" for loc, n in where(run, cat, rank).items()) or "-"
                       for cat in CATEGORIES}
    return pd.DataFrame(rows).T


def location_totals(runs: dict, rank: int = 0, unit: float = 1e6):
    """One row per run: MB of state on device, host and disk, and the total."""
    import pandas as pd

    rows = {}
    for label, run in runs.items():
        locs = run.summary["memory_location_bytes"][rank]
        rows[label] = {loc: sum(locs[c][loc] for c in CATEGORIES) / unit for loc in LOCATIONS}
        rows[label]["total"] = sum(rows[label].values())
    return pd.DataFrame(rows).T.round(1)
