"""peak_tensor_bytes: exact on a synthetic workload, bounded by what a real job holds (helpers.job.observe.tensor_peak)."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, job_env, run_job, summary

from helpers.core.models import PRESETS
from helpers.job.observe.memory import PeakMemory

SNIPPET = """
import torch
from helpers.job.observe.tensor_peak import CpuTensorPeak
t = CpuTensorPeak(); t.start()
keep = torch.zeros(1000)              # 4000 bytes, alive when the window starts: counted
gone = torch.zeros(50_000); del gone  # 200000 bytes freed before the window: not counted
t.mark()
a = torch.zeros(2000)                 # 12000
b = torch.zeros(500); del a           # 14000 (the peak), then 6000
c = torch.zeros(1500)                 # 12000
print(t.stop())
"""


SAVE_SNIPPET = """
import torch
from helpers.job.observe.memory import PeakMemory
from helpers.job.observe.tensor_peak import CpuTensorPeak
t = CpuTensorPeak(); t.start()
t.mark()
a = torch.zeros(2000)                        # 8000: training
mem = PeakMemory(torch.device("cpu"))
with mem.outside_training():                 # a checkpoint save: 400000 more, freed inside
    big = torch.zeros(100_000); del big
b = torch.zeros(1000)                        # 12000 (training's peak)
print(t.stop(), mem.save_peak > 0)
"""


@pytest.mark.cpu_only
def test_a_save_is_left_out_of_the_cpu_tensor_peak():
    out = subprocess.run([sys.executable, "-c", SAVE_SNIPPET], cwd=REPO, env=job_env(), capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["12000", "True"]  # not 408000: the save's span is not training


def test_gpu_peak_folds_around_a_save(monkeypatch):
    """The allocator's peak (a fake counter here: no GPU needed) is folded into the training peak before a save,
    the save's own peak goes to save_peak, and training counts again from a reset after it."""
    counter = {"alloc": 100, "peak": 100}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counter["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: counter.update(peak=counter["alloc"]))

    def touch(n):  # allocate n bytes for a moment
        counter["peak"] = max(counter["peak"], counter["alloc"] + n)

    mem = PeakMemory(torch.device("cuda"))
    mem.end_setup()
    touch(400)
    mem.sample()  # step 0's end
    with mem.outside_training():
        touch(800)
    touch(200)
    mem.sample()
    assert (mem.peak, mem.save_peak) == (500, 900)


@pytest.mark.cpu_only
def test_the_save_after_the_last_step_is_sampled(tmp_path):
    proc = run_job("launch_configs/fsdp/full_shard.yaml", tmp_path, 0, "--model", "tiny", "--steps", "2",
                   "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(tmp_path)
    assert [c["step"] for c in s["checkpoints"]] == [2]  # one save, after the last step
    assert len(s["save_peak_memory_bytes"]) == 1 and s["save_peak_memory_bytes"][0] > 0


@pytest.mark.cpu_only
def test_cpu_peak_is_exact():
    out = subprocess.run([sys.executable, "-c", SNIPPET], cwd=REPO, env=job_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["14000"]  # not 212000+ (freed tensors), not 12000 (the last total)


@pytest.mark.cpu_only
@pytest.mark.parametrize("ranks", [1, 2])
def test_job_peak_holds_state_and_activations(tmp_path, ranks):
    """tiny, FULL_SHARD, micro-batch 8 x seq 64: state (params, grads, Adam) + saved activations <= peak <=
    that + the backward's largest transient (the gradient of the fp32 log-probs, tokens x vocab x 4) + every
    param gathered in bf16 with its unsharded bf16 gradient (2 x 2 bytes x N)."""
    proc = run_job("launch_configs/fsdp/full_shard.yaml", tmp_path, ranks, "--model", "tiny", "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(tmp_path)
    assert s["peak_tensor_source"].startswith("profiler") and len(s["peak_tensor_bytes"]) == ranks
    acts = s["activation_bytes_per_sample"] * 8
    transient = 8 * 64 * PRESETS["tiny"]["vocab_size"] * 4 + 2 * 2 * s["num_params"]
    for rank, peak in enumerate(s["peak_tensor_bytes"]):
        state = sum(s["memory_bytes"][rank].values())
        assert state + acts <= peak <= state + acts + transient, (rank, peak, state, acts)


@pytest.mark.cpu_only
def test_profile_leaves_the_key_null_and_says_why(tmp_path):
    proc = run_job("launch_configs/fsdp/full_shard.yaml", tmp_path, 0, "--model", "tiny", "--steps", "4",
                   "--micro-batch", "1", "--profile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(tmp_path)
    assert s["peak_tensor_bytes"] == [None] and s["peak_tensor_source"] is None
    assert "note: peak_tensor_bytes not tracked (null): --profile" in (tmp_path / "log.txt").read_text()
