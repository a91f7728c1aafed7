"""The .py percent file is the source; its paired .ipynb must hold the same cells."""

import ast
import re
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


def _leading_text(call: ast.Call) -> str | None:
    """The constant text a ``print("...")`` / ``print(f"...{x}")`` line starts with, if it has one."""
    if not call.args or any(k.arg == "file" for k in call.keywords):
        return None
    arg = call.args[0]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        arg = arg.values[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value.split("\n")[0].strip()
    return None


def stale_reasons(cell) -> list[str]:
    """What shows a code cell's outputs were not made by its current source (where that can be told)."""
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:  # %%bash cells, IPython magics: nothing to tell from
        return []
    outs = cell.get("outputs", [])
    text = "".join(o.get("text", "") for o in outs if o.get("output_type") == "stream")
    why = []
    last = tree.body[-1] if tree.body else None
    if any(o.get("output_type") == "execute_result" for o in outs) and (
            not isinstance(last, ast.Expr) or cell.source.rstrip().endswith(";")):
        why.append("has a result value, but its source does not end in an expression")
    for stmt in tree.body:  # top-level prints only: they run whenever the cell runs
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and \
                getattr(stmt.value.func, "id", None) == "print":
            lead = _leading_text(stmt.value)
            if lead and len(lead) >= 6 and lead not in text:
                why.append(f"prints {lead!r}, which is not in its output")
    return why


@pytest.mark.parametrize("py", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_come_from_one_run_of_the_current_source(py):
    """Every code cell ran once, in order, in one session (execution counts 1..n), no cell failed, and no
    output visibly belongs to an older source."""
    nb = jupytext.read(py.with_suffix(".ipynb"))
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{py.stem}: execution counts {counts}: run `make notebooks`"
    errors = [i for i, c in enumerate(code) for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{py.stem}: code cells {errors} hold an error output"
    stale = {i: why for i, c in enumerate(code) if (why := stale_reasons(c))}
    assert not stale, f"{py.stem}: outputs older than the source (code cell index: why): {stale}"
    first = "".join(_text(o) for o in code[0].get("outputs", []))
    assert "size=full" in first, f"{py.stem}: not executed at full size (first cell printed {first[:80]!r})"
    noisy = {i: m.group(0) for i, c in enumerate(code) for o in c.get("outputs", [])
             if (m := NOISE.search(_text(o)))}
    assert not noisy, f"{py.stem}: outputs a learner should not see (code cell index: text): {noisy}"


# what a learner should not have to read in a committed output: op builds, per-rank progress fragments, warnings
NOISE = re.compile(r"built successfully|Loading weights|\[WARNING\]|FutureWarning|UserWarning|Traceback")


def _text(output) -> str:
    if "text" in output:
        return "".join(output["text"]) if isinstance(output["text"], list) else output["text"]
    data = output.get("data", {}).get("text/plain", "")
    return "".join(data) if isinstance(data, list) else data
