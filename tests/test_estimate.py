"""python -m helpers.estimate: bad input, the JSON, budgets, and its state bytes against real tiny jobs."""

import json
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from conftest import REPO, job_env, run_job, summary

from helpers import estimate as est
from helpers.core.mapping import CATEGORIES

FS = "launch_configs/fsdp/full_shard.yaml"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helpers.estimate", *args], cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=300)


def args(config=FS, model="tiny", world_size=2, micro_batch=None, seq_len=None, budget_gib=None, device="cpu"):
    return Namespace(config=str(REPO / config), model=model, world_size=world_size, micro_batch=micro_batch,
                     seq_len=seq_len, budget_gib=budget_gib, json=True, device=device)


@pytest.mark.parametrize("extra, names", [
    (("--world-size", "0"), "--world-size"),
    (("--world-size", "2", "--model", "no-such-model"), "no-such-model"),
    (("--world-size", "2", "--seq-len", "1"), "--seq-len = 1"),
    (("--world-size", "2", "--budget-gib", "-1"), "--budget-gib"),
    (("--world-size", "3", "--config", "launch_configs/deepspeed/zero3_hpz.yaml"), "zero_hpz_partition_size = 2"),
])
def test_bad_input_is_one_line_exit_2(extra, names):
    p = cli("--config", FS, *extra)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], p.stderr


def test_json_has_the_peak_per_rank_and_the_categories():
    p = cli("--config", FS, "--model", "small", "--world-size", "3", "--micro-batch", "2", "--json")
    assert p.returncode == 0, p.stderr
    e = json.loads(p.stdout)
    assert len(e["peak_bytes_per_rank"]) == 3 and len(e["categories_per_rank"]) == 3
    for row, peak in zip(e["categories_per_rank"], e["peak_bytes_per_rank"], strict=True):
        assert set(CATEGORIES) | {"activations", "activations_checkpointed", "gathered_unit", "comm_buckets",
                                  "master_grads", "optimizer_step", "loss_transient", "host", "disk"} <= set(row)
        state = sum(row[k] for k in CATEGORIES)  # FSDP: no buckets, no master_grads
        backward = state + row["gathered_unit"] - row["grads"] + row["activations"] + row["loss_transient"]
        end = state + row["gathered_unit"] * 3 // 2  # + the reduce-scatter's copy of the root unit's gradients
        assert peak == max(backward, end, state + row["optimizer_step"])
        assert row["activations_checkpointed"] < row["activations"]
    assert e["categories_per_rank"][2]["optimizer_states"] < e["categories_per_rank"][0]["optimizer_states"]


def test_budget_gives_the_largest_micro_batch_that_fits():
    e = est.run(args(model="medium", world_size=8, seq_len=1024, budget_gib=4))
    b = e["largest_micro_batch"]
    assert b >= 1
    assert max(est.run(args(model="medium", world_size=8, seq_len=1024, micro_batch=b))["peak_bytes_per_rank"]) \
        <= 4 * 2**30 < max(est.run(args(model="medium", world_size=8, seq_len=1024,
                                        micro_batch=b + 1))["peak_bytes_per_rank"])
    assert est.run(args(model="medium", world_size=1, budget_gib=0.001))["largest_micro_batch"] == 0


def test_offload_moves_state_to_host_and_disk():
    fs = est.run(args("launch_configs/fsdp/full_shard_offload.yaml"))["categories_per_rank"][0]
    assert all(fs[c] == 0 for c in CATEGORIES) and fs["host"] > 0
    nvme = est.run(args("launch_configs/deepspeed/zero3_nvme.yaml"))["categories_per_rank"][0]
    assert nvme["disk"] > 0 and nvme["optimizer_states"] == nvme["master_params"] == 0


@pytest.mark.parametrize("config", sorted(str(p.relative_to(REPO)) for p in (REPO / "launch_configs").rglob("*.yaml")))
def test_every_shipped_config_estimates(config):
    e = est.run(args(config, model="small", world_size=4))
    assert len(e["peak_bytes_per_rank"]) == 4 and min(e["peak_bytes_per_rank"]) > 0


