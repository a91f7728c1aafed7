"""Memory accounting of every mode against the ZeRO model; the model itself by hand."""

import pytest
from conftest import REPO, gpu_count, run_job, summary

from helpers.core.config import load_job_config
from helpers.core.mapping import CATEGORIES, MODES, mode_key, theory_bytes
from helpers.core.models import PRESETS, model_config, resolve_model
from helpers.job.comm import cpu_cores

SMALL_FAST = ("--model", "small", "--steps", "2", "--micro-batch", "1", "--seq-len", "32")


def within(measured: float, theory: float, tol: float = 0.05) -> bool:
    return measured == theory == 0 or (theory > 0 and abs(measured - theory) <= tol * theory)


def largest_param(preset: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(resolve_model(preset)))
    return max(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode", list(MODES))
def test_state_per_rank_matches_theory(tmp_path, mode):
    """Every mode of the mapping table, measured (2 ranks; the hybrid ones at 4: 2 groups of 2)."""
    m = MODES[mode]
    ws = max(2, m.min_world_size)
    out = tmp_path / mode
    proc = run_job(m.config, out, ws, *SMALL_FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(out)
    theory, n = s["memory_theory_bytes"], s["num_params"]
    assert s["mode_key"] == mode and len(s["memory_bytes"]) == ws
    crowded = not gpu_count() and ws > cpu_cores()  # the hybrid modes' 4 ranks on a 2-core box: a note says so
    assert (f"note: {ws} ranks on this node share {cpu_cores()} CPU core" in (out / "log.txt").read_text()) == crowded
    # what one rank would hold alone: the table's "sharded" column decides what the measurement divides
    alone = theory_bytes(m, n, 1, s["mixed_precision"])
    boundary = 2 * 2 * largest_param("small")  # ZeRO-1/2: two straddling params keep whole bf16 grads
    for rank, measured in enumerate(s["memory_bytes"]):
        for cat in CATEGORIES:
            if m.key in ("zero1", "zero2") and cat == "grads":
                assert 0 <= measured[cat] - theory[cat] <= boundary, (rank, cat, measured[cat], theory[cat])
                continue
            assert within(measured[cat], theory[cat]), (rank, cat, measured[cat], theory[cat])
            if alone[cat]:  # sharded: a clear cut below what one rank alone holds (ZeRO++ hpZ params: 3/4)
                assert (cat in m.sharded) == (measured[cat] < 0.9 * alone[cat]), (rank, cat, measured, alone)
        # peak RssAnon during the job holds at least this rank's state
        assert s["peak_memory_bytes"][rank] > sum(measured.values()), (rank, s["peak_memory_bytes"], measured)
    # activations of one sample (seq 32), independent of the mode: at least the fp32 log-probs the loss keeps
    # (seq x vocab x 4), at most a generous count of every [seq, hidden|inter|vocab] tensor a forward makes
    h, inter, layers, vocab = (PRESETS["small"][k] for k in ("hidden_size", "intermediate_size",
                                                              "num_hidden_layers", "vocab_size"))
    act = s["activation_bytes_per_sample"]
    assert 32 * vocab * 4 <= act <= 32 * 4 * (4 * vocab + layers * (20 * h + 6 * inter + 8 * 32 * 8)), act


def test_theory_by_hand():
    n = 1000
    assert theory_bytes(MODES["zero2"], n, 4, "bf16") == {
        "params": 2000, "grads": 500, "optimizer_states": 2000, "master_params": 1000}
    assert theory_bytes(MODES["zero0"], n, 4, "bf16") == {
        "params": 2000, "grads": 2000, "optimizer_states": 8000, "master_params": 4000}
    assert theory_bytes(MODES["no_shard"], n, 4, "bf16") == {
        "params": 4000, "grads": 4000, "optimizer_states": 8000, "master_params": 0}
    assert theory_bytes(MODES["hybrid_shard"], n, 4, "bf16", shard_group=2)["params"] == 2000
    assert theory_bytes(MODES["zero3_hpz"], n, 4, "bf16", secondary_group=2)["params"] == 500 + 1000
    assert theory_bytes(MODES["full_shard"], n, 2, "no")["params"] == 1000  # bf16 model, not upcast
    assert theory_bytes(MODES["full_shard"], n, 2, "no", model_dtype_bytes=4)["params"] == 2000  # fp32 model


@pytest.mark.parametrize("key", list(MODES))
def test_every_mode_has_a_config_that_maps_back_to_it(key):
    m = MODES[key]
    job = load_job_config(str(REPO / m.config), world_size=4)
    assert job.backend == m.backend and mode_key(job) == key
    header = (REPO / m.config).read_text().split("distributed_type")[0]
    if m.min_world_size > 1:
        assert "NEEDS 4 RANKS" in header


def test_fsdp_master_params_are_what_the_optimizer_steps_beyond_the_model():
    """FSDP's master_params is measured, not assumed: a tensor the optimizer steps that is not one of the model's
    parameters is booked there (none when the optimizer steps the model's own)."""
    from types import SimpleNamespace

    import torch

    from helpers.job.observe.memory import _fsdp_tensors

    model = torch.nn.Linear(4, 4)
    own = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert _fsdp_tensors(own)["master_params"] == []
    copies = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    apart = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(copies))
    assert [id(t) for t in _fsdp_tensors(apart)["master_params"]] == [id(t) for t in copies]
