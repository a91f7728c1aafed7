"""What one rank's job phases and observers share: ``JobState``, and the summary keys known up front.

Each field says who writes it: a phase of helpers.job.run (validate, start, connect, build, wrap,
restore, the loop, summarise) or an observer (helpers.job.observe.observers). Everyone else reads.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from helpers.core.config import JobConfig
    from helpers.core.metrics import RunDir
    from helpers.core.models import ModelSpec
    from helpers.job.guard import JobGuard
    from helpers.job.observe.base import Observers


def env_int(name: str, default: int) -> int:
    """An integer the launcher (torchrun, Slurm) put in the environment."""
    return int(os.environ.get(name, default))


@dataclass
class JobState:
    """One per rank. Written by the phase or observer named on each field; read by the rest."""

    # validate: every input, checked before anything starts
    args: argparse.Namespace
    job: JobConfig
    spec: ModelSpec
    rank: int
    world_size: int
    guard: JobGuard
    run: RunDir  # writes only on rank 0
    resolved: dict  # the config as it runs (config.json)
    ds_filled: list[str]  # DeepSpeed "auto" values the job filled
    resume_meta: dict | None  # --resume: the checkpoint's meta.json
    peft: object = None  # --peft: the LoraConfig (helpers.job.lora), or None
    # start
    device: torch.device | None = None
    observers: Observers | None = None
    # start (base_summary), then build, wrap, restore, summarise; every observer's keys at the end
    summary: dict = field(default_factory=dict)  # summary.json
    # the loop: one row per step (metrics.jsonl)
    records: list[dict] = field(default_factory=list)
    # build
    model: torch.nn.Module | None = None
    # build (before wrap): what the post-wrap audit compares against (helpers.job.audit)
    before_wrap: object = None
    # wrap
    engine: object = None  # FSDPEngine or DeepSpeedEngine (helpers.job.backends)
    resume_state: dict | None = None  # wrap, DeepSpeed --resume: state read before the backend; restore clears it
    # restore
    start_step: int = 0
    # the Memory observer (provides "step_probe"), at each step's begin; the loop hands it to train_step
    probe: object = None  # helpers.job.observe.memory.StepProbe for the step about to run, or None
    # the loop
    in_loop: bool = False  # the loop has started (an out-of-memory before it is the set-up's)

    @property
    def use_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.use_cuda else "gloo"

    @property
    def tokens_per_rank_step(self) -> int:
        t = self.job.train
        return t.micro_batch * t.grad_accum * t.seq_len

    @property
    def probe_step(self) -> int:
        """The step the memory and dtype probes read (step 1: Adam's states exist)."""
        return self.start_step + min(1, self.job.train.steps - self.start_step - 1)

    @property
    def load_method(self) -> str | None:
        """How --model DIR is loaded (helpers.job.loading); None for random init."""
        from helpers.job.loading import method_for

        return method_for(self.job) if self.spec.kind == "pretrained" else None

    @property
    def model_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.job.train.model_dtype == "bf16" else torch.float32


def versions() -> dict:
    out = {}
    for pkg in ("torch", "deepspeed", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def base_summary(s: JobState) -> dict:
    """summary.json's keys known before the job starts (a failed job keeps them)."""
    import torch

    from helpers.job.reuse import job_key

    job, t = s.job, s.job.train
    nodes = env_int("GROUP_WORLD_SIZE", 1) if "GROUP_WORLD_SIZE" in os.environ \
        else max(1, s.world_size // env_int("LOCAL_WORLD_SIZE", s.world_size))
    return {
        "status": "failed", "reason": None, "failed_rank": None, "backend": job.backend,
        "config": s.args.config, "mode": mode_name(job), "mixed_precision": job.mixed_precision,
        "world_size": s.world_size, "num_nodes": nodes, "model": t.model, "num_params": None, "steps": 0,
        "tokens_per_step": s.tokens_per_rank_step * s.world_size,
        "device": torch.cuda.get_device_name(s.device) if s.use_cuda else "cpu",
        "dist_backend": s.dist_backend, "versions": versions(), "resumed_from": None,
        "peft": None, "audit": None, "activation_checkpointing": None, "optimizer_impl": None,
        "memory_budget_bytes": None, "memory_budget_fits": None,
        "deterministic": bool(s.args.deterministic) and s.use_cuda,  # GPU: deterministic algorithms were on
        "job_key": job_key(s.args, s.world_size), "reused_from": None, "reuse_key": None,  # --reuse compares, sets
    }


def mode_name(job) -> str:
    if job.backend == "fsdp":
        return job.fsdp.sharding
    return f"ZeRO-{job.deepspeed.zero_stage}"


