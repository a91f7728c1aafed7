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

``s`` is the job's ``helpers.job.run.JobState`` (config, rank, device, run directory, model,
engine, ...). Every hook but ``summary`` and ``close`` runs on every rank at the same point,
so a hook may use collectives as long as every rank makes the same calls. A new measurement
is one new ``Observer`` subclass, added in ``default_observers``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from helpers.job.run import JobState


def gather(obj) -> list:
    """One value per rank, in rank order (every rank calls this)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Observer:
    """Does nothing at every hook; a measurement overrides the hooks it needs."""

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
    """A list of observers behind the same interface: each hook calls theirs in order."""

    def __init__(self, items: list[Observer]):
        self.items = list(items)

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


def default_observers(s: JobState) -> Observers:
    """The guide's measurements, in the order their hooks run (and their log lines appear)."""
    traces = [TensorTraces()] if s.args.trace_tensors else []
    memory = Memory()
    peak = TensorPeak(memory)
    return Observers([Throughput(), Loading(), memory, peak, MemoryBudget(peak, s.args.memory_budget_gib), Dtypes(),
                      Updates(enabled=s.args.track_updates), Profiler(), *traces, ProgressLog(),
                      Checkpoints(memory)])


# ---------------------------------------------------------------------------------------------- the measurements


class Throughput(Observer):
    """Device peak (logged at start), FLOPs per token, and the summary's MFU keys (helpers.job.observe.throughput)."""

    def __init__(self):
        self.keys: dict = {}

    def on_load_begin(self, s):
        from helpers.job.observe.throughput import compute_dtype, device_peak, fmt_flops

        self.peak, self.source = device_peak(s.device, compute_dtype(s.job), s.args.peak_tflops)
        s.run.log(f"peak {fmt_flops(self.peak)} per device ({self.source})" if self.peak
                  else f"note: no MFU: {self.source}")

    def on_model_built(self, s):
        from helpers.job.observe.throughput import flops_per_token

        self.flops = flops_per_token(s.model, s.job.train.seq_len)  # the whole model, before any sharding

    def on_train_end(self, s):
        from helpers.core.metrics import summarize_steps
        from helpers.job.observe.throughput import summary_keys

        tps = summarize_steps(s.records, s.tokens_per_rank_step)["tokens_per_s_per_rank"]
        self.keys = summary_keys(self.flops, tps, self.peak, self.source)

    def summary(self, s):
        return self.keys  # once the loop is over


class Loading(Observer):
    """``--model DIR``: time and peak RSS per rank of the load, and whether the weights match the file."""

    def __init__(self):
        self.monitor, self.record = None, None

    def on_load_begin(self, s):
        if s.load_method:
            from helpers.job.loading import LoadMonitor

            dist.barrier()  # every rank starts the load together
            self.monitor = LoadMonitor()
            self.monitor.__enter__()

    def on_model_built(self, s):
        if s.load_method == "zero3_init":  # partitioned as it loaded: the load ends here, before the optimizer
            self.monitor.__exit__(None, None, None)

    def on_engine_ready(self, s):
        if not self.monitor:
            return
        from helpers.job.loading import weights_match

        if s.load_method != "zero3_init":  # naive and RAM-efficient: the load ends once the weights are sharded
            self.monitor.__exit__(None, None, None)
        m = self.monitor
        self.record = {"method": s.load_method, "path": s.spec.path, "ranks": gather(m.result),
                       "weights_match": weights_match(s.engine, s.spec, s.model_dtype)}
        s.run.log(f"loaded {s.spec.path} ({s.load_method}): {m.seconds:.2f} s, peak RssAnon "
                  f"+{m.result['peak_rss_anon_bytes'] / 2**20:.0f} MiB on rank 0, weights match the file: "
                  f"{self.record['weights_match']}")

    def summary(self, s):
        return {"loading": self.record}


