"""Checkpoints: save, resume exactly, and move training state between FSDP and DeepSpeed.

    torchrun ... -m helpers.train --config C --out runs/a --steps 20 --checkpoint-dir ckpt --checkpoint-every 10
    torchrun ... -m helpers.train --config C --out runs/b --steps 20 --resume ckpt/step_10

``--steps`` is the total: the resumed job runs steps 10..19. The data of a step
is a pure function of (seed, step) (helpers.core.models.synthetic_batch), so the
step counter *is* the data position; with the model, the optimizer and each
rank's RNG state restored, 10 + resume + 10 steps give the same losses as 20.

A checkpoint is a directory ``D/step_K`` holding ``meta.json`` and one of
three formats (``meta["format"]``):

``sharded``  (FSDP, ``fsdp_state_dict_type: SHARDED_STATE_DICT``)
    ``dcp/``: torch.distributed.checkpoint, one file per rank; loads at any
    world size (DCP reshards).
``full``     (FSDP ``FULL_STATE_DICT``; also what ``helpers.convert`` writes for DeepSpeed)
    ``full.pt``: one consolidated fp32 file, written by rank 0,
    ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {step, exp_avg, exp_avg_sq}},
    "param_groups": [...]}}``. Both backends resume from it at any world
    size: FSDP broadcasts it from rank 0 (``set_*_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)``); DeepSpeed loads the weights before
    ``deepspeed.initialize``, then sets its fp32 master and Adam state
    (``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state``).
``deepspeed`` (DeepSpeed)
    ``ds/``: ``engine.save_checkpoint`` (ZeRO partitions, same world size to
    resume), plus ``model_16bit.bin`` (``save_16bit_model``, a torch pickle
    of bf16 weights) when ``zero3_save_16bit_model`` is set.
``universal`` (DeepSpeed's universal checkpoint, ``helpers.convert --to universal``: DeepSpeed's own
    ``ds_to_universal`` on a ``deepspeed`` checkpoint) ``ds/ds/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt``
    per parameter; DeepSpeed resumes it at any world size through its own loader when the JSON asks
    (``"checkpoint": {"load_universal": true}``).

Every rank also writes ``rng/rank{r}.pt``. Every file is read back without running code from it
(``helpers.core.safeload``: ``weights_only`` loads, DeepSpeed's classes allow-listed, DCP metadata
read by a restricted unpickler); ``--resume`` scans all of them before any process starts.
Saves are atomic: everything is written under ``D/.step_K.tmp``, ``meta.json`` last, then renamed to
``D/step_K``. A job killed mid-save leaves a ``.tmp`` directory (ignored, and
removed by the next save) and the previous checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from helpers.core import safeload
from helpers.core.models import clean_fqn, model_config, resolve_model
from helpers.job.ds_import import CheckpointError, import_deepspeed

META = "meta.json"
FORMATS = ("sharded", "full", "deepspeed", "universal")


# --------------------------------------------------------------------------- reading what is on disk


def read_meta(path: str | os.PathLike) -> dict:
    """meta.json of a complete checkpoint, or CheckpointError saying what is wrong with ``path``."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p}: no such directory")
    if p.name.endswith(".tmp"):
        raise CheckpointError(f"checkpoint {p}: partial checkpoint (a save that never finished); "
                              "resume from a step_K directory next to it")
    if not (p / META).is_file():
        steps = sorted(c.name for c in p.glob("step_*") if (c / META).is_file())
        hint = f"; it holds {', '.join(steps)}: pass one of those" if steps else ""
        partial = any((p / n).exists() for n in ("dcp", "ds", "full.pt", "rng"))
        what = "partial checkpoint (no meta.json: the save did not finish)" if partial else "not a checkpoint"
        raise CheckpointError(f"checkpoint {p}: {what}{hint}")
    meta = json.loads((p / META).read_text())
    fmt = meta.get("format")
    if fmt not in FORMATS:
        raise CheckpointError(f"checkpoint {p}: format = {fmt!r} in meta.json; allowed: {', '.join(FORMATS)}")
    need = {"sharded": "dcp/.metadata", "full": "full.pt", "deepspeed": "ds", "universal": "ds/ds/zero"}[fmt]
    if not (p / need).exists():
        raise CheckpointError(f"checkpoint {p}: partial checkpoint ({need} is missing)")
    return meta