def test_any_config_json_builds_on_meta(tmp_path):
    cfg = {"model_type": "qwen2", "vocab_size": 151_936, "hidden_size": 3584, "intermediate_size": 18_944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    e = est.run(args(model=str(tmp_path), world_size=8, micro_batch=1, seq_len=4096))
    assert 7.0e9 < e["num_params"] < 8.0e9  # Qwen2-7B's shape: no weights were made or downloaded


@pytest.mark.parametrize("config, ranks", [(FS, 3), ("launch_configs/fsdp/no_shard.yaml", 2)])
def test_state_bytes_equal_a_real_job_exactly(tmp_path, config, ranks):
    """FULL_SHARD on 3 ranks (tiny's rows do not split evenly: the last rank's Adam moments are smaller) and
    NO_SHARD: every rank's four state categories, to the byte; the activations within 2%."""
    proc = run_job(config, tmp_path, ranks, "--model", "tiny", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(tmp_path)
    e = est.run(args(config, world_size=ranks))
    for r in range(ranks):
        assert {c: e["categories_per_rank"][r][c] for c in CATEGORIES} == s["memory_bytes"][r], r
    measured = s["activation_bytes_per_sample"] * 8
    assert abs(e["categories_per_rank"][0]["activations"] - measured) <= 0.02 * measured
    if ranks == 3:
        assert s["memory_bytes"][2]["optimizer_states"] < s["memory_bytes"][0]["optimizer_states"]


def test_widget_uses_the_same_offload_rules():
    from helpers.nb import widgets

    w = widgets.estimate(1_000_000, 4, "SHARD_GRAD_OP / ZeRO-1", True, "bf16 mixed (fp32 shards / master)")
    moved = est.offloaded("zero1", offload=True)
    assert {c for c, v in w["zero1"]["host"].items() if v} == set(moved)


@pytest.mark.cpu_only("a GPU's peak is the allocator's, which the estimator leaves above it")
@pytest.mark.parametrize("config,micro_batch", [("launch_configs/deepspeed/zero0.yaml", 2),
                                                ("launch_configs/deepspeed/zero3.yaml", 2),
                                                ("launch_configs/fsdp/full_shard.yaml", 8)])
def test_one_rank_peak_equals_a_real_job(tmp_path, config, micro_batch):
    """On one rank the step is the peak here, and the estimator counts it (2% allowed): AdamW's two temporaries,
    ZeRO-0's fp32 gradients made for the step (not held through backward), ZeRO-3's three partitions.
    ``small``: there a wrong count of any of them moves the prediction by over 3% (tiny's would drown in
    ZeRO-3's 1 GB gradient bucket). FULL_SHARD at micro-batch 8: the start of backward comes near the step,
    and counting the root unit's gradients there (they are made by the head's backward, after the loss's)
    put it 4% above the measured peak. Identical ZeRO-3 jobs measured 1583-1617 MB here (nine runs, fork or
    torchrun, gc on or off): timing leaves up to ~2% more alive at the peak in some runs, never less than the
    prediction, so a second run is made when the first is outside and the smaller peak counts."""
    predicted = est.run(args(config, "small", world_size=1, micro_batch=micro_batch,
                             seq_len=64))["peak_bytes_per_rank"][0]
    measured = []
    for attempt in range(2):
        proc = run_job(config, tmp_path / str(attempt), 0, "--model", "small", "--steps", "3", "--micro-batch",
                       str(micro_batch), "--seq-len", "64")
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured.append(summary(tmp_path / str(attempt))["peak_tensor_bytes"][0])
        if abs(predicted - min(measured)) <= 0.02 * min(measured):
            break
    assert abs(predicted - min(measured)) <= 0.02 * min(measured), (predicted, measured)


def test_zero3_across_ranks_holds_forwards_gathered_params_and_two_reduce_scatter_copies():
    """Measured on ``small`` and ``medium`` (``benchmarks/peak_alive.py``: the allocations alive at the
    peak): across ranks ZeRO-3 still holds every parameter it gathered in forward when backward starts (the
    default reuse distance keeps them), and reduce-scatters the bucket through two copies of it; on one rank
    a parameter is its own partition and nothing is reduced: neither exists."""
    z3 = "launch_configs/deepspeed/zero3.yaml"
    one = est.run(args(z3, "small", world_size=1, micro_batch=2, seq_len=64))["categories_per_rank"][0]
    two = est.run(args(z3, "small", world_size=2, micro_batch=2, seq_len=64))
    row, numel = two["categories_per_rank"][0], two["num_params"]
    assert one["gathered_at_backward"] == one["reduce_scatter_copies"] == 0
    assert row["reduce_scatter_copies"] == 2 * 2 * numel  # bf16, the default 5e8-element bucket holds it all
    cuda = est.run(args(z3, "small", world_size=2, micro_batch=2, seq_len=64, device="cuda"))
    assert cuda["categories_per_rank"][0]["reduce_scatter_copies"] == 2 * numel  # nccl makes no input clone
    assert max(two["peak_bytes_per_rank"]) - max(cuda["peak_bytes_per_rank"]) <= 2 * numel
    assert 0.99 * 2 * numel <= row["gathered_at_backward"] < 2 * numel  # all but the small (persistent) norms
    fsdp = est.run(args(FS, "small", world_size=2, micro_batch=2, seq_len=64))["categories_per_rank"][0]
    assert fsdp["gathered_at_backward"] == fsdp["reduce_scatter_copies"] == 0


def test_stored_grid_holds_measurements_per_rank_that_the_estimator_rescores():
    """``benchmarks/estimate_grid.json`` (what notebook 08 shows) is measurements only, one peak per rank
    (and the repeat's, where a row was run twice); today's estimator scores every row."""
    doc = json.loads((REPO / "benchmarks" / "estimate_grid.json").read_text())
    assert {"machine", "versions"} <= set(doc["measured_with"])
    for row in doc["rows"][::10]:
        assert "predicted" not in row and len(row["measured"]) == row["world_size"]
        assert len(row.get("measured_repeat", row["measured"])) == row["world_size"]
        e = est.against(row)
        assert len(e["predicted"]) == row["world_size"]
        assert e["error"] == max(e["per_rank"], key=abs)
        assert ("error_repeat" in e) == ("measured_repeat" in row)


def test_persistence_default_is_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert est.PERSISTENCE_DEFAULT == DeepSpeedZeroConfig().param_persistence_threshold
    assert est.persistence_threshold({}) == est.PERSISTENCE_DEFAULT
    assert est.persistence_threshold({"stage3_param_persistence_threshold": "1e4"}) == 10_000
    assert est.is_persistent(100_000, 100_000) and not est.is_persistent(100_001, 100_000)  # "at most", as DeepSpeed


def test_cuda_counts_the_cublas_workspaces(monkeypatch):
    """--device cuda adds torch's cuBLAS workspaces (kept from the first matmul, in max_memory_allocated): two of
    torch's default size for a Hopper GPU (32 MiB), or of CUBLAS_WORKSPACE_CONFIG's when it is set; cpu none."""
    assert est.cublas_workspace_bytes(None, sm90=True) == 32 * 2**20
    assert est.cublas_workspace_bytes(None, sm90=False) == 8 * 2**20 + 128 * 2**10  # ":4096:2:16:8"
    assert est.cublas_workspace_bytes(":16:8") == 128 * 2**10
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    a = args(FS, "tiny", world_size=2, micro_batch=2, seq_len=64)
    cpu, cuda = est.run(a), est.run(args(FS, "tiny", world_size=2, micro_batch=2, seq_len=64, device="cuda"))
    ws = 2 * est.cublas_workspace_bytes(None, sm90=not torch.cuda.is_available()
                                        or torch.cuda.get_device_capability() == (9, 0))
    assert cpu["categories_per_rank"][0]["cublas_workspace"] == 0
    assert cuda["categories_per_rank"][0]["cublas_workspace"] == ws
    assert [c - p for c, p in zip(cuda["peak_bytes_per_rank"], cpu["peak_bytes_per_rank"], strict=True)] == [ws] * 2
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a job's own setting is followed
    small = est.run(args(FS, "tiny", world_size=2, micro_batch=2, seq_len=64, device="cuda"))
    assert small["categories_per_rank"][0]["cublas_workspace"] == 2 * 128 * 2**10