class Memory(Observer):
    """Per-rank state bytes at step 1 next to the ZeRO model, peak memory, activations (helpers.job.observe.memory)."""

    def __init__(self):
        self.keys: dict = {}

    def on_model_built(self, s):
        from functools import partial

        from helpers.job.observe.memory import PeakMemory, StepProbe
        from helpers.job.observe.offload import state_locations

        self.peak = PeakMemory(s.device)
        s.model.register_forward_hook(self.peak.sample)  # activations are all alive at the end of forward
        locate = partial(state_locations, accelerator=s.use_cuda, rank=s.rank,
                         ds_json=s.job.deepspeed.json if s.job.deepspeed else None)
        self.probe = StepProbe(s.model, locate)

    def on_train_begin(self, s):
        self.peak.end_setup()  # the GPU allocator's peak counts training from here (setup_peak_memory_bytes)

    def on_step_begin(self, s, step):
        if step == s.probe_step:  # step 1: Adam's states exist
            s.probe = self.probe

    def on_step_end(self, s, step, row):
        self.peak.sample()
        if step == s.probe_step:
            from helpers.job.observe.offload import swap_buffer_bytes

            self.keys.update(memory_summary(s.job, self.probe, self.peak, s.summary["num_params"],
                                            s.job.train.micro_batch))
            self.keys["swap_buffer_bytes"] = gather(swap_buffer_bytes(s.engine))

    def on_train_end(self, s):
        self.peak.sample()  # the last step's peak (a save after it was sampled apart, save_peak)
        self.keys["peak_memory_bytes"] = gather(self.peak.peak)
        self.keys["setup_peak_memory_bytes"] = gather(self.peak.setup_peak)
        self.keys["save_peak_memory_bytes"] = gather(self.peak.save_peak)

    def summary(self, s):
        return self.keys


def memory_summary(job, probe, peak, num_params: int, micro_batch: int) -> dict:
    """Per-rank measured state next to the ZeRO model's prediction (summary.json keys)."""
    from helpers.core.mapping import job_theory_bytes, mode_key
    from helpers.job.observe.offload import totals

    key = mode_key(job)
    theory = job_theory_bytes(job, num_params, dist.get_world_size())
    return {
        "mode_key": key,
        "memory_bytes": gather(totals(probe.locations)),  # probe.state + swap files + host fp32 grads
        "memory_location_bytes": gather(probe.locations),
        "memory_theory_bytes": theory,
        "peak_memory_source": peak.source,
        "activation_bytes_per_sample": probe.activations.bytes / micro_batch,
    }


class TensorPeak(Observer):
    """``peak_tensor_bytes`` per rank: the peak of the rank's own tensors over the first steps (observe.tensor_peak).
    On a GPU it reads ``memory``'s allocator peak (which leaves checkpoint saves out), taken as the first step
    begins."""

    def __init__(self, memory: Memory):
        self.memory, self.cpu, self.peak, self.keys = memory, None, None, {}

    def on_load_begin(self, s):
        if s.use_cuda:
            return
        if s.args.profile:
            s.run.log("note: peak_tensor_bytes not tracked (null): --profile holds the profiler it is read from")
            return
        from helpers.job.observe.tensor_peak import CpuTensorPeak

        self.cpu = CpuTensorPeak()
        self.cpu.start()  # before the model exists: the running total is every tensor of the job

    def on_train_begin(self, s):  # after Memory's: the GPU allocator's peak was reset there (end_setup)
        if self.cpu:
            self.cpu.mark()

    def on_step_end(self, s, step, row):
        if step != s.probe_step:
            return
        if s.use_cuda:
            self.peak = self.memory.peak.peak  # sampled at this step's end (Memory runs first)
        elif self.cpu:
            self.peak = self.cpu.stop()
        self.gather(s)  # here, so that MemoryBudget can compare every rank's peak with the budget

    def on_train_end(self, s):
        if not self.keys:  # no step ran (a resume at the last step)
            self.gather(s)

    def gather(self, s):
        from helpers.job.observe.tensor_peak import source

        self.keys = {"peak_tensor_bytes": gather(self.peak), "peak_tensor_source": source(s.device, self.peak)}

    def summary(self, s):
        return self.keys

    def close(self, s):
        if self.cpu:
            self.cpu.close()


