"""One visual language: FSDP and DeepSpeed keep their two colours in every figure, and nothing else looks like
either (helpers.nb.plots). Renders every plotting function the notebooks and panels use, from made-up runs."""

import colorsys
import re
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from matplotlib import colors as mcolors  # noqa: E402
from matplotlib.collections import Collection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from helpers.core.mapping import CATEGORIES  # noqa: E402
from helpers.job.observe.offload import LOCATIONS  # noqa: E402
from helpers.nb import plots, widgets  # noqa: E402
from helpers.nb.results import Run, memory_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("fsdp", "deepspeed")


def hue_family(color) -> str | None:
    """The backend a colour would be read as: a saturated colour within 25 degrees of its hue."""
    r, g, b, a = mcolors.to_rgba(color)
    h, s, v = colorsys.rgb_to_hsv(r, g, b)
    if a == 0 or s < 0.3 or v < 0.25:
        return None  # greys, black, white, pale fills: no backend
    for backend, ref in plots.COLORS.items():
        rh = colorsys.rgb_to_hsv(*mcolors.to_rgb(ref))[0]
        if min(abs(h - rh), 1 - abs(h - rh)) * 360 < 25:
            return backend
    return None


def test_the_two_backend_colours_are_told_apart_by_the_rule():
    assert [hue_family(plots.COLORS[b]) for b in BACKENDS] == list(BACKENDS)
    assert hue_family("#1f77b4") == "fsdp" and hue_family("#dd8452") == "deepspeed"  # matplotlib's C0, C1
    assert hue_family("black") is None and hue_family("#eeeeee") is None


@pytest.mark.parametrize("palette", ["NEUTRAL", "CATEGORY_COLORS", "LANE_COLORS", "PHASE_COLORS", "prop_cycle"])
def test_no_other_palette_looks_like_a_backend(palette):
    colours = (plots.STYLE["axes.prop_cycle"].by_key()["color"] if palette == "prop_cycle"
               else getattr(plots, palette))
    colours = list(colours.values()) if isinstance(colours, dict) else list(colours)
    assert colours and all(hue_family(c) is None for c in colours), {c: hue_family(c) for c in colours}


def fake_run(backend: str, k: int, ranks: int = 2) -> Run:
    mode = "full_shard" if backend == "fsdp" else "zero3"
    per_cat = {c: 1000 * (i + 1) for i, c in enumerate(CATEGORIES)}
    summary = {"backend": backend, "mode": mode, "mode_key": mode, "world_size": ranks, "steps": 4,
               "memory_bytes": [per_cat] * ranks, "memory_theory_bytes": per_cat,
               "memory_location_bytes": [{c: {w: 100 * (i + 1) for w in LOCATIONS}
                                          for i, c in enumerate(CATEGORIES)}] * ranks,
               "tokens_per_s_per_rank": 100.0 + k, "mfu": 0.1 if k else None,
               "loading": {"method": "naive" if k else "zero3_init",
                           "ranks": [{"peak_rss_anon_bytes": 2**20 * (r + 1)} for r in range(ranks)]}}
    metrics = pd.DataFrame({"step": range(4), "loss": [4.0 - i / (k + 1) for i in range(4)],
                            "step_time_s": [0.1 + k / 100] * 4, "grad_norm": [1.0] * 4})
    return Run(f"{backend}{k}", Path("."), {}, summary, metrics)


def draw_fig(f):
    fig = plots.plt.figure()
    f(fig)
    return fig


def draw_ax(f):
    fig, ax = plots.plt.subplots()
    f(ax)
    return fig


