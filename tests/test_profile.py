"""--profile traces, collective counts per step, FSDP wrap policies and their errors."""

import pytest
from conftest import FSDP, REPO, run_job, summary

from helpers import traces, wrap
from helpers.config import ConfigError, load_job_config
from helpers.models import resolve_model
from helpers.profiling import PROFILE_STEPS

DS_NO_PREFETCH = "launch_configs/deepspeed/zero3_no_prefetch.yaml"
SIZE_WRAP = "launch_configs/fsdp/full_shard_size_wrap.yaml"
TINY = ("--model", "tiny", "--steps", "4", "--micro-batch", "4", "--seq-len", "32", "--profile")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One profiled 2-rank tiny run per backend (FSDP with size-based units, ZeRO-3 without prefetch)."""
    base = tmp_path_factory.mktemp("prof")
    for name, cfg in (("fsdp", SIZE_WRAP), ("deepspeed", DS_NO_PREFETCH)):
        proc = run_job(cfg, base / name, 2, *TINY)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "USDT" not in proc.stderr and "CPUAllocator" not in proc.stderr, proc.stderr[-2000:]
    return base


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
    assert want == {"all_gathers": 13, "all_gather_bytes": 2 * (584320 + 584320 - 640),  # root (final norm) not re-gathered
                    "reduce_scatters": 7}
    for rank in (0, 1):
        got = traces.collectives(profiled / "fsdp", rank)
        assert list(got.all_gathers) == [want["all_gathers"]] * len(PROFILE_STEPS), got
        assert list(got.reduce_scatters) == [want["reduce_scatters"]] * len(PROFILE_STEPS), got
        assert got.all_gather_MB.iloc[0] * 1e6 == pytest.approx(want["all_gather_bytes"])


def test_deepspeed_without_prefetch_gathers_each_param_twice(profiled):
    got = traces.collectives(profiled / "deepspeed")
    n_tensors = 2 * 9 + 3  # per block: q, k, v, o, gate, up, down, 2 norms; embeddings, final norm, head
    assert list(got.all_gathers) == [2 * n_tensors] * len(PROFILE_STEPS), got  # forward, then again in backward
    assert list(got.reduce_scatters) == [1] * len(PROFILE_STEPS), got  # one bucket for the whole tiny model


def test_wrap_policies_give_the_expected_units():
    tiny = wrap.meta_model(resolve_model("tiny"))
    job = load_job_config(str(REPO / FSDP))
    units = wrap.units(tiny, job.fsdp)  # TRANSFORMER_BASED_WRAP, class from _no_split_modules
    assert [(u.name, u.cls) for u in units] == [("model.layers.0", "LlamaDecoderLayer"),
                                                ("model.layers.1", "LlamaDecoderLayer"), ("", "LlamaForCausalLM")]
    assert sum(u.num_params for u in units) == 584320
    job.fsdp.auto_wrap_policy = "NO_WRAP"
    assert [u.name for u in wrap.units(tiny, job.fsdp)] == [""]
    job.fsdp.auto_wrap_policy = "SIZE_BASED_WRAP"  # Accelerate's default threshold, 1e8: nothing but the root
    assert [u.name for u in wrap.units(tiny, job.fsdp)] == [""]
    job.fsdp.min_num_params = 150_000  # a block (164096) but neither its attention (65536) nor MLP (98304)
    assert [u.name for u in wrap.units(tiny, job.fsdp)] == ["model.layers.0", "model.layers.1", ""]
    job.fsdp.auto_wrap_policy = "TRANSFORMER_BASED_WRAP"
    job.fsdp.transformer_layer_cls_to_wrap = "LlamaMLP, LlamaAttention"
    assert len(wrap.units(tiny, job.fsdp)) == 5


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