class MemoryBudget(Observer):
    """``--memory-budget-gib G``: on a GPU the allocator's limit (an out-of-memory stops the job cleanly, see
    ``helpers.job.run.budget_verdict``); on a CPU, after the probe step, every rank's ``peak_tensor_bytes`` against
    the budget (over it: the job stops with one ``error:`` line). ``memory_budget_bytes``, ``memory_budget_fits``."""

    def __init__(self, peak: TensorPeak, gib: float | None):
        self.peak, self.budget, self.fits = peak, int(gib * 2**30) if gib else None, None

    def on_load_begin(self, s):
        if self.budget and s.use_cuda:
            from helpers.job.observe.tensor_peak import limit_device

            s.run.log(f"memory budget {s.args.memory_budget_gib:g} GiB per rank: {limit_device(s.device, self.budget)}")
        elif self.budget:
            s.run.log(f"memory budget {s.args.memory_budget_gib:g} GiB per rank: checked against peak_tensor_bytes "
                      f"after step {s.probe_step} (a CPU has no allocator limit to set)")

    def on_step_end(self, s, step, row):
        if not self.budget or step != s.probe_step:
            return
        from helpers.job.guard import JobStop
        from helpers.job.observe.tensor_peak import over_budget

        why = over_budget(self.peak.keys["peak_tensor_bytes"], self.budget, f"{s.start_step}-{step}",
                          s.args.memory_budget_gib)
        self.fits = why is None
        if why:
            raise JobStop(why)
        s.run.log(f"memory budget: fits (peak {max(p for p in self.peak.keys['peak_tensor_bytes']) / 2**30:.4f} GiB "
                  f"<= {s.args.memory_budget_gib:g} GiB on every rank)")

    def summary(self, s):
        return {"memory_budget_bytes": self.budget, "memory_budget_fits": self.fits}


class Dtypes(Observer):
    """The dtype of one parameter at every stage of step 1 (helpers.job.observe.precision.DtypeProbe)."""

    def __init__(self):
        self.result = None

    def on_model_built(self, s):
        from helpers.job.observe.precision import DtypeProbe

        self.probe = DtypeProbe(s.model)  # before the backend: sees the dtype the model was loaded in

    def on_train_begin(self, s):
        self.probe.attach(s.engine)

    def on_step_begin(self, s, step):
        if step == s.probe_step:
            self.probe.arm()

    def on_train_end(self, s):
        self.result = self.probe.result()

    def summary(self, s):
        return {"dtypes": self.result} if self.result else {}


class Updates(Observer):
    """``updated_fraction(_compute)`` per step (precision.UpdateTracker); opt-in: ``--track-updates``.

    Off (or impossible for this job), both keys stay in every row as null and ``log.txt`` says why.
    """

    KEYS = ("updated_fraction", "updated_fraction_compute")

    def __init__(self, enabled: bool):
        self.enabled, self.tracker = enabled, None

    def on_train_begin(self, s):
        if not self.enabled:
            # not asked for: said in log.txt only (every job without --track-updates would print it)
            s.run.log("note: updated_fraction not tracked (null in metrics.jsonl): it copies every shard each step; "
                      "pass --track-updates", echo=False)
            return
        from helpers.job.observe.precision import UpdateTracker

        tracker = UpdateTracker(s.engine, s.summary["num_params"])
        if tracker.enabled:
            self.tracker = tracker
        else:
            s.run.log(f"note: updated_fraction not tracked (null in metrics.jsonl): {tracker.why_not}")

    def on_step_begin(self, s, step):
        if self.tracker:
            self.tracker.before()

    def step_sums(self, s):
        if not self.tracker:
            return {}
        changed, changed_compute, elements = self.tracker.counts()
        return {"updates.changed": changed, "updates.changed_compute": changed_compute, "updates.elements": elements}

    def step_row(self, s, sums):
        if not self.tracker:
            return dict.fromkeys(self.KEYS)
        n = sums["updates.elements"]
        return {"updated_fraction": sums["updates.changed"] / n,
                "updated_fraction_compute": sums["updates.changed_compute"] / n}


