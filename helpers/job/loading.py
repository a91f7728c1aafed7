"""Three ways to load a pretrained checkpoint (``--model DIR``: config.json + safetensors), measured per rank.

Which way follows the launch config, with Accelerate's keys:

``naive``       (the default) every rank calls ``from_pretrained`` and holds the whole
                model before the backend shards it: peak memory = world size x model.
``fsdp_ram_efficient``  (``fsdp_cpu_ram_efficient_loading: true`` + ``fsdp_sync_module_states:
                true``) every rank builds the model on the *meta* device (shapes, no memory),
                shards it, allocates only its shard (``to_empty``); rank 0 alone reads the
                file, and ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``
                sends each rank its part. With ``fsdp_offload_params`` the shards are
                allocated on the host, where FSDP2's CPU offload keeps them.
``zero3_init``  (DeepSpeed ``zero3_init_flag: true``, ZeRO-3) transformers sees a live
                ``HfDeepSpeedConfig`` and builds the model inside ``deepspeed.zero.Init``:
                each parameter is partitioned the moment it is created, then filled from
                the file.

The rotary-buffer trap: RoPE's ``inv_freq`` is a *non-persistent* buffer, not in the
state dict. After meta init + ``to_empty`` it holds whatever was in memory, and no
state dict will fix it; ``fix_rotary`` recomputes it from the config.

``LoadMonitor`` samples ``RssAnon`` and ``RssFile`` from ``/proc/self/status`` (plain
RSS mixes in the memory-mapped safetensors pages, which the kernel can drop) every
few ms during the load (model creation until the weights are sharded: through the
backend's ``fully_shard`` for naive and RAM-efficient loading, through ``from_pretrained``
for ZeRO-3 init, before ``deepspeed.initialize`` allocates the optimizer);
``summary["loading"]`` gets, per rank, the seconds, the peaks above the baseline, and
whether every loaded value equals the file's, in its place (``mismatches``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from helpers.core.internals import dtensor_global_offset, non_persistent_buffers
from helpers.core.mapping import zero3_local_numel
from helpers.core.models import from_pretrained, model_config, resolve_model
from helpers.job import comm
from helpers.job.observe.memory import proc_status_bytes

METHODS = ("naive", "fsdp_ram_efficient", "zero3_init")


def method_for(job) -> str:
    if job.backend == "fsdp" and job.fsdp.cpu_ram_efficient_loading:
        return "fsdp_ram_efficient"
    if job.backend == "deepspeed" and job.deepspeed.zero3_init_flag and job.deepspeed.zero_stage == 3:
        return "zero3_init"
    return "naive"


def rss() -> dict[str, int]:
    """RssAnon and RssFile of this process, bytes (Linux); zeros elsewhere."""
    return proc_status_bytes("RssAnon", "RssFile")


class LoadMonitor:
    """Peak RssAnon / RssFile above the start, sampled by a thread while the load runs."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.base = every_s, rss()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="guide-load-monitor")

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.every_s)

    def sample(self):
        for k, v in rss().items():
            self.peak[k] = max(self.peak[k], v)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()
        self.seconds = time.perf_counter() - self.t0
        now = rss()
        self.result = {"seconds": self.seconds,
                       "peak_rss_anon_bytes": self.peak["RssAnon"] - self.base["RssAnon"],
                       "peak_rss_file_bytes": self.peak["RssFile"] - self.base["RssFile"],
                       "after_rss_anon_bytes": now["RssAnon"] - self.base["RssAnon"]}


def fix_rotary(model: torch.nn.Module, device) -> int:
    """Recompute the non-persistent buffers of every rotary-embedding module; returns how many."""
    n = 0
    for m in model.modules():
        if any(name == "inv_freq" for name, _ in m.named_buffers(recurse=False)) and hasattr(m, "config"):
            with torch.device("cpu"):
                fresh = type(m)(config=m.config)
            for name in non_persistent_buffers(m):
                setattr(m, name, getattr(fresh, name).to(device))  # a registered buffer: stays one, non-persistent
            n += 1
    return n


