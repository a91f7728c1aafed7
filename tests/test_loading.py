"""Loading a pretrained --model DIR three ways: same weights (checksum), same first loss, per-rank numbers."""

import pytest
from conftest import FSDP, REPO, run_job, summary

from helpers.loading import save_preset
from helpers.metrics import SUMMARY_KEYS

CONFIGS = {"naive": "launch_configs/fsdp/full_shard.yaml",
           "fsdp_ram_efficient": "launch_configs/fsdp/full_shard_ram_efficient.yaml",
           "zero3_init": "launch_configs/deepspeed/zero3_init.yaml"}


@pytest.fixture(scope="session")
def loads(tmp_path_factory):
    base = tmp_path_factory.mktemp("loading")
    save_preset("tiny", str(base / "pretrained"), seed=3)
    for method, cfg in CONFIGS.items():
        proc = run_job(cfg, base / method, 2, "--model", str(base / "pretrained"), "--steps", "2")
        assert proc.returncode == 0, f"{method} failed:\n{proc.stderr[-3000:]}"
    return base


@pytest.mark.parametrize("method", list(CONFIGS))
def test_each_method_loads_the_file(loads, method):
    s = summary(loads / method)
    ld = s["loading"]
    assert ld["method"] == method and ld["weights_match"] is True
    assert len(ld["ranks"]) == 2
    assert all(r["seconds"] > 0 and r["peak_rss_anon_bytes"] >= 0 for r in ld["ranks"])
    assert "loading" in SUMMARY_KEYS


def test_same_weights_same_losses(loads):
    # RAM-efficient loading recomputes RoPE's inv_freq after to_empty; without that the loss differs
    ref = summary(loads / "naive")["losses"]
    assert summary(loads / "fsdp_ram_efficient")["losses"] == ref
    assert summary(loads / "zero3_init")["losses"] == ref  # ZeRO-3 trains bit-identically to FSDP


def test_random_init_has_no_loading_record(tmp_path):
    proc = run_job(FSDP, tmp_path / "r", 0, "--model", "tiny", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary(tmp_path / "r")["loading"] is None and (REPO / CONFIGS["zero3_init"]).is_file()
