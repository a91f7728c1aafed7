"""The optional notebook panels: built without launching anything; a click runs real jobs."""

import ast
import os
import re
import shlex
from pathlib import Path

import jupytext
import matplotlib
import pytest

matplotlib.use("Agg")

from helpers.nb import widgets  # noqa: E402

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
    p = widgets.ControlPanel("t", {"FSDP": "launch_configs/fsdp/full_shard.yaml"}, selected=["FSDP"],
                            args="--model tiny --steps 3")
    p.world.value = 1
    p.button.click()
    assert p.progress.value == p.progress.max == 3 and p.progress.bar_style == "success", p.status.value
    assert (tmp_path / "panel_t_0" / "summary.json").is_file()
    assert len(p.out.outputs) == 1 and "loss" in p.status.value


# --------------------------------------------------------------------------- each notebook's panel = its own run

REPO = Path(__file__).resolve().parents[1]
PANEL_NOTEBOOKS = ["00_launching", "01_sharding", "02_precision", "03_offload", "04_prefetch", "05_loading",
                   "07_throughput", "18_fit_details"]  # 06 relays one run through checkpoints: no single command to vary


def _code_cells(name: str) -> list[str]:
    nbk = jupytext.read(REPO / "notebooks" / f"{name}.py")
    return [c.source for c in nbk.cells if c.cell_type == "code"]


def _train_commands(cells: list[str]) -> list[tuple[list[str] | None, list[str]]]:
    """(configs it runs or None when read from a file, its arguments after --out) for every helpers.train line."""
    found = []
    for src in (c for c in cells if c.startswith("%%bash")):
        text = src.replace("\\\n", " ")
        loops = dict(re.findall(r"for (\w+) in ([^;]+); do", text))
        for line in text.splitlines():
            if "-m helpers.train" not in line or "--out" not in line:
                continue
            toks = shlex.split(re.sub(r"\$\([^)]*\)", "X", line.split("|")[0]))  # $(basename ...) in --out
            cfg, rest = toks[toks.index("--config") + 1], toks[toks.index("--out") + 2:]
            configs = [cfg]
            for var, values in loops.items():
                if f"${var}" in cfg:
                    configs = [c.replace(f"${var}", v) for c in configs for v in values.split()]
            found.append((None if any("$" in c for c in configs) else configs, rest))
    return found


@pytest.mark.parametrize("name", PANEL_NOTEBOOKS)
def test_each_panels_defaults_are_the_notebooks_own_command(name, monkeypatch):
    monkeypatch.setenv("GUIDE_SIZE", "quick")
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the notebook's first cell exports its variables
    monkeypatch.chdir(REPO)
    cells = _code_cells(name)
    scope: dict = {}
    exec(cells[0], scope)  # noqa: S102 - the notebook's own set-up cell: STEPS, ARGS, ... as the notebook has them
    panel_cells = [c for c in cells if "widgets.ControlPanel(" in c]
    assert len(panel_cells) == 1, f"{name}: one panel cell expected"
    tree = ast.parse(panel_cells[0])
    exec(compile(ast.Module(tree.body[:-1], []), name, "exec"), scope)  # noqa: S102
    panel = eval(compile(ast.Expression(tree.body[-1].value), name, "eval"), scope)  # noqa: S307
    own = _train_commands(cells)
    for label in panel.modes.value:
        cfg = panel.configs[label]
        assert any((cfgs is None or cfg in cfgs) and args == shlex.split(panel.args) for cfgs, args in own), \
            f"{name}: the panel's {label} ({cfg}, {panel.args!r}) is not one of the notebook's commands: {own}"
    cmd = panel.command(cfg, Path("d"))
    assert cmd[cmd.index("--out") + 2:] == shlex.split(os.path.expandvars(panel.args))  # token for token
    assert panel.world.value == 2 == int(cmd[cmd.index("--nproc_per_node") + 1])  # the notebooks' 2 CPU ranks
    assert "$" not in " ".join(cmd), cmd


def test_a_changed_control_changes_only_its_flag(monkeypatch):
    monkeypatch.setenv("LR", "1e-05")
    p = widgets.ControlPanel("t", {"FSDP": "launch_configs/fsdp/full_shard.yaml"}, args="--model tiny --lr $LR")
    assert p.lr.value == 1e-05 and p.train_args() == ["--model", "tiny", "--lr", "1e-05"]  # not snapped
    p.lr.value = 3e-3
    p.model.value = "small"
    assert p.train_args() == ["--model", "small", "--lr", "0.003"]
    q = widgets.ControlPanel("t", {"FSDP": "launch_configs/fsdp/full_shard.yaml"}, args="--steps 5")
    assert q.train_args() == ["--steps", "5"] and q.steps == 5  # the config's lr and model: no flag added
    q.lr.value = 1e-2
    assert q.train_args() == ["--steps", "5", "--lr", "0.01"]
    assert "ControlPanel(children" not in q._repr_mimebundle_()["text/plain"]
