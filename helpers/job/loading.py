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
whether the loaded weights equal the file (``checksum``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from helpers.core.internals import non_persistent_buffers
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


def checksum(engine) -> list[float]:
    """[sum, sum of squares] in fp64 over all parameter values, from each rank's local shard."""
    acc = torch.zeros(2, dtype=torch.float64)
    for p in engine.module.parameters():
        if hasattr(p, "ds_tensor"):
            t = p.ds_tensor  # ZeRO-3 pads the last rank's piece with zeros: they add nothing
        elif hasattr(p, "to_local"):
            t = p.to_local()
        else:
            t = p.data if dist.get_rank() == 0 else p.data[:0]  # replicated: count once
        t = t.detach().double().cpu()
        acc += torch.stack([t.sum(), (t * t).sum()])
    return comm.all_reduce(acc).tolist()  # a CPU tensor: nccl serves only GPU tensors


def file_checksum(path: str, dtype) -> list[float]:
    """The same sums over the safetensors file(s), values rounded to the dtype the model was loaded in."""
    from safetensors import safe_open

    acc = torch.zeros(2, dtype=torch.float64)
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k).to(dtype).double()
                acc += torch.stack([t.sum(), (t * t).sum()])
    return acc.tolist()


def weights_match(engine, spec, dtype) -> bool:
    """Loaded (and upcast, if mixed precision did) weights equal the file's, rounded to the load dtype."""
    live = checksum(engine)
    ref = file_checksum(spec.path, dtype)
    return all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(live, ref, strict=True))


def save_preset(preset: str, path: str, seed: int = 0) -> None:
    """A local 'pretrained' checkpoint: the preset with seeded random weights, ``save_pretrained`` (fp32)."""
    from transformers import AutoModelForCausalLM


    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(resolve_model(preset)), dtype=torch.float32)
    model.save_pretrained(path)  # config.json + model.safetensors