class Profiler(Observer):
    """``--profile``: a torch.profiler trace of a few steps per rank (helpers.job.observe.profiling)."""

    def __init__(self):
        self.prof, self.steps, self.done = None, None, False

    def on_train_begin(self, s):
        from helpers.job.observe.profiling import StepProfiler

        self.prof = StepProfiler(s.args.out, s.rank, enabled=s.args.profile, use_cuda=s.use_cuda)

    def on_step_end(self, s, step, row):
        self.prof.step()  # a profiled step spans one whole loop iteration, the step's all-reduce included

    def on_train_end(self, s):
        self.steps = self.prof.finish()  # None without --profile
        self.done = True

    def summary(self, s):
        return {"profiled_steps": self.steps} if self.done else {}


class TensorTraces(Observer):
    """``--trace-tensors``: exact per-step fingerprints of every weight, gradient and update
    (helpers.job.observe.tensor_trace; its own hooks on the model and optimizer, one all-reduce per step)."""

    def on_train_begin(self, s):
        from helpers.job.observe.tensor_trace import TensorTracer

        self.tracer = TensorTracer(s.args.out, s.rank, s.world_size)
        s.run.log("note: --trace-tensors: the training peaks (peak_memory_bytes, peak_tensor_bytes) include the "
                  "tracer's copy of every weight shard, held across each optimizer step, and its fingerprint "
                  "temporaries; measure peaks without it")
        self.tracer.on_train_begin(s.engine)

    def on_step_begin(self, s, step):
        self.tracer.on_step_begin(step)

    def on_step_end(self, s, step, row):
        self.tracer.on_step_end(step)

    def on_train_end(self, s):
        self.tracer.on_train_end()


class Checkpoints(Observer):
    """``--checkpoint-dir`` / ``--checkpoint-every``: saves during the loop (helpers.job.checkpoint)."""

    def __init__(self, memory: Memory):
        self.memory, self.saved = memory, []

    def on_train_begin(self, s):
        from helpers.job.checkpoint import param_shapes

        self.every = s.args.checkpoint_every
        self.extra = {"param_shapes": param_shapes(s.engine.module),
                      "model_config": json.loads(s.model.config.to_json_string())} if self.every else {}

    def on_step_end(self, s, step, row):
        if self.every and (step + 1) % self.every == 0:
            from helpers.job.checkpoint import save

            with self.memory.peak.outside_training():  # save_peak_memory_bytes, not the training peak
                saved = save(s.engine, s.job, s.args.checkpoint_dir, step + 1, self.extra,
                             fault_hook=lambda k: s.guard.fault_hook(k, "save"))
            self.saved.append(saved)
            s.run.log(f"saved {saved['path']} ({saved['format']}, {saved['seconds']:.2f} s)")

    def summary(self, s):
        return {"checkpoints": self.saved}


class ProgressLog(Observer):
    """Rank 0's ``step ...`` lines (about ten per job) and the progress bar under them (observe.progress)."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, s):
        from helpers.job.observe.progress import Progress

        t = s.job.train
        self.every = max(1, t.steps // 10)
        self.bar = Progress(t.steps, active=s.rank == 0, initial=s.start_step)

    def on_step_end(self, s, step, row):
        if step % self.every == 0 or step == s.job.train.steps - 1:
            with self.bar.printing():
                s.run.log(f"step {step:4d}  loss {row['loss']:.4f}  grad_norm {row['grad_norm']:.3f}  "
                          f"{row['step_time_s'] * 1e3:7.1f} ms  {row['tokens_per_s']:8.0f} tok/s/rank")
        self.bar.update(row["loss"], row["tokens_per_s"])  # after the step line: the bar stays last

    def on_train_end(self, s):
        self.close(s)

    def close(self, s):
        if self.bar is not None:
            self.bar.close()  # an error block starts on a line of its own
