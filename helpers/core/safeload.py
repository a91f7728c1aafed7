"""Reading checkpoint files without running code from them.

A ``.pt`` file is a pickle, and unpickling can call any function the file names
(``os.system`` included): loading a checkpoint someone sent you is running their
code, unless the loader refuses everything but data. Every file the guide reads
goes through ``load(path, kind)``: ``torch.load(weights_only=True)`` (tensors,
dicts, lists, tuples, numbers, strings) plus, for DeepSpeed's files, an explicit
allow-list of the few classes DeepSpeed puts in them (``ALLOW``). A file that asks
for anything else is refused with one line naming the file and what it asked for;
nothing from it runs.

Torch itself reads DCP checkpoints less carefully: ``.metadata`` with a plain
``pickle.load``, and non-tensor items (the optimizer's hyper-parameters) with
``torch.load(weights_only=False)``. ``SafeReader`` and ``SafePlanner`` replace
those two reads (a restricted unpickler that knows DCP's own metadata classes,
and ``weights_only=True``); tensor data was already read safely.

``scan(path)`` checks a whole checkpoint directory before a job starts (``--resume``)
or a conversion reads it: every ``.pt`` file's pickle is disassembled, not run.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint.metadata as md
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from helpers.core.cli import first_line
from helpers.core.internals import dcp_empty_load_planner, dcp_pickled_private


class UnreadableFile(ValueError):
    """A file that cannot be read as a checkpoint file; the message names it and why."""


class UnsafeFile(UnreadableFile):
    """A file that asks for code the guide does not allow; the message names the file and the global."""


def _deepspeed_globals() -> list:
    """The classes DeepSpeed 0.19 pickles into ``save_checkpoint`` files (found with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0-3 checkpoints, bf16 and fp32)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def _dcp_metadata_globals() -> dict[tuple[str, str], object]:
    """What DCP writes into ``.metadata``: its dataclasses, torch.Size, dtypes, layouts, memory formats."""

    classes = [md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
               md.TensorProperties, md.MetadataIndex, md.StorageMeta,
               torch.Size, pathlib.PosixPath, pathlib.WindowsPath]  # the paths: StorageMeta.checkpoint_id
    allowed = {(c.__module__, c.__qualname__): c for c in classes} | dcp_pickled_private()
    for name in dir(torch):
        v = getattr(torch, name)
        if isinstance(v, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = v
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


ALLOW = {  # kind -> extra classes, beyond what weights_only allows for any file
    "full": lambda: [],  # the guide's consolidated state: tensors and plain data only
    "rng": lambda: [],  # torch / CUDA generator states (uint8 tensors) and random.getstate() (a tuple)
    "deepspeed": _deepspeed_globals,  # model and optimizer states of every ZeRO stage, 16-bit weights
    "weights": lambda: [],  # a pretrained --model DIR's pytorch_model*.bin: a state dict of tensors
}


def load(path: str | os.PathLike, kind: str, **kw):
    """``torch.load`` of ``path`` with ``weights_only=True`` and the allow-list for ``kind``; UnsafeFile if refused."""
    scan_file(path, kind)  # names the first global outside the allow-list; refuses bare pickles
    try:
        with torch.serialization.safe_globals(ALLOW[kind]()):
            return torch.load(path, map_location=kw.pop("map_location", "cpu"), weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        raise UnsafeFile(_refusal(path, kind, str(e))) from None
    except (RuntimeError, EOFError, OSError) as e:  # truncated, corrupt, or not written by torch.save
        first = first_line(e, 160)
        raise UnreadableFile(f"{path}: cannot read it as a {kind} file ({first}); is the checkpoint "
                             "complete?") from None


def _refusal(path, kind: str, detail: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", detail) or re.search(r"Unsupported (?:global|class) ([\w.]+)", detail)
    what = m.group(1) if m else detail.strip().splitlines()[0][:160]
    return (f"{path}: refused to load: it asks for {what}, which is not data and not on the allow-list for "
            f"{kind} files (nothing from the file was run)")


def scan_file(path: str | os.PathLike, kind: str) -> None:
    """Raise UnsafeFile if ``path`` names any global outside the allow-list, without unpickling it."""
    with torch.serialization.safe_globals(ALLOW[kind]()):
        try:
            bad = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except ValueError:  # not torch.save's zip format: a bare or legacy pickle, which we never write
            bad = None
    if bad:
        raise UnsafeFile(_refusal(path, kind, f"GLOBAL {bad[0]}"))
    if bad is None:
        found = _pickle_globals(path)
        what = f"asks for {found[0]}, and " if found else ""
        raise UnsafeFile(f"{path}: refused to load: it {what}is not a torch.save zip file (a bare or legacy "
                         "pickle, which neither the guide nor DeepSpeed writes); nothing from the file was run")


def _pickle_globals(path) -> list[str]:
    """The globals a bare pickle names, read with pickletools (nothing is unpickled)."""

    found, strings = [], []
    try:
        with open(path, "rb") as f:
            for op, arg, _ in pickletools.genops(f):
                if op.name == "GLOBAL":
                    found.append(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(".".join(strings[-2:]))
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # not a pickle at all: nothing to name
        pass
    return found


def scan(ckpt: str | os.PathLike, fmt: str) -> None:
    """Every file a resume or conversion of checkpoint directory ``ckpt`` (format ``fmt``) will read."""
    p = Path(ckpt)
    for f in sorted((p / "rng").glob("*.pt")):
        scan_file(f, "rng")
    if fmt == "full":
        scan_file(p / "full.pt", "full")
    elif fmt in ("deepspeed", "universal"):
        for f in sorted(p.glob("ds/**/*.pt")) + sorted(p.glob("*.bin")):
            scan_file(f, "deepspeed")
    elif fmt == "sharded":
        read_dcp_bytes(p / "dcp")


# --------------------------------------------------------------------------- DCP


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds DCP's metadata classes and nothing else."""

    allowed: dict = {}

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def read_dcp_metadata(dcp_dir: str | os.PathLike):
    """``dcp_dir/.metadata`` read by the restricted unpickler (torch uses a plain ``pickle.load``)."""
    path = Path(dcp_dir) / ".metadata"
    _MetadataUnpickler.allowed = _MetadataUnpickler.allowed or _dcp_metadata_globals()
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UnsafeFile(_refusal(path, "DCP metadata", str(e))) from None


def read_dcp_bytes(dcp_dir: str | os.PathLike) -> dict:
    """Every non-tensor item of a DCP checkpoint, read with ``weights_only=True``: {fqn: value}."""

    meta, out = read_dcp_metadata(dcp_dir), {}
    for index, info in (meta.storage_data or {}).items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with open(Path(dcp_dir) / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        out[index.fqn] = _load_blob(blob, Path(dcp_dir) / info.relative_path, index.fqn)
    return out


def _load_blob(blob: io.BytesIO, path: Path, fqn: str):
    try:
        return torch.load(blob, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeFile(_refusal(f"{path} (item {fqn})", "DCP", str(e))) from None


def dcp_reader_and_planner(dcp_dir: str | os.PathLike, empty: bool = False):
    """A FileSystemReader and a load planner for ``dcp.load`` that read metadata and items safely.

    ``empty=True`` builds the state dict from the checkpoint itself (what ``dcp_to_torch_save`` does),
    for reading a checkpoint without a model."""

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta = read_dcp_metadata(self.path)
            if getattr(meta, "storage_meta", None) is None:

                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    base = dcp_empty_load_planner() if empty else DefaultLoadPlanner

    class SafePlanner(base):
        def load_bytes(self, read_item, value):  # torch's own unpickles with weights_only=False
            obj = _load_blob(value, Path(dcp_dir), read_item.dest_index.fqn)  # refused here if unsafe
            clean = io.BytesIO()
            torch.save(obj, clean)  # plain data, re-pickled by us: what torch's placement code unpickles
            clean.seek(0)
            super().load_bytes(read_item, clean)

    return SafeReader(str(dcp_dir)), SafePlanner()

