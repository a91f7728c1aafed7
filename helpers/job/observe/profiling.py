"""``helpers.train --profile``: a torch.profiler trace of a few steps, per rank.

    torchrun --standalone --nproc_per_node 2 -m helpers.train \\
        --config launch_configs/fsdp/full_shard.yaml --out runs/fsdp_prof --steps 6 --profile

Every rank records steps ``PROFILE_STEPS`` (after the warm-up steps, where
first-call costs and Adam's lazy state creation would blur the picture) and
writes ``DIR/trace_rank{r}.json`` (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing). The run's ``summary.json`` lists
the profiled steps (``profiled_steps``) and is written only after every rank
has written its trace.

Recorded: CPU activity (CUDA kernels too when a GPU is used), input shapes
(collective sizes) and allocations (peak allocated bytes on CPU). Both
backends' engines mark their phases with ``record_function`` (``guide::forward``,
``guide::backward``, ``guide::optimizer_step``); FSDP2 adds its own
``FSDP::...`` annotations. ``helpers.nb.traces`` reads the files.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

WAIT, WARMUP, ACTIVE = 1, 1, 2  # steps 0 (skipped), 1 (profiler warm-up), then 2 and 3 recorded
PROFILE_STEPS = list(range(WAIT + WARMUP, WAIT + WARMUP + ACTIVE))
MIN_STEPS = WAIT + WARMUP + ACTIVE


def trace_path(out: str | Path, rank: int) -> Path:
    return Path(out) / f"trace_rank{rank}.json"


def quiet_cpp_warnings() -> None:
    """Call before torch is imported: memory profiling warns once per rank about blocks allocated
    before it started (their frees are not recorded; harmless here)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


@contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment (output of C++ code that Python cannot redirect)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class StepProfiler:
    """Wraps torch.profiler with the guide's schedule; does nothing when disabled."""

    def __init__(self, out: str | Path, rank: int, enabled: bool, use_cuda: bool = False):
        self.enabled, self.path = enabled, trace_path(out, rank)
        self._prof = None
        if not enabled:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=self._export,
            record_shapes=True,
            profile_memory=True,
        )
        with _quiet_stderr():
            self._prof.start()

    def _export(self, prof) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)

    def step(self) -> None:
        """Call once after every training step."""
        if self._prof is not None:
            with _quiet_stderr():  # the tracer prints a start/stop line per rank on the C++ stderr
                self._prof.step()

    def finish(self) -> list[int] | None:
        """Stop, make sure every rank's trace is on disk, return the profiled steps (None when disabled)."""
        if self._prof is None:
            return None
        import torch.distributed as dist

        with _quiet_stderr():
            self._prof.stop()
        self._prof = None
        if not self.path.is_file():
            raise RuntimeError(f"--profile: the profiler wrote no trace to {self.path}")
        if dist.is_initialized():
            dist.barrier()  # every rank's trace is written before rank 0 writes the summary
        return PROFILE_STEPS