def dir_bytes(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def param_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Full (unsharded) shape of every parameter, by name; works on FSDP2 and ZeRO-3 modules."""
    out = {}
    for name, p in model.named_parameters():
        shape = getattr(p, "ds_shape", None) or p.shape  # ZeRO-3 keeps an empty p.data
        out[clean_fqn(name)] = list(shape)  # as the state dict names it, with or without checkpoint_wrapper
    return out


def check_model(meta: dict, shapes: dict[str, list[int]], where: str) -> None:
    """Same parameter names and shapes as the checkpoint, or CheckpointError naming the first difference."""
    saved = meta["param_shapes"]
    missing, extra = sorted(set(saved) - set(shapes)), sorted(set(shapes) - set(saved))
    if missing or extra:
        raise CheckpointError(f"checkpoint {where}: model mismatch: {len(missing)} saved parameters not in "
                              f"this model (e.g. {missing[:1]}), {len(extra)} parameters not in the checkpoint "
                              f"(e.g. {extra[:1]}); saved from --model {meta.get('model')!r}")
    for k, v in saved.items():
        if list(shapes[k]) != list(v):
            raise CheckpointError(f"checkpoint {where}: model mismatch: {k} has shape {list(v)} in the "
                                  f"checkpoint, {list(shapes[k])} in this model (saved from --model "
                                  f"{meta.get('model')!r})")


def asks_universal(job) -> bool:
    """Whether the job's DeepSpeed JSON says ``"checkpoint": {"load_universal": true}``."""
    return job.backend == "deepspeed" and bool(((job.deepspeed.json or {}).get("checkpoint") or {})
                                               .get("load_universal"))


def check_resume(path: str, job, world_size: int) -> dict:
    """Before any process group: can this job resume from ``path``? Returns meta or raises."""
    meta = read_meta(path)
    safeload.scan(path, meta["format"])  # a file that would run code is refused here, before any rank starts
    if meta["format"] == "sharded" and job.backend != "fsdp":
        raise CheckpointError(f"--resume {path}: an FSDP sharded (DCP) checkpoint; DeepSpeed cannot read it. "
                              f"Convert it: python -m helpers.convert {path} NEW_DIR --to deepspeed")
    universal = asks_universal(job)
    if meta["format"] == "universal" and not universal:
        raise CheckpointError(f"--resume {path}: a DeepSpeed universal checkpoint; DeepSpeed reads it when its JSON "
                              f"says \"checkpoint\": {{\"load_universal\": true}} (a DeepSpeed config), or "
                              f"convert it: python -m helpers.convert {path} NEW_DIR --to fsdp|deepspeed")
    if universal and meta["format"] != "universal":
        raise CheckpointError(f"--resume {path}: checkpoint.load_universal is true in the DeepSpeed JSON, but this is "
                              f"a {meta['format']} checkpoint; make one: python -m helpers.convert {path} NEW_DIR "
                              "--to universal (from a DeepSpeed checkpoint), or drop the key")
    if meta["format"] == "deepspeed":
        if job.backend != "deepspeed":
            raise CheckpointError(f"--resume {path}: a DeepSpeed checkpoint; FSDP cannot read it. "
                                  f"Convert it: python -m helpers.convert {path} NEW_DIR --to fsdp")
        if meta["world_size"] != world_size:
            raise CheckpointError(f"--resume {path}: DeepSpeed checkpoint saved by {meta['world_size']} ranks, "
                                  f"this job has {world_size}; convert it (--to deepspeed) to change world size")
    _check_model_config(meta, job.train.model, path)
    if meta["step"] >= job.train.steps:
        raise CheckpointError(f"--resume {path}: checkpoint is at step {meta['step']}, but --steps "
                              f"{job.train.steps} is the total; ask for more steps")
    return meta


ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "n_embd", "n_layer", "n_head")


def _check_model_config(meta: dict, model: str, path: str) -> None:
    """--model of this job against the model the checkpoint was saved from (before anything starts)."""

    saved = meta.get("model_config") or {}
    mine = model_config(resolve_model(model)).to_dict()
    diff = [f"{k} {saved.get(k)} (checkpoint) vs {mine.get(k)} (--model {model})"
            for k in ARCH_KEYS if saved.get(k) != mine.get(k)]
    if diff:
        raise CheckpointError(f"--resume {path}: model mismatch: {'; '.join(diff[:3])}; the checkpoint was "
                              f"saved from --model {meta.get('model')!r}")


# --------------------------------------------------------------------------- saving


def _opts(**kw):

    return StateDictOptions(**kw)


def _dtypes(tree) -> list[str]:
    found = set()

    def walk(x):
        if isinstance(x, torch.Tensor):
            if x.dim() > 0 and x.numel() > 0:  # not a scalar (Adam's step), not an empty placeholder
                found.add(str(x.dtype).removeprefix("torch."))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(tree)
    return sorted(found)


