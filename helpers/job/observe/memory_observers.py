"""The memory observers: state bytes and peaks (Memory), the tensor peak (TensorPeak), the budget (MemoryBudget).

Hooks and ``needs``/``provides``: helpers.job.observe.base.
"""


from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch.distributed as dist

from helpers.core.mapping import job_theory_bytes, job_theory_split, mode_key
from helpers.job.guard import JobStop
from helpers.job.observe.base import Observer, gather
from helpers.job.observe.memory import PeakMemory, StepProbe
from helpers.job.observe.offload import state_locations, swap_buffer_bytes, totals
from helpers.job.observe.tensor_peak import CpuTensorPeak, limit_device, over_budget, source

if TYPE_CHECKING:
    pass


class Memory(Observer):
    """Per-rank state bytes at step 1 next to the ZeRO model, peak memory, activations (helpers.job.observe.memory).

    Provides ``peak_sampler`` (its ``peak``: a PeakMemory, sampled at each step's end) and ``step_probe`` (it sets
    ``s.probe`` at the probe step's begin; the loop hands it to the backend's step)."""

    provides = ("peak_sampler", "step_probe")

    def __init__(self):
        self.keys: dict = {}

    def on_model_built(self, s):


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

            self.keys.update(memory_summary(s.job, self.probe, self.peak, s.summary["num_params"],
                                            s.job.train.micro_batch, (s.summary["peft"] or {}).get("trainable_params")))
            self.keys["swap_buffer_bytes"] = gather(swap_buffer_bytes(s.engine))

    def on_train_end(self, s):
        self.peak.sample()  # the last step's peak (a save after it was sampled apart, save_peak)
        self.keys["peak_memory_bytes"] = gather(self.peak.peak)
        self.keys["setup_peak_memory_bytes"] = gather(self.peak.setup_peak)
        self.keys["save_peak_memory_bytes"] = gather(self.peak.save_peak)

    def summary(self, s):
        return self.keys


def memory_summary(job, probe, peak, num_params: int, micro_batch: int, trainable: int | None = None) -> dict:
    """Per-rank measured state next to the ZeRO model's prediction (summary.json keys); ``trainable``: the
    parameters that train (--peft), all when None."""

    key = mode_key(job)
    theory = job_theory_bytes(job, num_params, dist.get_world_size(), trainable)
    return {
        "mode_key": key,
        "memory_bytes": gather(totals(probe.locations)),  # probe.state + swap files + host fp32 grads
        "memory_location_bytes": gather(probe.locations),
        "memory_theory_bytes": theory,
        "memory_split_bytes": gather(probe.split),
        "memory_theory_split_bytes": job_theory_split(job, num_params, dist.get_world_size(), trainable),
        "peak_memory_source": peak.source,
        "activation_bytes_per_sample": probe.activations.bytes / micro_batch,
    }


class TensorPeak(Observer):
    """``peak_tensor_bytes`` per rank: the peak of the rank's own tensors over the first steps (observe.tensor_peak).
    On a GPU it reads ``memory``'s allocator peak (which leaves checkpoint saves out), taken as the first step
    begins."""

    needs = ("peak_sampler",)  # on a GPU: Memory's allocator peak, reset by Memory as training begins
    provides = ("peak_tensor_bytes",)  # its ``keys``, gathered from every rank at the probe step's end

    def __init__(self):
        self.cpu, self.peak, self.keys = None, None, {}

    def on_load_begin(self, s):
        if s.use_cuda:
            return
        if s.args.profile:
            s.run.log("note: peak_tensor_bytes not tracked (null): --profile holds the profiler it is read from")
            return

        self.cpu = CpuTensorPeak()
        self.cpu.start()  # before the model exists: the running total is every tensor of the job

    def on_train_begin(self, s):  # after Memory's (a provider): the GPU allocator's peak was reset there
        if self.cpu:
            self.cpu.mark()

    def on_step_end(self, s, step, row):
        if step != s.probe_step:
            return
        if s.use_cuda:
            self.peak = self.uses["peak_sampler"].peak.peak  # sampled at this step's end (Memory runs first)
        elif self.cpu:
            self.peak = self.cpu.stop()
        self.gather(s)  # here, so that MemoryBudget can compare every rank's peak with the budget

    def on_train_end(self, s):
        if not self.keys:  # no step ran (a resume at the last step)
            self.gather(s)

    def gather(self, s):

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

    needs = ("peak_tensor_bytes",)

    def __init__(self, gib: float | None):
        self.budget, self.fits = int(gib * 2**30) if gib else None, None

    def on_load_begin(self, s):
        if self.budget and s.use_cuda:

            s.run.log(f"memory budget {s.args.memory_budget_gib:g} GiB per rank: {limit_device(s.device, self.budget)}")
        elif self.budget:
            s.run.log(f"memory budget {s.args.memory_budget_gib:g} GiB per rank: checked against peak_tensor_bytes "
                      f"after step {s.probe_step} (a CPU has no allocator limit to set)")

    def on_step_end(self, s, step, row):
        if not self.budget or step != s.probe_step:
            return

        peaks = self.uses["peak_tensor_bytes"].keys["peak_tensor_bytes"]
        why = over_budget(peaks, self.budget, f"{s.start_step}-{step}", s.args.memory_budget_gib)
        self.fits = why is None
        if why:
            raise JobStop(why)
        s.run.log(f"memory budget: fits (peak {max(peaks) / 2**30:.4f} GiB "
                  f"<= {s.args.memory_budget_gib:g} GiB on every rank)")

    def summary(self, s):
        return {"memory_budget_bytes": self.budget, "memory_budget_fits": self.fits}
