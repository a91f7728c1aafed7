"""torch (2.13.0) facts the guide states about prefetch (04), loading (05) and checkpoints (06).

Read helpers.facts' module docstring first.
"""

from __future__ import annotations

from unittest import mock

from .. import fact, gpu_fact
from .._tools import fsdp2, linear_stack, messages, resolve, scratch, source_has

V = "2.13.0+cpu"
GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"


def _trace(prefetch: bool = False, **fully_shard_kwargs) -> list[str]:
    """One forward + backward of two FSDP2 units (0, 1; the root holds no parameters), in order: "gather N" when
    unit N's parameters are gathered (the all-gather on more than one rank) and "compute N" when unit N's
    forward body starts."""
    import torch

    cls, order = resolve(GROUP), []
    orig = cls.unshard

    def unshard(self, async_op=False):
        if self._all_gather_result is None and not self.is_unsharded:  # otherwise a no-op
            order.append(f"gather {self._module_fqn}")
        return orig(self, async_op)

    m = fsdp2(**fully_shard_kwargs)
    if prefetch:
        m[0].set_modules_to_forward_prefetch([m[1]])
    for name in ("0", "1"):
        m.get_submodule(name).register_forward_pre_hook(lambda mod, args, n=name: order.append(f"compute {n}"))
    with mock.patch.object(cls, "unshard", unshard):
        m(torch.ones(2, 16)).sum().backward()
    return order


