"""Everything that watches a job, behind one small interface.

``helpers.train`` runs the job's phases and calls, on every rank and in this order,
each observer's hooks (the names follow transformers' ``TrainerCallback``):

``on_load_begin(s)``      before the model is created
``on_model_built(s)``     ``s.model`` exists, the backend is not applied yet
``on_engine_ready(s)``    ``s.engine`` exists (sharded, weights in place), before ``--resume``
``on_train_begin(s)``     before the first step (``s.start_step``)
``on_step_begin(s, step)``  before the step's forward; may set ``s.probe`` (see helpers.job.observe.memory)
``step_sums(s)``          numbers of this rank to sum over ranks: the job sends every observer's
                          sums, the loss and the gradient norm in *one* all-reduce per step
``step_row(s, sums)``     this observer's keys in the step's ``metrics.jsonl`` row, from the sums
``on_step_end(s, step, row)``  after the row is written
``on_train_end(s)``       after the last step; collectives allowed (gathers, barriers)
``summary(s)``            this observer's ``summary.json`` keys, as far as measured; also called
                          when the job fails (rank 0, maybe from the watchdog thread): no collectives
``close(s)``              once at the very end, completed or failed: release what it holds

``s`` is the job's ``helpers.job.state.JobState`` (config, rank, device, run directory, model,
engine, ...). Every hook but ``summary`` and ``close`` runs on every rank at the same point,
so a hook may use collectives as long as every rank makes the same calls. A new measurement
is one new ``Observer`` subclass, added in ``default_observers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from helpers.job.state import JobState


def gather(obj) -> list:
    """One value per rank, in rank order (every rank calls this)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Observer:
    """Does nothing at every hook; a measurement overrides the hooks it needs.

    ``provides`` names what this observer offers the others, ``needs`` what it reads from them.
    ``Observers`` runs each hook of a provider before the same hook of the observers that need it,
    and hands each observer its providers as ``self.uses[name]``: no list order to get right.
    """

    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()

    def on_load_begin(self, s: JobState) -> None: ...
    def on_model_built(self, s: JobState) -> None: ...
    def on_engine_ready(self, s: JobState) -> None: ...
    def on_train_begin(self, s: JobState) -> None: ...
    def on_step_begin(self, s: JobState, step: int) -> None: ...
    def step_sums(self, s: JobState) -> dict:
        return {}

    def step_row(self, s: JobState, sums: dict[str, float]) -> dict:
        return {}

    def on_step_end(self, s: JobState, step: int, row: dict) -> None: ...
    def on_train_end(self, s: JobState) -> None: ...
    def summary(self, s: JobState) -> dict:
        return {}

    def close(self, s: JobState) -> None: ...


class Observers(Observer):
    """Observers behind the same interface: each hook calls theirs, every provider before its users."""

    def __init__(self, items: list[Observer]):
        self.items = ordered(items)


    def on_load_begin(self, s):
        for o in self.items:
            o.on_load_begin(s)

    def on_model_built(self, s):
        for o in self.items:
            o.on_model_built(s)

    def on_engine_ready(self, s):
        for o in self.items:
            o.on_engine_ready(s)

    def on_train_begin(self, s):
        for o in self.items:
            o.on_train_begin(s)

    def on_step_begin(self, s, step):
        for o in self.items:
            o.on_step_begin(s, step)

    def step_sums(self, s):
        return {k: v for o in self.items for k, v in o.step_sums(s).items()}

    def step_row(self, s, sums):
        return {k: v for o in self.items for k, v in o.step_row(s, sums).items()}

    def on_step_end(self, s, step, row):
        for o in self.items:
            o.on_step_end(s, step, row)

    def on_train_end(self, s):
        for o in self.items:
            o.on_train_end(s)

    def summary(self, s):
        return {k: v for o in self.items for k, v in o.summary(s).items()}

    def close(self, s):
        for o in self.items:
            o.close(s)


def ordered(items: list[Observer]) -> list[Observer]:
    """``items`` with every observer after the providers of what it needs (otherwise in the given order); each
    observer's ``uses`` filled. A need that no observer provides, or a cycle, is a ValueError naming them."""
    by_name = {name: o for o in items for name in o.provides}
    for o in items:
        missing = [n for n in o.needs if n not in by_name]
        if missing:
            raise ValueError(f"observer {type(o).__name__} needs {', '.join(missing)}: no observer provides it "
                             f"(provided: {', '.join(sorted(by_name)) or 'nothing'})")
        o.uses = {n: by_name[n] for n in o.needs}
    out: list[Observer] = []
    pending = list(items)
    while pending:
        ready = [o for o in pending if all(p in out for p in o.uses.values())]
        if not ready:
            raise ValueError("observers need each other in a cycle: "
                             + ", ".join(f"{type(o).__name__} needs {', '.join(o.needs)}" for o in pending))
        out.append(ready[0])
        pending.remove(ready[0])
    return out
