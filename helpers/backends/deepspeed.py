"""DeepSpeed ZeRO behind the guide's engine interface.

``apply_deepspeed(model, job, device)`` fills the DeepSpeed config's
``"auto"`` values from the job, calls ``deepspeed.initialize`` with a torch
AdamW (the optimizer an Accelerate script would pass), and returns an engine
with ``train_step(batches) -> (loss, grad_norm)`` - the same shape as
``helpers.backends.fsdp.apply_fsdp``.

With ``bf16.enabled`` DeepSpeed keeps the module in bf16 and builds fp32
master partitions for the optimizer (``_create_fp32_partitions``), whatever
dtype the model was loaded in.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ..config import JobConfig


def resolved_ds_config(job: JobConfig, world_size: int) -> tuple[dict, list[str]]:
    """The DeepSpeed config dict with every "auto" filled; also the list of what was filled."""
    js = copy.deepcopy(job.deepspeed.json)
    t = job.train
    fill = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
    }
    filled = []
    for k, v in fill.items():
        if js.get(k, "auto") == "auto":
            if k in js or k != "gradient_clipping":
                js[k] = v
                filled.append(f"{k}={v}")
    if js["train_batch_size"] != fill["train_batch_size"]:
        raise ValueError(
            f"train_batch_size = {js['train_batch_size']} in the DeepSpeed config, but micro-batch "
            f"{t.micro_batch} x accumulation {t.grad_accum} x {world_size} ranks = {fill['train_batch_size']}"
        )
    js.setdefault("zero_allow_untested_optimizer", True)  # a torch optimizer, as Accelerate passes
    js.setdefault("steps_per_print", 10**12)
    js.setdefault("wall_clock_breakdown", False)
    return js, filled


def apply_deepspeed(model: torch.nn.Module, job: JobConfig, device: torch.device) -> DeepSpeedEngine:
    import deepspeed

    ds_config, _ = resolved_ds_config(job, dist.get_world_size())
    model.to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=job.train.lr, weight_decay=job.train.weight_decay, foreach=False
    )
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if job.train.compile:
        engine.compile()  # torch.compile of the wrapped module, ZeRO's hooks kept outside the graph
    return DeepSpeedEngine(engine, optimizer)


class DeepSpeedEngine:
    """One optimizer step over a list of micro-batches, DeepSpeed style."""

    backend = "deepspeed"

    def __init__(self, engine, optimizer):
        self.engine, self.optimizer = engine, optimizer

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def train_step(self, batches: list[torch.Tensor], probe=None) -> tuple[torch.Tensor, float]:
        """Forward/backward every micro-batch, then one optimizer step. ``probe``: see helpers.memory."""
        total = torch.zeros((), dtype=torch.float32, device=batches[0].device)
        for i, ids in enumerate(batches):
            with probe.forward(i) if probe else nullcontext(), record_function("guide::forward"):
                loss = self.engine(input_ids=ids, labels=ids).loss
            with record_function("guide::backward"):
                self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps
            if probe and i == len(batches) - 1:
                probe.after_backward(self)  # gradients reduced, optimizer not yet stepped
            with record_function("guide::optimizer_step"):
                self.engine.step()  # steps the optimizer on the last micro-batch only
            total += loss.detach().float()
        norm = self.engine.get_global_grad_norm()
        return total / len(batches), float(norm if norm is not None else float("nan"))