def meta_model(spec, dtype):
    """The model's modules and shapes on the meta device: no memory, no weights."""
    from transformers import AutoModelForCausalLM


    cfg = model_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.config.use_cache = False
    return model


def fsdp_fill(engine, spec, dtype, device, offload: bool = False) -> None:
    """After fully_shard on the meta model: allocate the shards, rank 0 reads, broadcast, fix RoPE.

    ``offload`` (``fsdp_offload_params``): FSDP2 keeps the shards on the host and refuses, at the first
    forward, shards materialised anywhere else ("FSDP parameters should be materialized on CPU when
    enabling CPU offloading"), so they are allocated on the CPU (FSDP2 pins them at its lazy init) and
    only the buffers (RoPE's) go to ``device``, where forward runs.
    """

    model = engine.model
    model.to_empty(device="cpu" if offload else device)
    if offload:
        for m in model.modules():
            for name, b in list(m.named_buffers(recurse=False)):
                setattr(m, name, b.to(device))
    full = {}
    if dist.get_rank() == 0:
        full = from_pretrained(spec.path, dtype).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    fix_rotary(model, device)


def zero3_model(spec, dtype, ds_config: dict):
    """from_pretrained inside deepspeed.zero.Init, through transformers' DeepSpeed integration."""
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_config)  # transformers looks it up through a weak reference
    model = from_pretrained(spec.path, dtype)
    model.config.use_cache = False
    model._guide_hf_ds_config = keep
    return model


def _local_piece(p) -> tuple[torch.Tensor, int | tuple[int, ...]]:
    """This rank's piece of parameter ``p`` and where it starts in the whole: a flat offset (ZeRO-3's flat
    partition), a per-dimension offset (an FSDP2 DTensor), or () for a whole, replicated tensor."""
    if hasattr(p, "ds_tensor"):  # rank r holds flat elements [r * part, (r + 1) * part), then zero padding
        part = p.ds_tensor.numel()
        keep = zero3_local_numel(p.ds_numel, part, dist.get_rank())
        return p.ds_tensor.reshape(-1)[:keep], dist.get_rank() * part
    if hasattr(p, "to_local"):
        return p.to_local(), dtensor_global_offset(p)
    return p.data, ()


def mismatches(engine, path: str, dtype) -> list[str]:
    """The parameters whose values on any rank differ from the safetensors file's, rounded to the load dtype.

    Each rank compares its own piece, element by element, with the same slice of the file (read one tensor at
    a time): a value in the wrong place, a piece on the wrong rank or two tensors swapped all show, which sums
    could not. Returns the names (the same list on every rank); empty when every value is where it should be."""
    from safetensors import safe_open

    params = list(engine.module.named_parameters())
    bad = torch.zeros(len(params), dtype=torch.float64)
    with contextlib.ExitStack() as stack:  # each file opened once (memory-mapped), read one tensor at a time
        where = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            fh = stack.enter_context(safe_open(str(f), framework="pt"))
            where.update(dict.fromkeys(fh.keys(), fh))
        for i, (name, p) in enumerate(params):
            bad[i] = name not in where or not _piece_matches(p, where[name].get_tensor(name).to(dtype))
    bad = comm.all_reduce(bad)  # a CPU tensor: nccl serves only GPU tensors
    return [n for (n, _), b in zip(params, bad.tolist(), strict=True) if b]


def _piece_matches(p, ref: torch.Tensor) -> bool:
    """This rank's piece of ``p`` equals the same slice of the whole tensor ``ref``."""
    local, start = _local_piece(p)
    local = local.detach().cpu()
    if isinstance(start, int):
        ref = ref.reshape(-1)[start:start + local.numel()]
    elif start:
        ref = ref[tuple(slice(o, o + n) for o, n in zip(start, local.shape, strict=True))]
    return ref.shape == local.shape and torch.equal(ref.to(local.dtype), local)


def save_preset(preset: str, path: str, seed: int = 0) -> None:
    """A local 'pretrained' checkpoint: the preset with seeded random weights, ``save_pretrained`` (fp32)."""
    from transformers import AutoModelForCausalLM


    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(resolve_model(preset)), dtype=torch.float32)
    model.save_pretrained(path)  # config.json + model.safetensors