@fact("torch.fsdp2_explicit_prefetch_api",
      "FSDP2 lets you say when to gather (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch, "
      "fully_shard(reshard_after_forward=...)) and in what pieces (each fully_shard call is a unit).",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fully_shard.py: fully_shard, FSDPModule")
def _api():
    import inspect

    from torch.distributed.fsdp import FSDPModule, fully_shard

    methods = [m for m in ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch")
               if hasattr(FSDPModule, m)]
    kw = "reshard_after_forward" in inspect.signature(fully_shard).parameters
    return len(methods) == 2 and kw, {"FSDPModule": methods, "fully_shard(reshard_after_forward=)": kw}


@fact("torch.fsdp2_forward_prefetch_order",
      "Without forward prefetch, FSDP2 gathers block 1 when its own forward starts, after block 0 has computed; "
      "with set_modules_to_forward_prefetch, block 0's pre-forward issues block 1's gather before block 0 computes.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_state.py: FSDPState._pre_forward "
      "(_states_to_forward_prefetch)", runs=True)
def _fwd_order():
    def forward(order):
        return order[:order.index("compute 1") + 1]

    off, on = forward(_trace()), forward(_trace(prefetch=True))
    ok = (off == ["gather 0", "compute 0", "gather 1", "compute 1"]
          and on == ["gather 0", "gather 1", "compute 0", "compute 1"])
    return ok, {"no prefetch": " > ".join(off), "prefetch": " > ".join(on)}


@fact("torch.fsdp2_collective_counts",
      "FSDP2 gathers each unit once in forward and again in backward if it resharded after forward, and "
      "reduce-scatters once per unit; forward prefetch changes when, not how many.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: FSDPParamGroup.pre_forward, "
      "post_forward, pre_backward, post_backward", runs=True)
def _counts():
    import torch

    def gathers(order):
        return sum(e.startswith("gather") for e in order)

    plain, pre, keep = _trace(), _trace(prefetch=True), _trace(reshard_after_forward=False)
    m = fsdp2()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m(torch.ones(2, 16)).sum().backward()
    reduces = sum(e.name.startswith("FSDP::post_backward_reduce") for e in prof.events())
    ok = gathers(plain) == gathers(pre) == 4 and gathers(keep) == 2 and reduces == 2
    return ok, {"units": 2, "gathers": gathers(plain), "gathers with prefetch": gathers(pre),
                "gathers, reshard_after_forward=False": gathers(keep), "reduce-scatters": reduces}


@fact("torch.fsdp2_trace_labels",
      "FSDP2 marks its work in a profiler trace: FSDP::all_gather (fqn), FSDP::pre_forward (fqn), "
      "FSDP::post_forward (fqn), ...",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: FSDPParamGroup._with_fqn, unshard",
      runs=True)
def _labels():
    import torch

    m = fsdp2()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m(torch.ones(2, 16)).sum().backward()
    names = sorted({e.name for e in prof.events() if e.name.startswith("FSDP::") and "forward (0)" in e.name})
    ok, ev = source_has(GROUP + ".unshard", 'record_function(self._with_fqn("FSDP::all_gather"))')
    # one rank gathers nothing, so the all-gather label shows only in the source
    return ok and {"FSDP::pre_forward (0)", "FSDP::post_forward (0)"} <= set(names), {
        "labels of unit 0 (1 rank)": names, **ev}


@fact("torch.fsdp2_gathers_synchronous",
      "FSDP2 issues its all-gathers synchronously by default (unshard_async_op=False): the training thread waits "
      "for each gather on gloo.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: FSDPParamGroup.unshard_async_op; "
      "torch/distributed/distributed_c10d.py: all_gather_single", runs=True)
def _sync():
    m = fsdp2()
    flags = [m.get_submodule(n)._get_fsdp_state()._fsdp_param_group.unshard_async_op for n in ("0", "1")]
    ok, ev = source_has("torch.distributed.distributed_c10d.all_gather_single",
                        "if async_op: return work", "work.wait()")
    return ok and flags == [False, False], {"unshard_async_op": flags, **ev}


@fact("torch.fsdp2_post_backward_in_autograd_node",
      "FSDP2 reduces a unit's gradients from the backward of an autograd node, RegisterPostBackwardFunction.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: RegisterPostBackwardFunction.backward, "
      "FSDPParamGroup.post_backward")
def _post_backward_node():
    ok, ev = source_has("torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction",
                        "class RegisterPostBackwardFunction(torch.autograd.Function)",
                        "ctx.param_group.post_backward()")
    ok2, ev2 = source_has("torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_backward",
                          "foreach_reduce(")
    return ok and ok2, {**ev, "post_backward": ev2}


@fact("torch.gloo_worker_threads",
      "Gloo runs collectives on its own worker threads (2 by default).",
      "torch", V, "torch/csrc/distributed/c10d/ProcessGroupGloo.hpp: ProcessGroupGloo::Options (threads)")
def _gloo_threads():
    from torch.distributed import ProcessGroupGloo

    n = ProcessGroupGloo._Options()._threads
    return n == 2, {"ProcessGroupGloo.Options threads": n}


gpu_fact("torch.gpu_collectives_own_stream",
         "On a GPU, FSDP2 runs its collectives on their own CUDA streams, so a prefetched all-gather travels while "
         "the previous layer computes.",
         "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: FSDPCommContext.lazy_init "
         "(all_gather_stream, reduce_scatter_stream)",
         "needs CUDA streams and two GPUs to see the overlap in a trace")


@fact("torch.fsdp2_root_takes_the_rest",
      "FSDP2's root unit owns every parameter no inner unit took: with no inner units it gathers them all at once.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fully_shard.py: fully_shard (_get_managed_states)",
      runs=True)
def _root():
    m = fsdp2(units=False)
    n = len(m._get_fsdp_state()._fsdp_param_group.fsdp_params)
    return n == 4, {"root unit's parameters (2 Linear layers)": n}


@fact("torch.fsdp2_refuses_modulelist",
      "torch's fully_shard refuses a ModuleList (a container without forward).",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_init.py: _validate_module", runs=True)
def _modulelist():
    import torch
    from torch.distributed.fsdp import fully_shard

    out, _ = messages(fully_shard, torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    ok = isinstance(out, ValueError) and "does not support containers" in str(out)
    return ok, {"error": f"{type(out).__name__}: {str(out).splitlines()[0]}"}


@fact("torch.fsdp2_unit_inside_unit_fails",
      "A module already inside an FSDP2 unit (the final norm inside model.model's), sharded again as a unit of its "
      "own, fails at forward.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fully_shard.py: fully_shard; "
      "torch/distributed/tensor: DTensor dispatch", runs=True)
def _nested():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))  # named, as Accelerate's
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    m = torch.nn.Sequential(inner, torch.nn.Linear(8, 8))
    fully_shard(inner, mesh=mesh)
    fully_shard([inner[1], m[1]], mesh=mesh, reshard_after_forward=False)  # Accelerate's tail: norm + head
    fully_shard(m, mesh=mesh)
    out, _ = messages(m, torch.ones(2, 8))
    ok = isinstance(out, RuntimeError) and "mixed torch.Tensor and DTensor" in str(out)
    return ok, {"forward": f"{type(out).__name__}: {str(out)[:80]}"}


@fact("torch.fsdp2_params_stay_dtensors",
      "FSDP2 never flattens: every parameter stays itself, a DTensor shard under its own name.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_param.py: FSDPParam._init_sharded_param", runs=True)
def _dtensors():
    from torch.distributed.tensor import DTensor

    before = [n for n, _ in linear_stack().named_parameters()]
    m = fsdp2()
    after = [(n, type(p).__name__) for n, p in m.named_parameters()]
    return [n for n, _ in after] == before and all(isinstance(p, DTensor) for p in m.parameters()), {
        "parameters": after}


@fact("torch.fsdp2_hooks_not_compiled",
      "Module.compile compiles the module's whole call, hooks included, but torch marks every FSDP2 hook "
      "dynamo-disabled, so they run eagerly outside the graph.",
      "torch", V, "torch/nn/modules/module.py: Module.compile; torch/distributed/fsdp/_fully_shard/_fsdp_common.py: "
      "_dynamo_disable; _fsdp_state.py: FSDPState._pre_forward")
def _hooks_eager():
    a, ea = source_has("torch.nn.Module.compile", "torch.compile(self._call_impl")
    b, eb = source_has("torch.distributed.fsdp._fully_shard._fsdp_common._dynamo_disable",
                       'torch._dynamo.disable( func, recursive=True, reason="skipping FSDP hooks" )')
    c, ec = source_has("torch.distributed.fsdp._fully_shard._fsdp_state",
                       "@_dynamo_disable def _pre_forward(", "@_dynamo_disable def _post_forward(")
    return a and b and c, {"Module.compile": a, "FSDP hooks dynamo-disabled": b and c,
                           **({} if a and b and c else {**ea, **eb, **ec})}


@fact("torch.dynamo_recompile_limit",
      "dynamo recompiles a frame up to its recompile_limit (8), then runs it eagerly.",
      "torch", V, "torch/_dynamo/config.py: recompile_limit; torch/_dynamo/convert_frame.py")
def _recompile_limit():
    import torch._dynamo

    n = torch._dynamo.config.recompile_limit
    return n == 8, {"torch._dynamo.config.recompile_limit": n}


@fact("torch.fsdp1_use_orig_params_for_compile",
      "FSDP1 flattened a unit's parameters into one FlatParameter; use_orig_params=True kept the original "
      "parameters visible and is required for torch.compile.",
      "torch", V, "torch/distributed/fsdp/fully_sharded_data_parallel.py: FullyShardedDataParallel (docstring)")
def _fsdp1():
    import inspect

    doc = " ".join(inspect.getdoc(resolve("torch.distributed.fsdp.FullyShardedDataParallel")).split())
    needle = "``True`` is required to use ``torch.compile()``"
    return needle in doc and "FlatParameter" in doc, {"FSDP1 docstring says": needle}


@fact("torch.compile_on_first_call",
      "torch.compile compiles nothing until the first call; that call traces the graph.",
      "torch", V, "torch/_dynamo/eval_frame.py, convert_frame.py", runs=True)
def _lazy_compile():
    import torch
    from torch._dynamo.utils import counters

    fn = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    before = counters["stats"]["unique_graphs"]
    fn(torch.ones(3))
    after = counters["stats"]["unique_graphs"]
    return before == 0 and after == 1, {"graphs before the first call": before, "after": after}


@fact("torch.broadcast_from_rank0_per_tensor",
      "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) takes the state dict from rank 0 "
      "and broadcasts it one full tensor at a time; each other rank receives the full tensor and keeps its shard.",
      "torch", V, "torch/distributed/_state_dict_utils.py: _broadcast_state_dict, _broadcast_tensors, "
      "_distribute_tensors")
def _broadcast():
    a, ea = source_has("torch.distributed._state_dict_utils._broadcast_state_dict",
                       "# Broadcast every tensor to avoid OOM for now.")
    b, eb = source_has("torch.distributed._state_dict_utils._broadcast_tensors", "full_tensor = torch.empty(")
    return a and b, {**ea, **eb}


@fact("torch.full_state_dict_rank0",
      "get_model_state_dict / get_optimizer_state_dict with full_state_dict=True, cpu_offload=True gather "
      "everything into rank 0's CPU memory (the other ranks get an empty dict).",
      "torch", V, "torch/distributed/checkpoint/state_dict.py: _maybe_full_or_cpu_state_dict")
def _full_rank0():
    return source_has("torch.distributed.checkpoint.state_dict._maybe_full_or_cpu_state_dict",
                      "ranks_only = ( () if (not info.cpu_offload or not torch.distributed.is_initialized()) "
                      "else (0,) )")


@fact("torch.dcp_file_per_rank",
      "torch.distributed.checkpoint saves one file per rank plus a .metadata file that records each chunk's "
      "offset in the whole tensor, so any world size can load it.",
      "torch", V, "torch/distributed/checkpoint/filesystem.py: FileSystemWriter (single_file_per_rank=True)",
      runs=True)
def _dcp():
    import torch
    import torch.distributed.checkpoint as dcp

    d = scratch("facts_dcp_")
    dcp.save({"w": torch.zeros(4, 2)}, checkpoint_id=d)
    files = sorted(p.name for p in d.iterdir())
    md = dcp.FileSystemReader(d).read_metadata().state_dict_metadata["w"]
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    return files == [".metadata", "__0_0.distcp"] and tuple(md.size) == (4, 2), {
        "files (1 rank)": files, "w: size": tuple(md.size), "chunks (offsets, sizes)": chunks}


@fact("torch.to_empty_uninitialised",
      "Meta-device init creates no memory; to_empty() then allocates uninitialised memory (torch.empty_like) for "
      "every parameter and buffer.",
      "torch", V, "torch/nn/modules/module.py: Module.to_empty")
def _to_empty():
    import torch

    m = torch.nn.Linear(4, 4, device="meta")
    before = m.weight.device.type
    m.to_empty(device="cpu")
    ok, ev = source_has("torch.nn.Module.to_empty", "torch.empty_like(t, device=device)")
    return ok and before == "meta" and m.weight.device.type == "cpu", {
        "before": before, "after to_empty": m.weight.device.type, **ev}


@fact("torch.adam_state_lazy",
      "Torch Adam(W) creates its state (step, exp_avg, exp_avg_sq) at the first step, from zero: after it step is "
      "1 and exp_avg is (1 - beta1) x the gradient.",
      "torch", V, "torch/optim/adam.py: Adam._init_group")
def _adam():
    import torch

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    before = len(opt.state)
    p.grad = torch.ones(3)
    opt.step()
    st = opt.state[p]
    from_zero = torch.allclose(st["exp_avg"], torch.full((3,), 0.1))  # 0.9 x 0 + 0.1 x grad
    return before == 0 and float(st["step"]) == 1.0 and from_zero and sorted(st) == ["exp_avg", "exp_avg_sq", "step"], {
        "state before step": before, "after": sorted(st), "step": float(st["step"]),
        "exp_avg (grad 1)": float(st["exp_avg"][0])}


@fact("torch.fsdp2_default_backward_prefetch",
      "With no explicit backward-prefetch list, FSDP2 still prefetches the next unit in backward by default.",
      "torch", V, "torch/distributed/fsdp/_fully_shard/_fsdp_state.py: FSDPState._pre_backward; "
      "_fsdp_param_group.py: FSDPParamGroup._backward_prefetch")
def _bwd_default():
    return source_has("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._pre_backward",
                      "default_prefetch = len(self._states_to_backward_prefetch) == 0",
                      "fsdp_param_group.pre_backward(default_prefetch)")
