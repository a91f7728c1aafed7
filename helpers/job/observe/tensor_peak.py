"""The peak of a rank's own tensor memory: exact on a CPU, the allocator's peak on a GPU.

``summary.json`` holds ``peak_tensor_bytes`` (one value per rank) and ``peak_tensor_source``.

The window is the training steps from the first one through the memory probe's step (step 1,
where Adam's states exist; every later step repeats that step's pattern), set-up excluded: what is
alive when the first step begins counts, the set-up's transient peak does not.

CPU: torch's profiler with ``profile_memory`` sees every allocation and free of c10's CPU allocator,
each with the running total of the bytes allocated since the profiler started. It starts before the
model is built, so that total is every tensor of the job that is alive. Allocations made on threads the
profiler does not follow (gloo's worker threads: collectives' temporaries) are left out. The profiler
also records each op (in C++, no Python per op); it stops at the end of the probe step, so a job pays
that for its set-up and steps 0 and 1 only, the warm-up steps the summary's step-time medians leave
out anyway; reading the events is one pass in Python at that point. ``--profile`` runs torch's
profiler itself, and one thread holds one profiler: there the key is null and ``log.txt`` says why.

GPU: ``torch.cuda.max_memory_allocated``, reset when the first step begins, read after the probe step
(through helpers.job.observe.memory.PeakMemory, which folds and resets it around checkpoint saves).

Checkpoint saves are not training: their spans (helpers.job.observe.memory.SIDE_MARK) are left out on both
(``save_peak_memory_bytes`` holds their peak).
"""

from __future__ import annotations

import torch

from helpers.core.internals import cpu_memory_profiler_start, cpu_memory_profiler_stop, profiler_events
from helpers.job.observe.memory import SIDE_MARK
from helpers.job.observe.profiling import _quiet_stderr as _quiet_fd2  # Kineto prints a line on fd 2 at start and stop

MARK = "guide::tensor_peak_window"


class CpuTensorPeak:
    """Counts the CPU allocator's bytes from ``start()``; ``stop()`` gives the largest total from ``mark()`` on."""

    def __init__(self):
        self.active = False

    def start(self) -> None:
        with _quiet_fd2():
            cpu_memory_profiler_start()
        self.active = True

    def mark(self) -> None:
        """The window starts here: an event the profiler records, by which the totals are split."""
        with torch.profiler.record_function(MARK):
            pass

    def stop(self) -> int | None:
        """Stop the profiler; the window's peak in bytes (None if ``mark()`` was never reached)."""
        with _quiet_fd2():
            roots = cpu_memory_profiler_stop()
        self.active = False
        return window_peak(roots)

    def close(self) -> None:
        if self.active:
            with _quiet_fd2():
                cpu_memory_profiler_stop(read=False)
            self.active = False


def cpu_allocations(roots) -> tuple[int | None, list[tuple[int, int, object]]]:
    """The profiler's CPU allocation and free events as ``(time_ns, running total, event)``, in time order
    (the total breaks ties), and the time of the window's mark (None if it was never reached)."""
    mark, allocs = None, []
    for e, name, start, _, total in profiler_events(roots):
        if total is not None:
            allocs.append((start, total, e))
        elif name == MARK:
            mark = start
    allocs.sort(key=lambda a: a[:2])
    return mark, allocs


def _side_spans(roots) -> list[tuple[int, int]]:
    """(start, end) ns of the spans marked as not training (helpers.job.observe.memory.SIDE_MARK: checkpoint saves)."""

    return [(start, end) for _, name, start, end, _ in profiler_events(roots) if name == SIDE_MARK]


def window_peak(roots) -> int | None:
    """The largest running total of allocated bytes from the mark on (the total at the mark included), the
    totals inside spans marked as not training (a checkpoint save) left out."""
    mark, allocs = cpu_allocations(roots)
    if mark is None:
        return None
    side = _side_spans(roots)
    before = [total for t, total, _ in allocs if t < mark]
    during = [total for t, total, _ in allocs if t >= mark and not any(a <= t <= b for a, b in side)]
    return max([before[-1] if before else 0, *during])


def source(device: torch.device, peak) -> str | None:
    """How ``peak_tensor_bytes`` was measured, for summary.json."""
    if peak is None:
        return None
    return "cuda.max_memory_allocated" if device.type == "cuda" else "profiler memory events (CPU allocator)"


# --------------------------------------------------------------------------- --memory-budget-gib

GIB = 2**30


def limit_device(device: torch.device, budget_bytes: int) -> str:
    """On a GPU, make the budget the allocator's limit (an allocation past it raises OutOfMemoryError)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    return f"a limit of the caching allocator ({budget_bytes / total:.4f} of {total / GIB:.1f} GiB)"


def over_budget(peaks: list[int | None], budget_bytes: int, steps: str, budget_gib: float | None = None) -> str | None:
    """Why the job stops (the largest rank's peak passed the budget), or None when every rank fits.

    ``budget_gib``: the value the user gave, printed as given (bytes back to GiB can read 0.000999999)."""
    known = [(p, r) for r, p in enumerate(peaks) if p is not None]
    if not known:
        return None
    peak, rank = max(known)
    if peak <= budget_bytes:
        return None
    return (f"peak tensor memory {peak / GIB:.4f} GiB (rank {rank}, steps {steps}) passed "
            f"--memory-budget-gib {budget_gib if budget_gib is not None else budget_bytes / GIB:g}")
