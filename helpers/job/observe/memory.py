"""What each rank really holds, read from the live tensors of either backend.

``state_bytes(engine)`` is called after the backward pass and before the
optimizer step of the second step (so Adam's lazily created states exist).
It returns, per rank, the bytes of

``params``            the stored parameters: FSDP's local shards (``p.to_local()``),
                      DeepSpeed's bf16 flat buffer (ZeRO-0/1/2), or its partitions
                      ``p.ds_tensor`` plus the small "persistent" params ZeRO-3 keeps
                      whole, plus the hpZ secondary shard ``p.ds_secondary_tensor``;
``grads``             the gradients kept for the optimizer step (FSDP's local grad
                      shards; DeepSpeed's reduced gradient partitions or full grads);
``optimizer_states``  every tensor in the optimizer's state (Adam's exp_avg and
                      exp_avg_sq, and the step counters);
``master_params``     a separate fp32 copy of the params for the optimizer: DeepSpeed's
                      fp32 partitions under bf16; for FSDP, any tensor its optimizer
                      steps that is not one of the model's parameters (none when the
                      fp32 shard is itself what the optimizer updates).

Tensors are counted by their underlying storage, once: views into one flat
buffer (DeepSpeed) count as that buffer, padding included.

Also here: peak anonymous memory of the process (``RssAnon`` sampled at each
phase; plain RSS would also count memory-mapped files) or, on GPU,
``torch.cuda.max_memory_allocated``; and activation bytes saved for backward.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from helpers.core.internals import (
    CHECKPOINT_WRAPPED,
    torch_optimizer,
    zero0_masters,
    zero12_flat_params,
    zero_flat_masters,
    zero_grads,
)
from helpers.core.mapping import CATEGORIES


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_tensors(engine) -> dict[str, list]:
    params = [p for p in engine.model.parameters()]
    own = {id(p) for p in params}
    stepped = [p for g in torch_optimizer(engine.optimizer).param_groups for p in g["params"]]
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer_states": [v for s in engine.optimizer.state.values() for v in s.values()],
        "master_params": [p for p in stepped if id(p) not in own],  # measured: the optimizer's own copies, if any
    }


def _ds_tensors(engine) -> dict[str, list]:
    zopt = engine.engine.optimizer
    module_params = list(engine.module.parameters())
    states = [v for s in torch_optimizer(zopt).state.values() for v in s.values()]
    name = type(zopt).__name__
    if name == "DeepSpeedZeroOptimizer_Stage3":
        params = [p.ds_tensor for p in module_params] + [p.data for p in module_params]
        params += [p.ds_secondary_tensor for p in module_params if getattr(p, "ds_secondary_tensor", None) is not None]
        return {"params": params, "grads": zero_grads(zopt),
                "optimizer_states": states, "master_params": list(zero_flat_masters(zopt))}
    if name == "DeepSpeedZeroOptimizer":  # stages 1 and 2; a frozen parameter is in no flat buffer: whole, apart
        frozen = [p.data for p in module_params if not p.requires_grad]
        return {"params": zero12_flat_params(zopt) + frozen, "grads": zero_grads(zopt), "optimizer_states": states,
                "master_params": list(zero_flat_masters(zopt))}
    # ZeRO-0: with bf16 a full fp32 master next to the bf16 module
    return {"params": module_params, "grads": [p.grad for p in module_params if p.grad is not None],
            "optimizer_states": states, "master_params": zero0_masters(zopt) or []}


def frozen_storages(engine) -> set[int]:
    """Storages (data_ptr) holding frozen parameters on this rank: FSDP's shards, ZeRO-3's partitions (and
    hpZ shards, and the whole ones it keeps), ZeRO-0/1/2's module parameters."""
    out = set()
    for p in engine.module.parameters():
        if p.requires_grad:
            continue
        for t in (p, getattr(p, "ds_tensor", None), getattr(p, "ds_secondary_tensor", None)):
            if torch.is_tensor(t) and _local(t).numel():
                out.add(_local(t).untyped_storage().data_ptr())
    return out


def state_split(engine) -> dict[str, dict[str, int]]:
    """``state_bytes`` split into what belongs to trainable parameters and to frozen ones (--peft); only weights
    can be frozen: gradients, optimizer states and masters exist for trainable parameters only."""
    groups = _fsdp_tensors(engine) if engine.backend == "fsdp" else _ds_tensors(engine)
    frozen_ptrs, seen = frozen_storages(engine), set()
    out = {"trainable": dict.fromkeys(CATEGORIES, 0), "frozen": dict.fromkeys(CATEGORIES, 0)}
    for cat in CATEGORIES:
        for t in groups[cat]:
            if not torch.is_tensor(t) or _local(t).numel() == 0:
                continue
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out["frozen" if storage.data_ptr() in frozen_ptrs else "trainable"][cat] += storage.nbytes()
    return out


