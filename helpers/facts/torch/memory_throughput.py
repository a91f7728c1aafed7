"""torch (2.13.0) facts the guide states about throughput (07) and memory and batch size (08).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from unittest import mock

from .. import fact, gpu_fact
from .._tools import fsdp2, linear_stack, source_has

V = "2.13.0+cpu"


@fact("torch.embedding_is_lookup",
      "An embedding is a lookup: its forward does no arithmetic (0 FLOPs counted), unlike a Linear layer's matmul.",
      "torch", V, "nn/modules/sparse.py: Embedding.forward (F.embedding); utils/flop_counter.py: FlopCounterMode")
def _embedding_lookup():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    def flops(module, x):
        with FlopCounterMode(display=False) as c:
            module(x)
        return c.get_total_flops()

    emb = flops(torch.nn.Embedding(64, 16), torch.arange(8))
    lin = flops(torch.nn.Linear(16, 16), torch.ones(8, 16))
    return emb == 0 and lin == 2 * 8 * 16 * 16, {"embedding_flops": emb, "linear_flops": lin}


@fact("torch.tf32_off_for_matmuls",
      "torch keeps TF32 off for fp32 matmuls by default, so an fp32 job's matmuls run in plain fp32.",
      "torch", V, "torch/__init__.py: get_float32_matmul_precision; backends/cuda/__init__.py: cuBLASModule "
      "(allow_tf32)")
def _tf32_off():
    import torch

    prec, cuda = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    return prec == "highest" and cuda is False, {"float32_matmul_precision": prec, "cuda.matmul.allow_tf32": cuda}


@fact("torch.adamw_foreach_false_loops",
      "torch's AdamW with foreach=False (the guide's FSDP jobs) steps the parameters one by one in a Python loop.",
      "torch", V, "optim/adam.py: adam (picks _single_tensor_adam), _single_tensor_adam")
def _adamw_loop():
    import torch
    import torch.optim.adam as adam

    ps = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    for p in ps:
        p.grad = torch.ones(4)
    opt = torch.optim.AdamW(ps, foreach=False)
    with mock.patch.object(adam, "_single_tensor_adam", wraps=adam._single_tensor_adam) as single, \
            mock.patch.object(adam, "_multi_tensor_adam", wraps=adam._multi_tensor_adam) as multi:
        opt.step()
    loop, _ = source_has("torch.optim.adam._single_tensor_adam", "for i, param in enumerate(params):")
    ok = single.call_count == 1 and multi.call_count == 0 and loop
    return ok, {"_single_tensor_adam calls": single.call_count, "_multi_tensor_adam calls": multi.call_count,
                "loops over params": loop}


@fact("torch.omp_num_threads_sets_intraop",
      "OMP_NUM_THREADS sets the size of torch's intra-op thread pool: with OMP_NUM_THREADS=1 a process computes on "
      "one thread.",
      "torch", V, "torch.get_num_threads (ATen's intra-op pool, sized from OMP_NUM_THREADS)")
def _omp_threads():
    def threads(n: str) -> int:
        env = dict(os.environ, OMP_NUM_THREADS=n)
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                             capture_output=True, text=True, timeout=120).stdout
        return int(out.strip().splitlines()[-1])

    one, two = threads("1"), threads("2")
    return one == 1 and two == 2, {"OMP_NUM_THREADS=1": one, "OMP_NUM_THREADS=2": two}


@fact("torch.compile_default_no_cudagraphs",
      "torch.compile's default mode fuses ops but does not use CUDA graphs; mode=\"reduce-overhead\" turns them on "
      "(and so does \"max-autotune\").",
      "torch", V, "_inductor/__init__.py: list_mode_options; _inductor/config.py: triton.cudagraphs")
def _compile_modes():
    import torch._inductor as inductor
    from torch._inductor import config

    default, ro = inductor.list_mode_options("default"), inductor.list_mode_options("reduce-overhead")
    ma = inductor.list_mode_options("max-autotune")
    ok = not default.get("triton.cudagraphs") and ro.get("triton.cudagraphs") is True and not config.triton.cudagraphs \
        and ma.get("triton.cudagraphs") is True
    return ok, {"default mode": default, "reduce-overhead": ro, "max-autotune cudagraphs": ma.get("triton.cudagraphs"),
                "triton.cudagraphs default": config.triton.cudagraphs}


@fact("torch.cuda_memory_fraction_oom",
      "On a GPU, torch.cuda.set_per_process_memory_fraction caps the caching allocator: an allocation past the cap "
      "raises an out-of-memory error.",
      "torch", V, "cuda/memory.py: set_per_process_memory_fraction")
def _memory_fraction():
    return source_has("torch.cuda.memory.set_per_process_memory_fraction",
                      "If trying to allocate more than the allowed value in a process, will raise an out of "
                      "memory error in allocator.")


@fact("torch.profiler_cpu_memory_events",
      "With profile_memory=True the profiler records each CPU tensor's allocation and free as memory events with "
      "their bytes.",
      "torch", V, "profiler/profiler.py: profile (profile_memory); autograd/profiler_util.py: FunctionEvent")
def _profiler_memory():
    import torch

    with torch.profiler.profile(profile_memory=True) as prof:
        a = torch.empty(1 << 20)
        del a
    usage = {e.name: e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage}
    return usage.get("aten::empty") == 4 << 20 and usage.get("[memory]") == -(4 << 20), {
        "bytes by event": usage, "tensor bytes": 4 << 20}


@fact("torch.cpu_allocator_no_cache",
      "torch's CPU allocator keeps no cache: a freed tensor's memory goes back at once, so a CPU job's peak is its "
      "tensors alone.",
      "torch", V, "c10/core/CPUAllocator.cpp: DefaultCPUAllocator (C++; checked by the process's resident memory)")
def _cpu_no_cache():
    import torch

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    base = rss()
    a = torch.ones(16 << 20)  # 64 MiB, touched
    held = rss() - base
    del a
    after = rss() - base
    return held > 60 << 20 and after < 8 << 20, {"resident while alive MiB": held >> 20,
                                                   "resident after free MiB": after >> 20}


@fact("torch.fsdp_sharding_strategies",
      "FSDP's sharding strategies map to ZeRO stages: NO_SHARD replicates like DDP (ZeRO-0), SHARD_GRAD_OP shards "
      "gradients and optimizer states and keeps parameters gathered from forward to backward (~ZeRO-2), FULL_SHARD "
      "shards all three (ZeRO-3).",
      "torch", V, "distributed/fsdp/api.py: ShardingStrategy")
def _strategies():
    return source_has("torch.distributed.fsdp.ShardingStrategy",
                      "``FULL_SHARD``: Parameters, gradients, and optimizer states are sharded.",
                      "``SHARD_GRAD_OP``: Gradients and optimizer states are sharded during computation",
                      "does not reshard them after the forward",
                      "replicated across ranks similar to PyTorch's :class:`DistributedDataParallel` API")


@fact("torch.cpu_offload_on_cpu_is_noop",
      "On a CPU mesh, FSDP2's CPU offload leaves the sharded parameters and gradients where they already are: in "
      "the process's one memory.",
      "torch", V, "distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam (offload_to_cpu)", runs=True)
def _offload_on_cpu():
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    model = fsdp2(linear_stack(2, 16), offload_policy=CPUOffloadPolicy(pin_memory=False))
    before = [p.to_local().data_ptr() for p in model.parameters()]
    model(torch.ones(2, 16)).sum().backward()
    where = sorted({t.to_local().device.type for p in model.parameters() for t in (p, p.grad)})
    same = before == [p.to_local().data_ptr() for p in model.parameters()]  # the shards were not copied
    x = torch.ones(3)
    moved = x.to(torch.device("cpu"), non_blocking=True) is x and x.cpu() is x  # the offload's copy: a no-op here
    return where == ["cpu"] and same and moved, {"param and grad devices": where, "shards kept in place": same,
                                                 "a CPU tensor's .to(cpu) / .cpu() is itself": moved}


@fact("torch.fsdp2_mixed_16_bytes",
      "FSDP2 on fp32 parameters with a bf16 MixedPrecisionPolicy holds 16 bytes per parameter at rest after a step: "
      "fp32 parameter (4), fp32 gradient (4), AdamW's two fp32 states (8).",
      "torch", V, "distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_reduce (grad cast to the param dtype)",
      runs=True)
def _fsdp_16_bytes():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = fsdp2(linear_stack(2, 16), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                    reduce_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    ps = list(model.parameters())
    n = sum(p.numel() for p in ps)
    param = sum(p.numel() * p.element_size() for p in ps) / n
    grad = sum(p.grad.numel() * p.grad.element_size() for p in ps) / n
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step") / n
    return param + grad + state == 16, {"param B": param, "grad B": grad, "AdamW states B": state}


@fact("torch.zero_grad_set_to_none",
      "optimizer.zero_grad() sets the gradients to None by default (set_to_none=True): they are freed until the "
      "next backward makes them again.",
      "torch", V, "optim/optimizer.py: Optimizer.zero_grad")
def _zero_grad():
    import torch

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    torch.optim.SGD([p], lr=0.1).zero_grad()
    return p.grad is None, {"grad after zero_grad()": p.grad}


@fact("torch.checkpoint_wrapper_recompute",
      "checkpoint_wrapper (non-reentrant by default) runs the wrapped block's forward a second time in backward, "
      "every op again, while hooks on the wrapper itself (where fully_shard's sit) run once.",
      "torch", V, "distributed/algorithms/_checkpoint/checkpoint_wrapper.py: checkpoint_wrapper, "
      "CheckpointWrapper.forward; utils/checkpoint.py", runs=True)
def _recompute():
    import inspect

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    wrapped = checkpoint_wrapper(inner)
    calls = Counter()
    inner[0].register_forward_hook(lambda *a: calls.update(["inner"]))
    wrapped.register_forward_hook(lambda *a: calls.update(["wrapper"]))
    wrapped(torch.ones(2, 8, requires_grad=True)).sum().backward()
    impl = inspect.signature(checkpoint_wrapper).parameters["checkpoint_impl"].default
    ok = calls["inner"] == 2 and calls["wrapper"] == 1 and impl == CheckpointImpl.NO_REENTRANT
    return ok, {"block forwards": calls["inner"], "wrapper forwards": calls["wrapper"], "default impl": impl.name}


@fact("torch.gloo_reduce_scatter_clones",
      "gloo's reduce-scatter clones its input (aten::clone under c10d::_reduce_scatter_base_), a buffer the size of "
      "the input.",
      "torch", V, "ProcessGroupGloo::_reduce_scatter_base (C++; seen in the profiler)", runs=True)
def _gloo_clone():
    import torch
    import torch.distributed as dist

    x, y = torch.ones(1024), torch.empty(1024)
    with torch.profiler.profile(profile_memory=True) as prof:
        dist.reduce_scatter_tensor(y, x)
    clones = [e.cpu_memory_usage for e in prof.events()
              if e.name == "aten::clone" and getattr(e.cpu_parent, "name", None) == "c10d::_reduce_scatter_base_"]
    return clones == [4096], {"clone bytes under c10d::_reduce_scatter_base_": clones, "input bytes": 4096}


gpu_fact("torch.cuda_limit_on_reserved",
         "On a GPU the caching allocator's reserved memory sits above the tensors' peak, and "
         "set_per_process_memory_fraction limits reserved memory.",
         "torch", V, "c10/cuda/CUDACachingAllocator.cpp (C++, not in the wheel); cuda/memory.py: memory_reserved",
         "the caching allocator's limit and reserved bytes exist only on a CUDA device")
gpu_fact("torch.cuda_context_outside_allocator",
         "The CUDA context takes hundreds of MiB per GPU outside torch's caching allocator.",
         "torch", V, "cuda/__init__.py: _lazy_init; cuda/memory.py: mem_get_info, memory_reserved",
         "needs a CUDA device: compare mem_get_info's used bytes with memory_reserved after init")
gpu_fact("torch.nccl_buffers_outside_allocator",
         "NCCL allocates its communication buffers outside torch's tensors.",
         "torch", V, "distributed ProcessGroupNCCL (C++)",
         "needs CUDA devices and NCCL: mem_get_info drops after the first collective by more than memory_reserved "
         "grows")


@fact("torch.fsdp2_offload_pins_by_default",
      "FSDP2's CPUOffloadPolicy pins the host copies by default (pin_memory=True), and pinning needs an "
      "accelerator: without one, fully_shard with the default policy refuses to start.",
      "torch", V, "distributed/fsdp/_fully_shard/_fsdp_api.py: CPUOffloadPolicy; _fsdp_param.py: FSDPParam",
      runs=True)
def _offload_pins():
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    default = CPUOffloadPolicy().pin_memory
    try:
        fsdp2(linear_stack(2, 16), offload_policy=CPUOffloadPolicy())
        err = ""
    except Exception as e:  # the refusal is the evidence
        err = f"{type(e).__name__}: {e}"
    has_acc = torch.accelerator.is_available()
    return default is True and not has_acc and bool(err), {"pin_memory default": default,
                                                           "accelerator": has_acc, "fully_shard": err[:80] or "ok"}
