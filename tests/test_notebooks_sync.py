"""The .py percent file is the source; its paired .ipynb must hold the same cells."""

from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_topic.py found"


@pytest.mark.parametrize("py", NOTEBOOKS, ids=lambda p: p.name)
def test_pair_in_sync(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{py.name} has no paired .ipynb: run `make notebooks`"
    src, paired = jupytext.read(py), jupytext.read(ipynb)
    assert cells(src) == cells(paired), f"{ipynb.name} is out of sync with {py.name}: run `make notebooks`"


@pytest.mark.parametrize("py", NOTEBOOKS, ids=lambda p: p.name)
def test_ipynb_carries_outputs(py):
    nb = jupytext.read(py.with_suffix(".ipynb"))
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any(c.get("outputs") for c in code), f"{py.with_suffix('.ipynb').name} has no outputs: run `make notebooks`"
