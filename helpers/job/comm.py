"""The collectives the guide issues itself, on the device the process group serves.

A process group started with nccl serves CUDA tensors only: an all-reduce of a CPU
tensor fails ("No backend type associated with device type cpu"). gloo serves the
CPU. The guide's own bookkeeping (a checksum of the loaded weights, the global grad
norm, the share of updated weights) builds small tensors wherever its inputs live -
on the host under FSDP2's CPU offload, always on the CPU for a checksum - so it
reduces them through ``all_reduce`` here, which hands the group a copy on its device
and writes the sum back.

``CollectiveCheck`` is the test aid: while active it records the device of every
tensor given to a ``torch.distributed`` collective and raises on one the group does
not serve. With ``simulate_accelerator=True`` it makes the nccl mistake visible on a
CPU-only box: the group is treated as serving no CPU tensor, so only the tensors that
``to_group`` placed (clones it registers, standing in for the GPU copy) pass.

Also here: ``check_local_device`` (one GPU per rank on this node, checked before anything starts; on a CPU, a
note when the node's ranks outnumber its cores: ``cpu_share_notes``).
"""

from __future__ import annotations

import os
import sys
import weakref

import torch
import torch.distributed as dist

from helpers import CHECKOUT
from helpers.core.internals import group_device_types

_REPO = str(CHECKOUT) + "/"
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single")
_check: CollectiveCheck | None = None


def device_types(group=None) -> list[str]:
    """Device types ``group`` (default: the world) has a backend for: ['cpu', 'cuda'] for gloo, ['cuda'] for nccl."""

    return group_device_types(group)


def device(group=None) -> torch.device:
    """Where a tensor must be for a collective on ``group``: the CPU if the group serves it, else this rank's
    accelerator (the one ``torch.cuda.set_device`` picked)."""
    types = device_types(group)
    if not types or "cpu" in types:
        return torch.device("cpu")
    return torch.device(types[0], torch.accelerator.current_device_index())


def to_group(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` itself if it is on the group's device, else a copy there."""
    if _check is not None and _check.simulate:
        return _check.place(t)
    dev = device(group)
    return t if t.device == dev else t.to(dev)


def all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place, wherever ``t`` lives; returns ``t``."""
    on = to_group(t, group)
    dist.all_reduce(on, group=group)
    if on is not t:
        t.copy_(on)
    return t


def check_local_device(local_rank: int, local_ranks: int = 1) -> list[str]:
    """One GPU per rank: ``LOCAL_RANK`` must name a GPU of this node (raises ValueError, one line). On a CPU, the
    note ``cpu_share_notes`` gives for this node's ``local_ranks`` (``LOCAL_WORLD_SIZE``)."""
    if not torch.cuda.is_available():
        return cpu_share_notes(local_ranks, cpu_cores())
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ValueError(f"LOCAL_RANK = {local_rank}: this node has {n} GPU(s), one per rank; allowed: "
                         f"--nproc_per_node <= {n} (nccl refuses two ranks on one GPU)")
    return []


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share of the machine)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_share_notes(ranks: int, cores: int) -> list[str]:
    """A note when a node's CPU ranks outnumber its cores: the ranks take turns on them, so every step (and every
    timing and throughput figure) is slower than with a core per rank; the losses are the same."""
    if ranks <= cores:
        return []
    return [f"{ranks} ranks on this node share {cores} CPU core{'s' if cores > 1 else ''}: they take turns, so "
            "steps are slower and timings (step ms, tokens/s, MFU) are not what a core per rank would give; "
            f"the losses are the same (--nproc_per_node {cores} gives each rank its own core)"]


class CollectiveCheck:
    """Records (collective, device type, caller, ok) of every tensor given to a collective; raises on a bad one.

    ``simulate_accelerator``: pretend the group serves no CPU tensor (as nccl); only ``to_group``'s copies pass.
    Use as a context manager; patches the names in ``torch.distributed`` while active.
    """

    def __init__(self, simulate_accelerator: bool = False):
        self.simulate = simulate_accelerator
        self.calls: list[tuple[str, str, str, bool]] = []
        self._placed: dict[int, object] = {}
        self._saved: dict[str, object] = {}

    def place(self, t: torch.Tensor) -> torch.Tensor:

        copy = t.clone()
        self._placed[id(copy)] = weakref.ref(copy)
        return copy

    def _ok(self, t: torch.Tensor, group) -> bool:
        if self.simulate:
            ref = self._placed.get(id(t))
            return ref is not None and ref() is t
        return t.device.type in device_types(group)

    def _wrap(self, name: str, fn):
        def checked(*args, **kwargs):
            group = kwargs.get("group")
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            tensors += [x for a in (*args, *kwargs.values()) if isinstance(a, list | tuple)
                        for x in a if torch.is_tensor(x)]
            caller = _caller()
            for t in tensors:
                ok = self._ok(t, group)
                self.calls.append((name, t.device.type, caller, ok))
                if not ok:
                    served = "none (simulated accelerator group)" if self.simulate else device_types(group)
                    raise RuntimeError(f"collective {name} at {caller}: a {t.device.type} tensor, but the "
                                       f"process group serves {served}")
            return fn(*args, **kwargs)
        return checked

    def __enter__(self):
        global _check
        for name in COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        _check = self
        return self

    def __exit__(self, *exc):
        global _check
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        _check = None
        return False


def _caller() -> str:
    """file:line of the nearest frame outside this module (who issued the collective)."""
    f = sys._getframe(2)
    while f and f.f_code.co_filename == __file__:
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    return f"{name.removeprefix(_REPO)}:{f.f_lineno}"