def _ds_file_dtypes(tmp: Path) -> dict[str, list[str]]:
    """The dtypes of the tensors in this rank's DeepSpeed files, read back (memory-mapped, not copied): under
    ZeRO-3 the model files hold no weights (the fp32 partitions and Adam's moments are in the optimizer files;
    the bf16 module copy is rebuilt from them on load)."""
    rank, d = dist.get_rank(), tmp / "ds" / "ds"
    mine = [f for f in d.glob("*.pt") if f"rank_{rank}_" in f.name]
    model = [f for f in mine if f.name.endswith("model_states.pt")] or sorted(d.glob("mp_rank_00_model_states.pt"))
    optim = [f for f in mine if f.name.endswith("optim_states.pt")]
    model_sd = [safeload.load(f, "deepspeed", mmap=True) for f in model]
    out = {"model": sorted({x for sd in model_sd for x in _dtypes(sd["module"])}),  # ZeRO-0: the optimizer is here
           "optim": sorted({x for sd in model_sd for x in _dtypes(sd.get("optimizer"))}
                           | {x for f in optim for x in _dtypes(
                               safeload.load(f, "deepspeed", mmap=True)["optimizer_state_dict"])})}
    if (tmp / "model_16bit.bin").is_file() and rank == 0:
        out["model_16bit"] = _dtypes(safeload.load(tmp / "model_16bit.bin", "deepspeed", mmap=True))
    return out


def save(engine, job, ckpt_dir: str, step: int, meta_extra: dict, fault_hook=None, peft=None,
         naive_adapter: bool = False) -> dict:
    """Every rank: write ``ckpt_dir/step_{step}`` atomically. Returns a record (rank 0's view). ``peft`` (the
    job's LoraConfig): also ``adapter/`` in PEFT's format, gathered (helpers.job.lora.export), outside the
    timed save; ``naive_adapter``: and ``adapter_naive/``, what a plain save on rank 0 writes."""
    rank = dist.get_rank()
    final = Path(ckpt_dir) / f"step_{step}"
    tmp = Path(ckpt_dir) / f".step_{step}.tmp"
    if rank == 0:
        for old in Path(ckpt_dir).glob(".step_*.tmp"):  # a save that was killed: never complete
            shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        tmp.mkdir(parents=True)
    dist.barrier()
    if not tmp.is_dir():  # several nodes: rank 0 made it on its own filesystem

        raise CheckpointError(f"--checkpoint-dir {ckpt_dir}: rank 0's {tmp.name} is not visible on rank {rank} "
                              f"({socket.gethostname()}); put checkpoints on a filesystem every node shares")
    t0 = time.perf_counter()
    fmt, dtypes = _save_state(engine, job, tmp)
    seconds_16bit = dtypes.pop("seconds_16bit", None)  # DeepSpeed's consolidated 16-bit copy, part of seconds
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")
    if fault_hook:
        fault_hook(step)  # the failure tests kill a rank here: state written, checkpoint not yet visible
    dist.barrier()
    seconds = time.perf_counter() - t0
    if fmt == "deepspeed" and rank == 0:  # rank 0's files read back, outside the save time, before it renames
        dtypes.update(_ds_file_dtypes(tmp))
    adapter = {}
    if peft is not None:
        from helpers.job import lora

        adapter["adapter"] = lora.export(engine, peft, tmp / "adapter", job.train.model, rank)
        if naive_adapter and rank == 0:
            adapter["adapter_naive"] = lora.naive_export(engine, peft, tmp / "adapter_naive", job.train.model, rank)
    meta = {**adapter, "format": fmt, "step": step, "backend": job.backend, "world_size": dist.get_world_size(),
            "mixed_precision": job.mixed_precision, "model": job.train.model, "seed": job.train.seed,
            "saved_dtypes": dtypes, "save_seconds": seconds, **meta_extra}
    if rank == 0:
        meta["bytes"] = dir_bytes(tmp)
        (tmp / META).write_text(json.dumps(meta, indent=2))  # the completion mark
        os.replace(tmp, final)
    dist.barrier()
    return {"step": step, "path": str(final), "format": fmt, "seconds": seconds,
            "bytes": meta.get("bytes"), "saved_dtypes": dtypes, "seconds_16bit": seconds_16bit, **adapter}