# name -> (draws from these runs, colours by backend?)
FIGURES = {
    "loss_curves": (lambda runs: draw_ax(lambda ax: plots.loss_curves(runs, ax=ax)), True),
    "loss_difference": (lambda runs: draw_ax(lambda ax: plots.loss_difference(runs[0], runs[1], ax=ax)), False),
    "step_times": (lambda runs: draw_ax(lambda ax: plots.step_times(runs, ax=ax)), True),
    "run_curves": (lambda runs: draw_ax(lambda ax: plots.run_curves(runs, "loss", ax=ax)), True),
    "backend_bars": (lambda runs: draw_ax(lambda ax: plots.backend_bars(
        ax, [r.name for r in runs], [None] + [1.0] * (len(runs) - 1), [r.backend for r in runs], zero=False)), True),
    "run_memory_bars": (lambda runs: draw_ax(lambda ax: plots.run_memory_bars(runs, ax=ax)), False),
    "location_bars": (lambda runs: draw_fig(lambda fig: plots.location_bars(
        runs, axes=fig.subplots(1, len(LOCATIONS)))), False),
    "memory_bars": (lambda runs: draw_fig(lambda fig: plots.memory_bars(
        memory_table(runs), world_size=2, axes=fig.subplots(1, 2))), False),
    "memory_vs_world": (lambda runs: draw_ax(lambda ax: plots.memory_vs_world(
        memory_table(runs), sorted({r.summary["mode_key"] for r in runs}), ax=ax)), True),
    "collective_bars": (lambda runs: draw_ax(lambda ax: plots.collective_bars(pd.DataFrame(
        {"all_gathers": [3, 4], "reduce_scatters": [2, 2]}, index=["a", "b"]), ax=ax)), False),
    "widgets.plot_losses": (lambda runs: draw_fig(lambda fig: widgets.plot_losses(runs, fig)), True),
    "widgets.plot_memory": (lambda runs: draw_fig(lambda fig: widgets.plot_memory(runs, fig)), True),
    "widgets.plot_loading": (lambda runs: draw_fig(lambda fig: widgets.plot_loading(runs, fig)), True),
    "widgets.plot_locations": (lambda runs: draw_fig(lambda fig: widgets.plot_locations(runs, fig)), False),
    "widgets.plot_throughput": (lambda runs: draw_fig(lambda fig: widgets.plot_throughput(runs, fig)), True),
}


def colours_in(fig) -> set:
    found = set()
    for art in fig.findobj():
        if isinstance(art, Line2D):
            found |= {art.get_color(), art.get_markerfacecolor(), art.get_markeredgecolor()}
        elif isinstance(art, Patch) and art.axes is not None and art is not art.axes.patch:
            found |= {art.get_facecolor(), art.get_edgecolor()}
        elif isinstance(art, Collection):
            found |= {tuple(c) for c in art.get_facecolors()} | {tuple(c) for c in art.get_edgecolors()}
        elif isinstance(art, Text) and art.get_text():
            found.add(art.get_color())
    return {c if isinstance(c, str) else tuple(c) for c in found if c is not None and not
            (isinstance(c, str) and c in ("none", "auto"))}


def test_every_plotting_function_the_notebooks_call_is_rendered_here():
    called = set()
    for py in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py")):
        called |= set(re.findall(r"\bplots\.([a-z_]+)\(", py.read_text()))
        called |= {f"widgets.{n}" for n in re.findall(r"\bwidgets\.(plot_[a-z_]+)", py.read_text())}
    not_figures = {"plt", "use_style", "run_styles"}
    assert called - not_figures - set(FIGURES) - {"timeline"} == set()  # timeline: traces, palettes checked above


@pytest.mark.parametrize("name", sorted(FIGURES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_figure_of_one_backend_shows_its_colour_and_never_the_others(name, backend):
    draw, by_backend = FIGURES[name]
    plots.use_style()
    fig = draw([fake_run(backend, 0), fake_run(backend, 1)])
    try:
        families = {hue_family(c) for c in colours_in(fig)} - {None}
        other = next(b for b in BACKENDS if b != backend)
        assert other not in families, f"{name} drew {backend}'s runs in a colour read as {other}"
        if by_backend:
            assert families == {backend}, f"{name} does not draw {backend}'s runs in {backend}'s colour"
    finally:
        plots.plt.close(fig)


NEUTRAL_NAMES = r"(?:black|k|white|none|gr[ae]y|#?[0-9.]+)"


def test_notebooks_colour_only_through_plots():
    """A notebook never picks a colour itself: backend colours and palettes come from helpers.nb.plots."""
    bad = {}
    for py in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py")):
        code = "\n".join(ln for ln in py.read_text().splitlines() if not ln.startswith("# "))
        hits = re.findall(r"""color\s*=\s*["'](?!""" + NEUTRAL_NAMES + r"""["'])[^"']+["']""", code)
        hits += re.findall(r"""["']#[0-9a-fA-F]{6}["']""", code)
        hits += re.findall(r"""color\s*=\s*\[\s*["']""", code)
        if hits:
            bad[py.name] = hits
    assert not bad, f"colours picked in notebooks (use plots.COLORS / plots.backend_bars / plots.NEUTRAL): {bad}"
