"""The optional notebook panels: built without launching anything; a click runs real jobs."""

import matplotlib
import pytest

matplotlib.use("Agg")

from helpers import widgets  # noqa: E402

BF16 = "bf16 mixed (fp32 shards / master)"


def test_estimator_matches_the_zero_model():
    e = widgets.estimate(1_000_000, 4, "FULL_SHARD / ZeRO-3", False, BF16)
    assert sum(e["full_shard"]["device"].values()) == pytest.approx(16 * 1_000_000 / 4)  # 16 bytes/param, sharded
    assert sum(e["zero3"]["device"].values()) == pytest.approx(16 * 1_000_000 / 4)
    z2 = widgets.estimate(1_000_000, 4, "SHARD_GRAD_OP / ZeRO-2", False, BF16)["zero2"]["device"]
    assert z2["params"] == 2 * 1_000_000  # ZeRO-2 keeps full bf16 params on every rank
    off = widgets.estimate(1_000_000, 4, "SHARD_GRAD_OP / ZeRO-2", True, BF16)
    assert off["zero2"]["device"]["optimizer_states"] == 0 and off["zero2"]["device"]["params"] == 2 * 1_000_000
    assert sum(off["shard_grad_op"]["device"].values()) == 0  # FSDP offload moves everything
    low = widgets.estimate(1_000_000, 1, "NO_SHARD / ZeRO-0", False, "bf16 only (FSDP low precision)")
    assert sum(low["no_shard"]["device"].values()) == 8 * 1_000_000  # bf16 params, grads, 2 Adam states


def test_panels_build_without_running_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(widgets, "RUNS", tmp_path)
    m = widgets.MemoryEstimator()
    assert len(m.out.outputs) == 1  # the predicted figure
    m.world.value = 2
    assert len(m.out.outputs) == 1  # redrawn, not appended
    p = widgets.ControlPanel("t", {"hybrid": "launch_configs/fsdp/hybrid_shard.yaml"}, selected=["hybrid"])
    assert p.progress.value == 0 and not list(tmp_path.iterdir())
    assert p.run() == [] and "needs 4 ranks" in p.status.value  # refused with the reason, nothing launched


def test_run_button_launches_and_redraws(tmp_path, monkeypatch):
    monkeypatch.setattr(widgets, "RUNS", tmp_path)
    p = widgets.ControlPanel("t", {"FSDP": "launch_configs/fsdp/full_shard.yaml"}, selected=["FSDP"], steps=3)
    p.world.value = 1
    p.button.click()
    assert p.progress.value == p.progress.max == 3 and p.progress.bar_style == "success", p.status.value
    assert (tmp_path / "panel_t_0" / "summary.json").is_file()
    assert len(p.out.outputs) == 1 and "loss" in p.status.value