def _save_state(engine, job, tmp: Path) -> tuple[str, dict]:
    if engine.backend == "deepspeed":
        ds = engine.engine
        ds.save_checkpoint(str(tmp / "ds"), tag="ds", client_state={}, save_latest=False)
        dtypes = {}
        if job.deepspeed.zero3_save_16bit_model:
            t0 = time.perf_counter()
            ds.save_16bit_model(str(tmp), "model_16bit.bin")
            dtypes["seconds_16bit"] = time.perf_counter() - t0
        return "deepspeed", dtypes  # its files' dtypes are read back after the timed save (save)

    model, optim = engine.model, engine.optimizer
    if job.fsdp.state_dict_type == "SHARDED_STATE_DICT":

        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=str(tmp / "dcp"))
        return "sharded", {k: _dtypes(v) for k, v in state.items()}
    opts = _opts(full_state_dict=True, cpu_offload=True)  # gathered to rank 0's CPU memory
    state = {"model": get_model_state_dict(model, options=opts),
             "optim": get_optimizer_state_dict(model, optim, options=opts)}
    if dist.get_rank() == 0:
        torch.save(state, tmp / "full.pt")
    return "full", {k: _dtypes(v) for k, v in state.items()}


# --------------------------------------------------------------------------- resuming


def rng_state() -> dict:

    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(s: dict) -> None:

    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def load_full(path: str | os.PathLike) -> dict:
    return safeload.load(Path(path) / "full.pt", "full", mmap=True)


def before_backend(model: torch.nn.Module, meta: dict, path: str) -> dict | None:
    """DeepSpeed resuming a ``full`` checkpoint: weights go in before ``deepspeed.initialize``.

    (ZeRO-3 partitions the module at initialize and builds its fp32 master from it.) Returns the
    loaded state for ``restore`` so it is read once."""
    if meta["format"] != "full":
        return None
    state = load_full(path)
    model.load_state_dict(state["model"])  # copy_ casts to the model's dtype
    return state


def restore(engine, meta: dict, path: str, state: dict | None = None) -> int:
    """Every rank: load model, optimizer and this rank's RNG from ``path``; returns the step to start at."""
    p, rank = Path(path), dist.get_rank()
    check_model(meta, param_shapes(engine.module), str(p))
    fmt = meta["format"]
    if fmt == "universal":  # DeepSpeed's own loader, at any world size (every file scanned by check_resume)
        load_path, _ = engine.engine.load_checkpoint(str(p / "ds"), tag="ds", load_module_strict=True,
                                                     load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"checkpoint {p}: DeepSpeed found nothing to load in {p / 'ds'}")
    elif engine.backend == "deepspeed" and fmt == "deepspeed":
        # DeepSpeed's own reader unpickles with weights_only=False; read its files through ours instead
        engine.engine.checkpoint_engine.load = lambda f, map_location=None: safeload.load(f, "deepspeed")
        load_path, _ = engine.engine.load_checkpoint(str(p / "ds"), tag="ds", load_module_strict=True,
                                                     load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"checkpoint {p}: DeepSpeed found nothing to load in {p / 'ds'}")
    elif engine.backend == "deepspeed":
        import_deepspeed(engine, state if state is not None else load_full(p))
    elif fmt == "sharded":

        model, optim = engine.model, engine.optimizer
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        reader, planner = safeload.dcp_reader_and_planner(p / "dcp")
        dcp.load(sd, storage_reader=reader, planner=planner)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optim, sd["optim"])
    else:  # full -> FSDP: rank 0 reads, everyone receives its shard

        state = (state or load_full(p)) if rank == 0 else {"model": {}, "optim": {}}
        opts = _opts(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(engine.model, state["model"], options=opts)
        set_optimizer_state_dict(engine.model, engine.optimizer, state["optim"], options=opts)
    rng = p / "rng" / f"rank{rank}.pt"
    if rng.is_file() and meta["world_size"] == dist.get_world_size():
        set_rng_state(safeload.load(rng, "rng"))
    return int(meta["step"])


def check_args(args, job, world_size: int) -> dict | None:
    """The checkpoint flags of helpers.train, checked before anything starts; returns the resume meta."""
    every, d = args.checkpoint_every, args.checkpoint_dir
    if every is not None and every < 1:
        raise CheckpointError(f"--checkpoint-every = {every}: expected a number of steps >= 1")
    if every and not d:
        raise CheckpointError("--checkpoint-every needs --checkpoint-dir DIR (where step_K directories go)")
    if d and not every:
        raise CheckpointError(f"--checkpoint-dir {d}: give --checkpoint-every K too (save every K steps)")
    if d and Path(d).exists() and not Path(d).is_dir():
        raise CheckpointError(f"--checkpoint-dir {d}: is a file, not a directory")
    if asks_universal(job) and not args.resume:
        job.notes.append("checkpoint.load_universal = true: no effect without --resume (it says how to read the "
                         "checkpoint a job resumes from)")
    return check_resume(args.resume, job, world_size) if args.resume else None
