"""The job's observers: ``default_observers`` and the measurements that are not about memory.

Hooks and ``needs``/``provides``: helpers.job.observe.base; the memory ones: helpers.job.observe.memory_observers.
"""


from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch.distributed as dist

from helpers.core.metrics import summarize_steps
from helpers.job.checkpoint import param_shapes, save
from helpers.job.loading import LoadMonitor, mismatches
from helpers.job.observe.activation_trace import ActivationTracer
from helpers.job.observe.base import Observer, Observers, gather
from helpers.job.observe.memory_observers import Memory, MemoryBudget, TensorPeak
from helpers.job.observe.precision import DtypeProbe, UpdateTracker
from helpers.job.observe.profiling import StepProfiler
from helpers.job.observe.progress import Progress
from helpers.job.observe.settings import Settings
from helpers.job.observe.tensor_trace import TensorTracer
from helpers.job.observe.throughput import compute_dtype, device_peak, flops_per_token, fmt_flops, summary_keys

if TYPE_CHECKING:
    from helpers.job.state import JobState


def default_observers(s: JobState) -> Observers:
    """The guide's measurements; their hooks run in this order (and so do their log lines), providers first."""
    traces = [Traces(kind) for kind, on in (("tensors", s.args.trace_tensors),
                                            ("activations", s.args.trace_activations)) if on]
    return Observers([Throughput(), Loading(), Memory(), TensorPeak(), MemoryBudget(s.args.memory_budget_gib),
                      Dtypes(), Settings(), Updates(enabled=s.args.track_updates), Profiler(), *traces, ProgressLog(),
                      Checkpoints()])


# ---------------------------------------------------------------------------------------------- the measurements


class Throughput(Observer):
    """Device peak (logged at start), FLOPs per token, and the summary's MFU keys (helpers.job.observe.throughput)."""

    def __init__(self):
        self.keys: dict = {}

    def on_load_begin(self, s):

        self.peak, self.source = device_peak(s.device, compute_dtype(s.job), s.args.peak_tflops)
        s.run.log(f"peak {fmt_flops(self.peak)} per device ({self.source})" if self.peak
                  else f"note: no MFU: {self.source}")

    def on_model_built(self, s):

        self.flops = flops_per_token(s.model, s.job.train.seq_len)  # the whole model, before any sharding

    def on_train_end(self, s):

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

            dist.barrier()  # every rank starts the load together
            self.monitor = LoadMonitor()
            self.monitor.__enter__()

    def on_model_built(self, s):
        if s.load_method == "zero3_init":  # partitioned as it loaded: the load ends here, before the optimizer
            self.monitor.__exit__(None, None, None)

    def on_engine_ready(self, s):
        if not self.monitor:
            return

        if s.load_method != "zero3_init":  # naive and RAM-efficient: the load ends once the weights are sharded
            self.monitor.__exit__(None, None, None)
        m = self.monitor
        bad = mismatches(s.engine, s.spec.path, s.model_dtype)
        self.record = {"method": s.load_method, "path": s.spec.path, "ranks": gather(m.result),
                       "weights_match": not bad, "mismatched": bad[:5]}
        s.run.log(f"loaded {s.spec.path} ({s.load_method}): {m.seconds:.2f} s, peak RssAnon "
                  f"+{m.result['peak_rss_anon_bytes'] / 2**20:.0f} MiB on rank 0, weights match the file: "
                  f"{not bad}" + (f" (differ: {', '.join(bad[:5])})" if bad else ""))

    def summary(self, s):
        return {"loading": self.record}


class Dtypes(Observer):
    """The dtype of one parameter at every stage of step 1 (helpers.job.observe.precision.DtypeProbe)."""

    def __init__(self):
        self.result = None

    def on_model_built(self, s):

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

        self.prof = StepProfiler(s.args.out, s.rank, enabled=s.args.profile, use_cuda=s.use_cuda)

    def on_step_end(self, s, step, row):
        self.prof.step()  # a profiled step spans one whole loop iteration, the step's all-reduce included

    def on_train_end(self, s):
        self.steps = self.prof.finish()  # None without --profile
        self.done = True

    def summary(self, s):
        return {"profiled_steps": self.steps} if self.done else {}


class Traces(Observer):
    """``--trace-tensors`` (helpers.job.observe.tensor_trace: exact per-step fingerprints of every weight, gradient
    and update; one all-reduce per step) or ``--trace-activations`` (helpers.job.observe.activation_trace: every
    module's output and output gradient, per rank and micro-batch, gathered at each step's end): the tracer's
    own hooks on the model (and optimizer), driven step by step."""

    def __init__(self, kind: str):
        self.kind = kind  # "tensors" | "activations"

    def on_train_begin(self, s):
        if self.kind == "tensors":
            self.tracer = TensorTracer(s.args.out, s.rank, s.world_size)
            s.run.log("note: --trace-tensors: the training peaks (peak_memory_bytes, peak_tensor_bytes) include the "
                      "tracer's copy of every weight shard, held across each optimizer step, and its fingerprint "
                      "temporaries; measure peaks without it")
            self.tracer.on_train_begin(s.engine)
        else:
            self.tracer = ActivationTracer(s.args.out, s.rank)
            self.tracer.on_train_begin(s.engine.module)

    def on_step_begin(self, s, step):
        self.tracer.on_step_begin(step)

    def on_step_end(self, s, step, row):
        self.tracer.on_step_end(step)

    def on_train_end(self, s):
        self.tracer.on_train_end()


class Checkpoints(Observer):
    """``--checkpoint-dir`` / ``--checkpoint-every``: saves during the loop (helpers.job.checkpoint)."""

    needs = ("peak_sampler",)  # a save is sampled apart from the training peak

    def __init__(self):
        self.saved = []

    def on_train_begin(self, s):

        self.every = s.args.checkpoint_every
        t = s.job.train
        self.extra = {"param_shapes": param_shapes(s.engine.module),
                      "model_config": json.loads(s.model.config.to_json_string()), "peft": s.summary["peft"],
                      "train": {"micro_batch": t.micro_batch, "seq_len": t.seq_len, "grad_accum": t.grad_accum,
                                "model_dtype": t.model_dtype}
                      } if self.every else {}

    def on_step_end(self, s, step, row):
        if self.every and (step + 1) % self.every == 0:

            with self.uses["peak_sampler"].peak.outside_training():  # save_peak_memory_bytes, not the training peak
                saved = save(s.engine, s.job, s.args.checkpoint_dir, step + 1, self.extra,
                             fault_hook=lambda k: s.guard.fault_hook(k, "save"), peft=s.peft,
                             naive_adapter=s.args.save_naive_adapter)
            self.saved.append(saved)
            s.run.log(f"saved {saved['path']} ({saved['format']}, {saved['seconds']:.2f} s)")

    def summary(self, s):
        return {"checkpoints": self.saved}


class ProgressLog(Observer):
    """Rank 0's ``step ...`` lines (about ten per job) and the progress bar under them (observe.progress)."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, s):

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
