"""What would break under nccl on a GPU, made visible on a CPU (issue 23).

An nccl process group serves only GPU tensors. ``helpers.job.comm.CollectiveCheck(simulate_accelerator=True)``
treats the (gloo) group as serving no CPU tensor, so a collective on a CPU tensor fails here as it would
there; only the copies ``helpers.job.comm`` places on "the group's device" pass. The other tests pin the
GPU-only branches (allocator peaks, fp32 peaks, Adam's host-side step counter, backward-thread
collectives, one GPU per rank) with the GPU calls replaced by stand-ins.
"""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from helpers import nb
from helpers.job import comm, loading
from helpers.job.backends.fsdp import FSDPEngine
from helpers.job.observe import memory, offload, precision, throughput
from helpers.nb import traces


@pytest.fixture
def world1(monkeypatch):
    """A one-rank gloo process group in this process (no port opened)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_check_fails_a_cpu_tensor_on_an_accelerator_group(world1):
    original = dist.all_reduce
    with comm.CollectiveCheck(simulate_accelerator=True) as check:
        with pytest.raises(RuntimeError, match="all_reduce at tests/test_gpu_path.py:.*a cpu tensor"):
            dist.all_reduce(torch.ones(2))  # what the loading check once did
        t = torch.tensor([1.0, 2.0])
        assert comm.all_reduce(t) is t and t.tolist() == [1.0, 2.0]  # placed on the group's device, summed back
    assert [c[3] for c in check.calls] == [False, True]
    assert dist.all_reduce is original  # unpatched afterwards
    with comm.CollectiveCheck() as real:  # not simulated: gloo serves the CPU
        dist.all_reduce(torch.ones(1))
    assert real.calls[0][:2] == ("all_reduce", "cpu") and real.calls[0][3]
    assert comm.device() == torch.device("cpu") and "cpu" in comm.device_types()


def test_weight_check_reduces_on_the_group_device_and_finds_a_moved_value(world1, tmp_path):
    from safetensors.torch import save_file

    lin = torch.nn.Linear(3, 2)
    save_file({k: v.detach().clone() for k, v in lin.state_dict().items()}, str(tmp_path / "model.safetensors"))
    engine = SimpleNamespace(module=lin)
    with comm.CollectiveCheck(simulate_accelerator=True) as check:
        assert loading.mismatches(engine, str(tmp_path), torch.float32) == []
    assert [c[0] for c in check.calls] == ["all_reduce"] and all(c[3] for c in check.calls)
    with torch.no_grad():  # same values, two of them swapped: the sums cannot tell, the check does
        lin.weight[0, 0], lin.weight[1, 2] = lin.weight[1, 2].item(), lin.weight[0, 0].item()
    assert loading.mismatches(engine, str(tmp_path), torch.float32) == ["weight"]


def test_fsdp_grad_norm_of_host_grads_reduces_on_the_group_device(world1):
    # FSDP2 CPU offload keeps the reduced grad shards on the host: the norm is summed there
    grads = [torch.tensor([3.0]), torch.tensor([4.0, 0.0])]
    params = [SimpleNamespace(grad=SimpleNamespace(to_local=lambda g=g: g, device=g.device)) for g in grads]
    mesh = SimpleNamespace(ndim=1, size=lambda: 2, get_group=lambda: dist.group.WORLD)  # "2 shards"
    engine = FSDPEngine(SimpleNamespace(parameters=lambda: params), None, mesh, 0.0)
    with comm.CollectiveCheck(simulate_accelerator=True) as check:
        assert engine._grad_norm().item() == 5.0
    assert len(check.calls) == 1 and check.calls[0][3]


def test_updated_fraction_is_summed_on_the_job_device(monkeypatch):
    # the tracker's counts stay where the shards are (the host, under offload); the job sums them with the
    # step's other numbers in one all-reduce, on the job's device (a GPU run's nccl group serves no CPU tensor)
    from helpers.job.run import sum_over_ranks

    old, new = torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 0.0])
    tracker = object.__new__(precision.UpdateTracker)
    tracker.enabled, tracker._before, tracker._shards = True, [old], lambda: [(new, torch.float16)]
    counts = tracker.counts()
    assert counts.tolist() == [1.0, 1.0, 4.0] and counts.dtype == torch.float64
    seen = []

    def all_reduce(t, *a, **k):
        seen.append(t.device)
        raise StopIteration

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(StopIteration):
        sum_over_ranks({"loss": 1.5, "changed": counts[0], "elements": counts[2]}, torch.device("meta"))
    assert seen == [torch.device("meta")]


def test_adam_step_counters_on_the_host_are_not_offload():
    # torch AdamW keeps state["step"] as a 0-dim CPU tensor (not capturable, not fused), GPU run or not
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    engine = SimpleNamespace(backend="fsdp", model=lin, optimizer=opt)
    states = offload.state_locations(engine, accelerator=True)["optimizer_states"]
    moments = 2 * 4 * (4 * 3 + 3)  # exp_avg + exp_avg_sq, fp32; stand-ins for CUDA tensors: on the host here
    assert states == {"device": 2 * 4, "host": moments, "disk": 0}  # two fp32 step counters count as device
    cpu = offload.state_locations(engine, accelerator=False)["optimizer_states"]
    assert cpu == {"device": 2 * 4 + moments, "host": 0, "disk": 0}


def test_collectives_on_the_backward_thread_are_counted(tmp_path):
    # on CUDA autograd runs backward on its own thread: FSDP2's reduce-scatters are recorded there
    ev = [{"ph": "X", "name": "ProfilerStep#2", "ts": 0, "dur": 100, "tid": 1, "pid": 1},
          {"ph": "X", "name": "c10d::_allgather_base_", "ts": 10, "dur": 1, "tid": 1, "pid": 1,
           "args": {"Input Dims": [[8], [4]], "Input type": ["float", "float"]}},
          {"ph": "X", "name": "c10d::_reduce_scatter_base_", "ts": 50, "dur": 1, "tid": 7, "pid": 1,
           "args": {"Input Dims": [[4], [8]], "Input type": ["float", "float"]}}]
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": ev}))
    got = traces.collectives(tmp_path).iloc[0]
    assert (got.all_gathers, got.reduce_scatters) == (1, 1) and got.reduce_scatter_MB == 32 / 1e6


def test_gpu_peak_counts_training_not_the_set_up(monkeypatch):
    counter = {"now": 0, "peak": 0}

    def alloc(n):
        counter["now"] += n
        counter["peak"] = max(counter["peak"], counter["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: counter["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: counter.update(peak=counter["now"]))
    peak = memory.PeakMemory(torch.device("cuda", 0))
    alloc(400)  # the whole model on the GPU, upcast to fp32
    alloc(-300)  # sharded: a quarter stays
    peak.end_setup()
    alloc(50)  # activations
    peak.sample()
    alloc(-50)
    assert (peak.setup_peak, peak.peak) == (400, 150)


@pytest.mark.parametrize("matmul, kind, tflops", [("highest", "fp32", 67.0), ("high", "tf32", 494.5)])
def test_fp32_jobs_on_a_gpu_use_the_fp32_peak(monkeypatch, matmul, kind, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul)
    cuda = torch.device("cuda", 0)
    assert throughput.device_peak(cuda, torch.float32, None) == (tflops * 1e12, f"table: NVIDIA H100 80GB HBM3, "
                                                                               f"dense {kind}")
    assert throughput.device_peak(cuda, torch.bfloat16, None)[0] == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA B200")
    peak, why = throughput.device_peak(cuda, torch.float32, None)
    assert peak is None and "pass --peak-tflops" in why if kind == "fp32" else peak == 1125e12


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    comm.check_local_device(0)
    with pytest.raises(ValueError, match=r"LOCAL_RANK = 1: this node has 1 GPU\(s\).*--nproc_per_node <= 1"):
        comm.check_local_device(1)


def test_notebooks_take_rank_counts_from_the_machine(monkeypatch):
    monkeypatch.setattr(nb, "gpu_count", lambda: 0)
    assert nb.nproc() == nb.CPU_RANKS == 2 and nb.world_sizes([1, 2, 4]) == [1, 2, 4]  # gloo ranks share cores
    assert nb.bitwise_parity_expected(4)
    monkeypatch.setattr(nb, "gpu_count", lambda: 2)
    assert nb.nproc() == 2 and nb.world_sizes([1, 2, 4]) == [1, 2]
    assert nb.bitwise_parity_expected(2, deterministic=True) and not nb.bitwise_parity_expected(4, deterministic=True)
    assert not nb.bitwise_parity_expected(2) and not nb.bitwise_repeat_expected()  # cuBLAS, SDPA backward
    assert nb.bitwise_repeat_expected(deterministic=True)


def test_checkpoint_dir_that_another_node_cannot_see_is_named(world1, tmp_path, monkeypatch):
    from pathlib import Path

    from helpers.job.checkpoint import CheckpointError, save

    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: None)  # as if rank 0 made it on its own node
    with pytest.raises(CheckpointError, match=r"\.step_2\.tmp is not visible on rank 0 .*every node shares"):
        save(None, None, str(tmp_path / "ckpt"), 2, {})


def test_tensor_trace_sums_host_shards_on_the_group_device(world1, monkeypatch):
    # FSDP2 CPU offload: every shard (and so the step's fingerprints) lives on the host; the step's one
    # all-reduce must still hand nccl a device tensor (the parameters' device is the CPU there)
    from helpers.job.observe.tensor_trace import TensorTracer

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # "2 ranks": the tracer reduces
    tracer = TensorTracer("unused", rank=1, world_size=2)  # rank 1 writes nothing
    tracer.names, tracer.engine = ["w"], SimpleNamespace(module=torch.nn.Linear(2, 1, bias=False))
    tracer.on_step_begin(0)
    tracer._add(0, "weight", torch.ones(2), 0)
    want = tracer.fp.clone()
    with comm.CollectiveCheck(simulate_accelerator=True) as check:
        tracer.on_step_end(0)
    assert [c[0] for c in check.calls] == ["all_reduce"] and all(c[3] for c in check.calls)
    assert torch.equal(tracer.fp, want)  # one rank's sum: unchanged


def test_ram_efficient_loading_under_offload_fills_host_shards(world1, tmp_path):
    # fsdp_cpu_ram_efficient_loading + fsdp_offload_params on a GPU: the shards must be materialised on the
    # host (FSDP2's lazy init refuses others); "meta" stands in for the GPU the job computes on
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from helpers.core.models import resolve_model

    loading.save_preset("tiny", str(tmp_path), seed=3)
    spec = resolve_model(str(tmp_path))
    model = loading.meta_model(spec, torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
    engine = SimpleNamespace(model=model, module=model)
    loading.fsdp_fill(engine, spec, torch.float32, torch.device("meta"), offload=True)
    assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"meta"}  # RoPE's buffers where forward runs
    model._get_fsdp_state()._lazy_init()  # FSDP2's own check of CPU-offloaded shards passes
    assert loading.mismatches(engine, spec.path, torch.float32) == []


def test_peak_table_tells_h200_nvl_and_mig_slices_apart():
    assert throughput.gpu_peak("NVIDIA H200") == 989e12 and throughput.gpu_peak("NVIDIA H200 NVL") == 835e12
    assert throughput.gpu_peak("NVIDIA H200 MIG 3g.71gb") is None  # a slice: --peak-tflops
    assert throughput.gpu_peak("NVIDIA H100 MIG 1g.10gb", "tf32") is None


def test_apply_fsdp_upcasts_where_the_model_is_and_moves_no_whole_model(world1, monkeypatch):
    # on a GPU the old apply_fsdp moved the whole model to the device and upcast it there (4 bytes a parameter on
    # every rank before sharding); Accelerate upcasts on the host and fully_shard moves one unit at a time
    from helpers.core.config import load_job_config
    from helpers.core.models import build_model, resolve_model
    from helpers.job.backends.fsdp import apply_fsdp

    model = build_model(resolve_model("tiny"), dtype=torch.bfloat16, seed=0)
    moved, to = [], torch.nn.Module.to

    def spy(self, *args, **kwargs):
        if self is model:
            moved.append((args, kwargs))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    apply_fsdp(model, load_job_config("launch_configs/fsdp/full_shard.yaml"), torch.device("cpu"))
    assert not moved, moved
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}
