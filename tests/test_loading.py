"""Loading a pretrained --model DIR three ways: same weights (checksum), same losses, and the memory each
way costs per rank (the claims of notebooks/05_loading, on the `small` preset as its quick size runs it)."""

import pytest
from conftest import FSDP, run_job, summary

from helpers.core.models import PRESETS, count_params, model_config, resolve_model
from helpers.job.loading import save_preset

CONFIGS = {"naive": "launch_configs/fsdp/full_shard.yaml",
           "fsdp_ram_efficient": "launch_configs/fsdp/full_shard_ram_efficient.yaml",
           "zero3_init": "launch_configs/deepspeed/zero3_init.yaml"}
BOUND = 0.8  # notebook 05's bound for `small`: a method that shards while loading peaks below 0.8 x naive


@pytest.fixture(scope="session")
def loads(tmp_path_factory):
    base = tmp_path_factory.mktemp("loading")
    save_preset("small", str(base / "pretrained"), seed=3)
    for method, cfg in CONFIGS.items():
        proc = run_job(cfg, base / method, 2, "--model", str(base / "pretrained"), "--steps", "2",
                       "--micro-batch", "1", "--seq-len", "32")
        assert proc.returncode == 0, f"{method} failed:\n{proc.stderr[-3000:]}"
    return base


def peaks(base, method) -> list[int]:
    return [r["peak_rss_anon_bytes"] for r in summary(base / method)["loading"]["ranks"]]


@pytest.mark.parametrize("method", list(CONFIGS))
def test_each_method_loads_the_file(loads, method):
    ld = summary(loads / method)["loading"]
    assert ld["method"] == method and ld["weights_match"] is True
    assert ld["path"] == str(loads / "pretrained") and len(ld["ranks"]) == 2


def test_same_weights_same_losses(loads):
    # RAM-efficient loading recomputes RoPE's inv_freq after to_empty; without that the loss differs
    ref = summary(loads / "naive")["losses"]
    assert len(ref) == 2
    assert summary(loads / "fsdp_ram_efficient")["losses"] == ref
    assert summary(loads / "zero3_init")["losses"] == ref  # ZeRO-3 trains bit-identically to FSDP


def test_loading_memory_per_rank(loads):
    """Naive: every rank holds the whole model. RAM-efficient: ranks > 0 only their shard, rank 0 the state
    dict it broadcasts. ZeRO-3 init: no rank holds the whole model."""
    import torch

    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        n = count_params(AutoModelForCausalLM.from_config(model_config(resolve_model("small"))))
    assert n > 20e6 and PRESETS["small"]["vocab_size"] == 8000
    whole = 4 * n  # the fp32 weights of the file
    naive, ram, zero = (peaks(loads, m) for m in CONFIGS)
    assert min(naive) > 0.9 * whole, (naive, whole)
    assert max(ram[1:]) < BOUND * min(naive), (ram, naive)
    assert ram[0] > 1.3 * max(ram[1:]), ram
    assert max(zero) < BOUND * min(naive), (zero, naive)


def test_random_init_has_no_loading_record(tmp_path):
    proc = run_job(FSDP, tmp_path / "r", 0, "--model", "tiny", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary(tmp_path / "r")["loading"] is None
