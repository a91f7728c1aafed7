"""Offload: where each kind of training state lives - accelerator, host memory or disk.

``state_locations(engine, accelerator)`` splits the bytes of ``helpers.job.observe.memory``'s four
categories (params, grads, optimizer_states, master_params) over ``LOCATIONS``:

``device``  accelerator memory (GPU); on a CPU-only run, where training keeps what it
            did not offload;
``host``    host memory the backend offloaded to: FSDP2's ``CPUOffloadPolicy`` (params,
            their grads and optimizer states, all together), DeepSpeed's
            ``offload_optimizer`` (fp32 master, Adam's states, reduced gradient
            partitions) and ``offload_param`` (every bf16 parameter partition; the small
            "persistent" parameters ZeRO-3 keeps whole next to the compute stay there);
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

from helpers.core.config import ConfigError
from helpers.core.internals import (
    fsdp_params,
    zero3_partition_on_nvme,
    zero3_swap_buffers,
    zero3_unswapped_grads,
    zero_flat_masters,
    zero_offload,
)
from helpers.core.mapping import CATEGORIES
from helpers.job.observe.memory import _ds_tensors, _fsdp_tensors, _local
from helpers.job.ops import aio_status, build_aio

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
    offloaded = set()
    for fp in fsdp_params(engine.model):
        if fp.offloaded:
            ts = [fp.param, fp.param.grad, *engine.optimizer.state.get(fp.param, {}).values()]
            offloaded |= {_local(t).untyped_storage().data_ptr() for t in ts if torch.is_tensor(t)}
    return offloaded


def _ds_offloaded(engine) -> tuple[set[int], set[int], set[int]]:
    """(storages DeepSpeed put in host memory, storages of params whose partition is on NVMe, those
    params' ds_id)."""
    zopt = engine.engine.optimizer
    offload = zero_offload(zopt)
    groups = _ds_tensors(engine)
    host: list = []
    if offload["optimizer"]:
        host += groups["grads"] + _ds_fp32_grads(engine) + groups["optimizer_states"] + groups["master_params"]
    on_disk, on_disk_ids = [], set()
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)
        if t is None:
            continue
        if zero3_partition_on_nvme(p):
            on_disk.append(t)  # counted from its swap file; a live buffer is scratch
            on_disk_ids.add(p.ds_id)
        elif offload["params"] and not getattr(p, "ds_persist", False):
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
    return [m.grad for m in zero_flat_masters(zopt) if m.grad is not None] + zero3_unswapped_grads(zopt)


def state_locations(engine, accelerator: bool, rank: int = 0, ds_json: dict | None = None) -> dict:
    """{category: {location: bytes}} for this rank; totals per category match helpers.job.observe.memory.state_bytes
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
    buffers = zero3_swap_buffers(engine.engine.optimizer, engine.module.parameters())
    return {"params": nbytes(buffers["params"]), "optimizer": nbytes(buffers["optimizer"])}


def totals(locations: dict) -> dict[str, int]:
    """Bytes per category wherever they live."""
    return {cat: sum(where.values()) for cat, where in locations.items()}


# --------------------------------------------------------------------------- before the job


def local_swap_dir(out: str, path: str) -> Path:
    """The node-local home of a relative nvme_path: under the system temp dir, one per user and run directory
    (two jobs never share an --out, see helpers.job.guard); DeepSpeed keeps each rank's files in its own rank{r}."""
    key = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"fsdp-deepspeed-guide-{os.getuid()}" / "nvme_swap" / key / path


def prepare(job, out: str, local_rank: int = 0) -> list[str]:
    """Give a relative nvme_path a home on this node's own disk; refuse NVMe without libaio.

    A path inside --out would put the swap files wherever the run directory is: on a cluster, a shared
    (network) filesystem, which every node then swaps through. The node's first rank (``local_rank`` 0)
    removes what an earlier run into the same --out left there. ``job.deepspeed.swap_links`` remembers
    each relative path and its home, for ``link_swap_dirs``.
    Raises helpers.core.config.ConfigError (one line) before any rank starts. Returns notes for log.txt.
    """

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