def state_bytes(engine, split: dict | None = None) -> dict[str, int]:
    """Bytes per category on this rank, each storage counted once (see module doc): ``state_split``'s two parts
    added up (``split``: one already taken)."""
    split = split or state_split(engine)
    return {cat: split["trainable"][cat] + split["frozen"][cat] for cat in CATEGORIES}


def proc_status_bytes(*keys: str) -> dict[str, int]:
    """Fields of this process's /proc/self/status that are in kB (``RssAnon``, ``RssFile``), in bytes; 0 where
    the file or the field is missing (not Linux)."""
    out = dict.fromkeys(keys, 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process (heap, tensors)."""
    return proc_status_bytes("RssAnon")["RssAnon"]


SIDE_MARK = "guide::outside_training"  # a span the CPU tensor-peak profiler leaves out (tensor_peak)


class PeakMemory:
    """Peak memory of training: max_memory_allocated on GPU, else RssAnon sampled at each phase.

    Call ``end_setup()`` once the model is built, sharded and loaded: on a GPU the model goes to the
    device whole and is upcast there before it is sharded, so without a reset the allocator's peak would be
    that load, not training (and hide what offload saves). ``setup_peak`` keeps the set-up's peak.

    Work between steps that is not training (a checkpoint save) runs inside ``outside_training()``: its
    peak goes to ``save_peak``, not ``peak`` (GPU: the allocator's peak is folded into ``peak`` and reset
    around it; CPU: RssAnon is sampled before and after it, and the span is marked for the tensor-peak
    profiler). This object is the only one that resets the GPU allocator's peak during training.
    """

    def __init__(self, device: torch.device):
        self.device, self.peak, self.setup_peak, self.save_peak = device, 0, None, None
        self.source = "cuda.max_memory_allocated" if device.type == "cuda" else "RssAnon (sampled per phase)"

    def end_setup(self) -> None:
        """The set-up's peak goes to ``setup_peak``; ``peak`` counts from here (what is alive now included)."""
        if self.device.type == "cuda":
            self.setup_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:  # RssAnon cannot be reset; samples start at the first forward anyway
            self.setup_peak = max(self.peak, rss_anon_bytes())
        self.peak = 0

    def sample(self, *_args) -> None:
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak = max(self.peak, rss_anon_bytes())

    @contextmanager
    def outside_training(self):
        """A window whose peak is ``save_peak`` (max over windows), left out of ``peak``."""
        self.sample()  # training so far
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with torch.profiler.record_function(SIDE_MARK):
                yield
        finally:
            if self.device.type == "cuda":
                now = torch.cuda.max_memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)  # training's peak starts again from what is alive
            else:
                now = rss_anon_bytes()  # at the window's end: a lower bound of its peak
            self.save_peak = max(self.save_peak or 0, now)


class SavedActivations:
    """Bytes autograd keeps for backward after one forward, parameters excluded.

    Saved tensors are collected during the forward; at its end, storages that
    are freed (FSDP reshards gathered params) or belong to a parameter (weights
    saved by matmuls) are dropped, and the rest summed once per storage.

    Under activation checkpointing (helpers.job.recompute) a block saves nothing of
    its own (the checkpoint keeps placeholders); it holds its inputs for the
    recompute: the positional ones reach the hook (the checkpoint saves them),
    the keyword ones (rotary cos/sin, masks) are held by a closure and are
    added here, from the block's forward pre-hook.
    """

    def __init__(self, model: torch.nn.Module):
        self.model, self.bytes, self._saved = model, 0, []

    def _pack(self, t):
        self._saved.append(t)  # addresses are compared at the end: a freed one may be reused meanwhile
        return t

    def _held(self, _module, args, kwargs):
        if torch.is_grad_enabled():
            for v in [*args, *kwargs.values()]:
                self._saved += [t for t in (v if isinstance(v, (tuple, list)) else [v]) if torch.is_tensor(t)]

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        self._hooks = [m.register_forward_pre_hook(self._held, with_kwargs=True)
                       for m in self.model.modules() if _checkpointed(m)]
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        seen = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        self.bytes = 0
        for t in self._saved:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        self._saved.clear()
        return False


def _checkpointed(m: torch.nn.Module) -> bool:
    """A block that activation checkpointing wraps: torch's checkpoint_wrapper, or a transformers layer with its
    own checkpointing on (helpers.job.recompute)."""
    if hasattr(m, CHECKPOINT_WRAPPED):
        return True
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training


class StepProbe:
    """Measures one training step: activations of its first forward, state after its last backward."""

    def __init__(self, model: torch.nn.Module, locate=None):
        self.activations = SavedActivations(model)
        self.state: dict[str, int] | None = None
        self.split: dict[str, dict[str, int]] | None = None  # state, trainable / frozen (state_split)
        self.locate, self.locations = locate, None  # locate(engine): see helpers.job.observe.offload

    def forward(self, micro_step: int):
        return self.activations if micro_step == 0 else nullcontext()

    def after_backward(self, engine) -> None:
        self.split = state_split(engine)  # one walk of the state; state is its sum
        self.state = state_bytes(engine, self.split)
        if self.locate:
            self.locations = self.locate(engine)

