"""Memory accounting against the ZeRO model, and the mapping table as data."""

import pytest
from conftest import REPO, run_job, summary

from helpers.config import load_job_config
from helpers.mapping import CATEGORIES, MODES, mapping_rows, mode_key, theory_bytes

SMALL_FAST = ("--model", "small", "--steps", "2", "--micro-batch", "1", "--seq-len", "32")


def within(measured: float, theory: float, tol: float = 0.05) -> bool:
    return measured == theory == 0 or (theory > 0 and abs(measured - theory) <= tol * theory)


@pytest.mark.parametrize("mode", ["full_shard", "zero3"])
def test_two_rank_state_matches_theory(tmp_path, mode):
    out = tmp_path / mode
    proc = run_job(MODES[mode].config, out, 2, *SMALL_FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(out)
    theory = s["memory_theory_bytes"]
    assert s["mode_key"] == mode and len(s["memory_bytes"]) == 2
    for rank, measured in enumerate(s["memory_bytes"]):
        for cat in CATEGORIES:
            assert within(measured[cat], theory[cat]), (rank, cat, measured[cat], theory[cat])
    # FSDP's aligned mode keeps fp32 shards (no separate master); DeepSpeed bf16 shards + fp32 master
    per_param = sum(theory.values()) / s["num_params"]
    assert per_param == pytest.approx(16 / 2)  # 16 bytes per param, split over 2 ranks
    if mode == "zero3":
        assert theory["master_params"] == 2 * theory["params"] > 0
    else:
        assert theory["master_params"] == 0
    assert all(p > 100e6 for p in s["peak_memory_bytes"])  # RssAnon of a torch process
    assert s["activation_bytes_per_sample"] > 0


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


def test_mapping_rows_cover_both_backends():
    rows = mapping_rows()
    assert {r["backend"] for r in rows} == {"fsdp", "deepspeed"}
    zero1 = next(r for r in rows if r["mode"] == "zero1")
    assert zero1["FSDP1 strategy"] == "(none)"
