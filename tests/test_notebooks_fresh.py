"""Committed outputs cannot go stale: each .ipynb records the hash of the tree it ran on (helpers.nb.freshness)."""

import json
import shutil
from pathlib import Path

import pytest

from helpers.job import reuse
from helpers.nb import freshness

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("py", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_ran_on_this_tree(py):
    recorded = freshness.recorded_hash(py.with_suffix(".ipynb"))
    assert recorded is not None, f"{py.stem}.ipynb records no hash of what it ran on: run `make notebooks`"
    assert recorded == freshness.tree_hash(py), (
        f"{py.stem}.ipynb ran on another tree (its code cells, helpers/ or launch_configs/ changed since): "
        "run `make notebooks` (it re-executes the stale ones only)")


@pytest.mark.parametrize("py", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_are_whole_lines_without_widget_state(py):
    nb = json.loads(py.with_suffix(".ipynb").read_text())
    assert "widgets" not in nb["metadata"], f"{py.stem}.ipynb saves widget state: run `make notebooks`"
    for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        streams = [o for o in cell.get("outputs", []) if o["output_type"] == "stream"]
        names = [o.get("name") for o in cell.get("outputs", [])]
        assert all(a != b or a is None for a, b in zip(names, names[1:], strict=False)), \
            f"{py.stem} code cell {i}: one stream split in consecutive outputs"
        for o in streams[:-1]:
            assert "".join(o["text"]).endswith("\n"), f"{py.stem} code cell {i}: a stream output ends mid-line"


def test_pieces_cut_mid_word_become_whole_lines_in_order():
    out = [{"output_type": "stream", "name": "stdout", "text": "ok: fir"},
           {"output_type": "stream", "name": "stdout", "text": "st line\nsecond "},
           {"output_type": "stream", "name": "stderr", "text": "warn\n"},
           {"output_type": "stream", "name": "stdout", "text": "line\nthird\n"},
           {"output_type": "display_data", "data": {"text/plain": "fig"}, "metadata": {}},
           {"output_type": "stream", "name": "stdout", "text": ["done", "\n"]}]
    got = freshness.merge_streams(out)
    assert [(o.get("name"), o.get("text")) for o in got] == [
        ("stdout", "ok: first line\nsecond line\n"), ("stderr", "warn\n"), ("stdout", "third\n"),
        (None, None), ("stdout", "done\n")]
    assert "".join(o.get("text", "") for o in got) == "ok: first line\nsecond line\nwarn\nthird\ndone\n"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of the parts of the repository the hash reads, with one notebook finished on it."""
    root = tmp_path_factory.mktemp("tree")
    for top in reuse.CODE:
        shutil.copytree(REPO / top, root / top, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "notebooks").mkdir()
    for name in ("00_launching.py", "00_launching.ipynb"):
        shutil.copy(REPO / "notebooks" / name, root / "notebooks" / name)
    freshness.finish(root / "notebooks" / "00_launching.ipynb")
    return root


def test_a_change_to_code_helpers_or_configs_makes_outputs_stale_and_prose_does_not(tree):
    py = tree / "notebooks" / "00_launching.py"
    assert freshness.stale([py]) == []
    source = py.read_text()
    edits = {py: source.replace("# %% [markdown]\n# # 00", "# %% [markdown]\n# # 00 (edited)", 1),
             tree / "helpers" / "train.py": None, tree / "launch_configs" / "fsdp" / "full_shard.yaml": None}
    for path, new in edits.items():
        old = path.read_text()
        path.write_text(new if new is not None else old + "\n# an edit\n")
        stale = freshness.stale([py])
        path.write_text(old)
        assert stale == ([] if path == py else [py]), f"an edit to {path.relative_to(tree)}"
    code_edit = source.replace("import ", "import  ", 1)
    assert code_edit != source
    py.write_text(code_edit)
    try:
        assert freshness.stale([py]) == [py], "an edit to a code cell"
    finally:
        py.write_text(source)


def test_prose_edit_is_copied_over_with_outputs_and_hash_kept(tree):
    py, ipynb = tree / "notebooks" / "00_launching.py", tree / "notebooks" / "00_launching.ipynb"
    source, before = py.read_text(), json.loads(ipynb.read_text())
    py.write_text(source.replace("# %% [markdown]\n# # 00", "# %% [markdown]\n# # 00 (edited)", 1))
    try:
        assert freshness.prose(py)
        after = json.loads(ipynb.read_text())
        assert "".join(after["cells"][0]["source"]).startswith("# 00 (edited)")
        code = [c["outputs"] for c in before["cells"] if c["cell_type"] == "code"]
        assert [c["outputs"] for c in after["cells"] if c["cell_type"] == "code"] == code
        assert freshness.stale([py]) == []
        py.write_text(source.replace("import ", "import  ", 1))
        assert not freshness.prose(py), "a code edit is not prose: the notebook must run"
    finally:
        py.write_text(source)


def test_make_notebooks_reexecutes_the_notebooks_that_copy_runs_of_a_reexecuted_one(tmp_path):
    """A notebook that copies another's runs (`--reuse`) is re-executed after it, so its copies are the committed
    ones; a subset run that leaves it out says so. Checked with a stand-in venv: nothing executes."""
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()  # newer than pyproject.toml: `setup` has nothing to do
    stale = "notebooks/00_launching.py\nnotebooks/04_prefetch.py"
    (venv / "bin" / "python").write_text(
        f'#!/bin/bash\nif [ "$3" = stale ]; then printf "{stale}\\n"; else echo "py $*"; fi\n')
    (venv / "bin" / "jupytext").write_text('#!/bin/bash\necho "jupytext $*"\n')
    for f in (venv / "bin").iterdir():
        f.chmod(0o755)

    def executed(*args):
        out = subprocess.run(["make", "-s", "notebooks", f"VENV={venv}", *args], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
        return out, [line.split()[-1].split("/")[1][:2] for line in out.splitlines()
                     if line.startswith("jupytext --to ipynb")]

    out, ran = executed()
    assert ran == ["00", "04", "10", "14"], out  # 10 copies 00's runs, 14 copies 04's
    assert "notebooks/10_launching_details.py (it reads the runs of 00, re-executed above)" in out, out
    out, ran = executed("FORCE=1", "NB_PY=notebooks/08_batch_size.py")
    assert ran == ["08"], out
    assert "note: notebooks/18_fit_details.py reads the runs of 08" in out, out
