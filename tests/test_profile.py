"""--profile traces, collective counts per step, FSDP wrap policies and their errors."""

import pytest
from conftest import FSDP, REPO, run_job, summary

from helpers.core.config import ConfigError, load_job_config
from helpers.core.models import resolve_model
from helpers.job import wrap
from helpers.job.observe.profiling import PROFILE_STEPS
from helpers.nb import traces

DS_NO_PREFETCH = "launch_configs/deepspeed/zero3_no_prefetch.yaml"
SIZE_WRAP = "launch_configs/fsdp/full_shard_size_wrap.yaml"
TINY = ("--model", "tiny", "--steps", "4", "--micro-batch", "4", "--seq-len", "32", "--profile")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One profiled 2-rank tiny run per backend (FSDP with size-based units, ZeRO-3 without prefetch)."""
    base = tmp_path_factory.mktemp("prof")
    for name, cfg in (("fsdp", SIZE_WRAP), ("deepspeed", DS_NO_PREFETCH)):
        # torchrun: in a rank forked from tests/zygote.py's server, tensors allocated before the fork and
        # freed while tracing make the profiler warn, which a real launch must not
        proc = run_job(cfg, base / name, 2, *TINY, launcher="torchrun")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "USDT" not in proc.stderr and "CPUAllocator" not in proc.stderr, proc.stderr[-2000:]
    return base


@pytest.mark.cpu_only("gloo's event names and threads; on a GPU the lanes are CUDA kernels")
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_trace_per_rank_has_comm_and_compute(profiled, backend):
    out = profiled / backend
    assert summary(out)["profiled_steps"] == PROFILE_STEPS
    assert traces.ranks(out) == [0, 1]
    ev = traces.events(out)
    for rank in (0, 1):
        lanes = ev[ev["rank"] == rank].groupby("lane").size()
        assert lanes.get("comm", 0) > 0 and lanes.get("compute", 0) > 0, lanes
    assert set(ev.step) == set(PROFILE_STEPS)
    assert {"aten::scaled_dot_product_attention", "gloo:all_gather"} <= set(ev.name)  # attention, gathers
    assert not any(ev[ev.lane == "compute"].name.str.startswith("c10d::"))
    ph = traces.phases(out)  # both backends show the phases (guide::* record_function)
    assert set(ph.phase) == {"forward", "backward", "optimizer_step"}
    # the allocator's peak in the profiled steps (bytes allocated since the profiler started) holds at least
    # the activations of a forward (measured apart, at step 1: 4 sequences a step), and is below the whole
    # process's peak RssAnon (a max over the [memory] events, not a sum)
    s = summary(out)
    acts = s["activation_bytes_per_sample"] * 4
    peaks = traces.peak_allocated(out)
    assert len(peaks) == 2 and all(acts <= p < rss for p, rss in zip(peaks, s["peak_memory_bytes"], strict=True)), \
        (peaks, acts, s["peak_memory_bytes"])


def test_fsdp_collectives_per_step_match_its_units(profiled):
    job = load_job_config(str(REPO / SIZE_WRAP))
    units = wrap.check_wrap_policy(job, resolve_model("tiny"))
    want = wrap.expected_collectives(units, reshard_after_forward=True)
    # 9 units hold parameters (model.model holds the final norm; the root nothing), each gathered twice
    assert want == {"all_gathers": 18, "all_gather_bytes": 2 * 2 * 584320, "reduce_scatters": 9}
    for rank in (0, 1):
        got = traces.collectives(profiled / "fsdp", rank)
        assert list(got.all_gathers) == [want["all_gathers"]] * len(PROFILE_STEPS), got
        assert list(got.reduce_scatters) == [want["reduce_scatters"]] * len(PROFILE_STEPS), got
        assert got.all_gather_MB.iloc[0] * 1e6 == pytest.approx(want["all_gather_bytes"])
    log = (profiled / "fsdp" / "log.txt").read_text()  # where the guide differs from accelerate launch, it says so
    assert "model.layers (ModuleList) passes Accelerate's policy, but fully_shard refuses" in log
    assert "model.norm is inside a unit the policy made" in log


def test_one_all_reduce_per_step(profiled):
    """Loss and gradient norm (and update counts, with --track-updates) travel in one all-reduce per step."""
    for rank in (0, 1):
        got = traces.collectives(profiled / "fsdp", rank)
        assert list(got.all_reduces) == [1] * len(PROFILE_STEPS), got


def test_deepspeed_without_prefetch_gathers_each_param_twice(profiled):
    got = traces.collectives(profiled / "deepspeed")
    n_tensors = 2 * 9 + 3  # per block: q, k, v, o, gate, up, down, 2 norms; embeddings, final norm, head
    assert list(got.all_gathers) == [2 * n_tensors] * len(PROFILE_STEPS), got  # forward, then again in backward
    assert list(got.reduce_scatters) == [1] * len(PROFILE_STEPS), got  # one bucket for the whole tiny model


def test_wrap_policies_give_accelerates_units():
    """The units accelerate launch makes with fsdp_version 2 (fsdp2_prepare_model): policy, embedding, tail, root."""
    tiny = wrap.meta_model(resolve_model("tiny"))
    job = load_job_config(str(REPO / FSDP))

    def named(fsdp):
        return [(u.name, u.num_params, u.reshard) for u in wrap.units(tiny, fsdp)]

    assert named(job.fsdp) == [  # TRANSFORMER_BASED_WRAP, class from _no_split_modules
        ("model.embed_tokens", 128000, True), ("model.layers.0", 164096, True), ("model.layers.1", 164096, True),
        ("model.norm+lm_head", 128128, False), ("", 0, False)]
    assert sum(u.num_params for u in wrap.units(tiny, job.fsdp)) == 584320
    job.fsdp.auto_wrap_policy = "NO_WRAP"  # no policy, but the embedding and the tail are still carved out
    assert named(job.fsdp) == [("model.embed_tokens", 128000, True), ("model.norm+lm_head", 128128, False),
                               ("", 328192, False)]
    job.fsdp.auto_wrap_policy = "SIZE_BASED_WRAP"  # Accelerate's default threshold, 1e8: as NO_WRAP here
    assert named(job.fsdp) == [("model.embed_tokens", 128000, True), ("model.norm+lm_head", 128128, False),
                               ("", 328192, False)]
    job.fsdp.min_num_params = 164096  # "more than": a block (164096) is not, model.model is (and its layers list)
    notes: list[str] = []
    wrap.plan(tiny, job.fsdp, notes)
    assert named(job.fsdp) == [("model", 456320, True), ("lm_head", 128000, False), ("", 0, False)]  # tail: head
    assert [n.split(": ")[1].split(" ")[0] for n in notes] == ["model.layers", "model.embed_tokens", "model.norm"]
    job.fsdp.min_num_params = 0  # Accelerate: 0 turns the policy off
    assert len(wrap.units(tiny, job.fsdp)) == 3
    job.fsdp.auto_wrap_policy = "TRANSFORMER_BASED_WRAP"
    job.fsdp.transformer_layer_cls_to_wrap = "LlamaMLP, LlamaAttention"
    assert len(wrap.units(tiny, job.fsdp)) == 7


def test_tied_embeddings_share_the_tail_unit():
    from transformers import AutoModelForCausalLM

    from helpers.core.models import model_config

    cfg = model_config(resolve_model("tiny"))
    cfg.tie_word_embeddings = True
    import torch

    with torch.device("meta"):
        tied = AutoModelForCausalLM.from_config(cfg)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    units = wrap.units(tied, load_job_config(str(REPO / FSDP)).fsdp)
    assert [(u.name, u.num_params) for u in units] == [  # the shared weight counted once, in the tail
        ("model.norm+model.embed_tokens+lm_head", 128128), ("model.layers.0", 164096), ("model.layers.1", 164096),
        ("", 0)]


def test_bad_wrap_class_is_one_line_before_launch(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text((REPO / FSDP).read_text() + "  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n")
    with pytest.raises(ConfigError, match="fsdp_transformer_layer_cls_to_wrap = 'GPT2Block': no module of class "
                       "GPT2Block in LlamaForCausalLM; classes in the model: .*LlamaDecoderLayer"):
        wrap.check_wrap_policy(load_job_config(str(cfg)), resolve_model("tiny"))
    proc = run_job(str(cfg), tmp_path / "run", 0, "--model", "tiny")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "GPT2Block" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_profile_needs_steps_after_warm_up(tmp_path):
    proc = run_job(FSDP, tmp_path / "run", 0, "--model", "tiny", "--steps", "2", "--profile")
    assert proc.returncode == 2 and "--steps = 2: --profile" in proc.stderr and "--steps >= 4" in proc.stderr


SHIPPED_FSDP = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch_configs" / "fsdp").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED_FSDP)
def test_units_are_the_ones_accelerate_makes(path, monkeypatch):
    """Accelerate's own fsdp2_prepare_model on the meta tiny model, its fully_shard calls recorded (not run):
    the guide makes the same calls, but for the two differences its log names (SIZE_BASED_WRAP)."""
    import functools
    from types import SimpleNamespace

    import torch.distributed.fsdp as fsdp_mod
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    o = load_job_config(str(REPO / path), world_size=4).fsdp
    model = wrap.meta_model(resolve_model("tiny"))
    names = {id(m): n for n, m in model.named_modules()}
    calls = []

    def record(module, **kw):  # what fully_shard would shard; the class swap makes isinstance(m, FSDPModule) true
        mods = module if isinstance(module, list) else [module]
        calls.append(("+".join(names[id(m)] for m in mods), kw.get("reshard_after_forward", None)))
        for m in mods:
            m.__class__ = type(f"FSDP{type(m).__name__}", (FSDPModule, type(m)), {})
        return module

    monkeypatch.setattr(fsdp_mod, "fully_shard", record)
    fn = {"TRANSFORMER_BASED_WRAP": transformer_auto_wrap_policy, "SIZE_BASED_WRAP": size_based_auto_wrap_policy,
          "NO_WRAP": None}[o.auto_wrap_policy]
    plugin = SimpleNamespace(auto_wrap_policy=fn, min_num_params=o.min_num_params, transformer_cls_names_to_wrap=(
        wrap.layer_classes(model, o.transformer_layer_cls_to_wrap) or None), reshard_after_forward=o.reshard_after_forward,
        cpu_offload=None, mixed_precision_policy=None, ignored_modules=None, cpu_ram_efficient_loading=False)
    plugin.set_auto_wrap_policy = functools.partial(FullyShardedDataParallelPlugin.set_auto_wrap_policy, plugin)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  is_main_process=True, torch_device_mesh=None)
    fsdp2_prepare_model(accelerator, model)

    fresh = wrap.meta_model(resolve_model("tiny"))
    ours = [(u.name, (o.reshard_after_forward and u.reshard) if u.name else None) for u, _ in wrap.plan(fresh, o)]
    theirs = [(n, r if n else None) for n, r in calls]
    if o.auto_wrap_policy == "SIZE_BASED_WRAP" and o.min_num_params == 50000:
        # model.layers: fully_shard refuses a ModuleList; model.norm: inside model.model's unit
        assert [c for c in theirs if c not in ours] == [("model.layers", True), ("model.norm", False)]
        theirs = [c for c in theirs if c in ours]
    assert theirs == ours


def _synthetic_run(tmp_path):
    """A one-rank trace as Kineto writes it on a GPU job under offload: a step, the guide's forward annotation on
    the host and its GPU-side copy, and [memory] events of both allocators (Device Type 0 cpu, 1 cuda)."""
    import json

    def mem(ts, dev, total):
        return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
                "args": {"Total Allocated": total, "Device Type": dev, "Device Id": 0 if dev else -1}}

    span = {"ph": "X", "name": "guide::forward", "pid": 1, "tid": 1, "ts": 10, "dur": 50}
    events = [{"ph": "X", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
              {**span, "cat": "user_annotation"},
              {**span, "cat": "gpu_user_annotation", "pid": 0, "tid": 7, "ts": 20, "dur": 60},
              mem(11, 0, 9_000), mem(12, 1, 4_000), mem(13, 1, 5_000), mem(14, 0, 8_000)]
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": events}))
    return tmp_path


def test_peak_allocated_counts_one_device(tmp_path):
    run = _synthetic_run(tmp_path)
    assert traces.peak_allocated(run) == [5_000]  # the compute device (cuda here), not the host's 9,000
    assert traces.peak_allocated(run, "cuda") == [5_000]
    assert traces.peak_allocated(run, "cpu") == [9_000]
    with pytest.raises(ValueError, match=r"device = 'gpu': allowed values are cpu, cuda or None"):
        traces.peak_allocated(run, "gpu")


def test_phases_count_the_hosts_annotations_only(tmp_path):
    run = _synthetic_run(tmp_path)
    ph = traces.phases(run)
    assert list(ph.phase) == ["forward"] and ph.start_ms.tolist() == [0.01] and ph.end_ms.tolist() == [0.06]
    assert traces.annotation_start(run, "guide::forward") == 0.01


def test_overlap_in_calls_counts_only_operators_that_called_a_collective(tmp_path):
    """A CPU (gloo) trace: two top-level operators on the training thread overlap a gloo transfer for 10 us each;
    only the one with a c10d:: call nested in it counts as inside a call. A GPU trace is refused, naming it."""
    import json

    def x(name, tid, ts, dur, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [x("ProfilerStep#2", 1, 0, 1000, "user_annotation"),
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "pt_gloo_runloop"}},
              x("autograd::engine::evaluate_function: AddBackward0", 1, 100, 50),
              x("c10d::_allgather_base_", 1, 110, 5),
              x("aten::mm", 1, 300, 50),
              x("gloo:all_gather", 9, 140, 20), x("gloo:all_gather", 9, 340, 20)]
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": events}))
    assert traces.overlap_ms(tmp_path) == pytest.approx(0.02)  # 10 us in each operator
    assert traces.overlap_in_calls_ms(tmp_path) == pytest.approx(0.01)  # the AddBackward0 node only
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": events + [x("ampere_gemm", 2, 5, 1, "kernel")]}))
    with pytest.raises(ValueError, match="a GPU trace; overlap_in_calls_ms reads CPU"):
        traces.overlap_in_calls_ms(tmp_path)
