"""The house by role (issue 36): no import cycles, dependencies pointing down, observers ordered by what they
declare, modules readable in one sitting.

Layers, top to bottom: the ``python -m helpers.X`` tools (helpers/*.py) and the notebooks' side (helpers/nb/,
helpers/facts/); what runs in a job (helpers/job/); the shared core (helpers/core/). A module imports its own
layer or lower, never higher. Imports only for type hints (``if TYPE_CHECKING:``) are not counted.
"""

import ast
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HELPERS = REPO / "helpers"
LAYER = {"core": 0, "job": 1, "nb": 2, "facts": 2}  # top-level tools: 3
TABLES: set[str] = set()  # modules allowed over MAX_LINES because they are a table (none today)
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(HELPERS.rglob("*.py"))}


def layer(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return -1  # the package itself (CHECKOUT, the build environment): below everything
    return LAYER.get(parts[1], 3) if len(parts) > 2 or parts[1] in LAYER else 3


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for sub in node.body:
                lines.update(range(sub.lineno, sub.end_lineno + 1))
    return lines


def imports(mod: str) -> set[str]:
    """The helpers modules ``mod`` imports at run time (module level and inside functions)."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    skip, out = _type_checking_lines(tree), set()
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("helpers")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if not base.startswith("helpers"):
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in out if m in MODULES and m != mod}


GRAPH = {m: imports(m) for m in MODULES}


def test_no_import_cycles():
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(GRAPH[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_dependencies_point_down():
    up = [f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in GRAPH.items() for d in sorted(deps)
          if layer(d) > layer(m) and not (m == "helpers" or d == "helpers")]
    assert not up, "imports of a higher layer (core 0 < job 1 < nb, facts 2 < tools 3):\n" + "\n".join(up)


def test_modules_read_in_one_sitting():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES and m not in TABLES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_observers_run_providers_first_whatever_the_list_order():
    from helpers.job.observe import observers as obs

    def fresh():
        return [obs.Throughput(), obs.Loading(), obs.Memory(), obs.TensorPeak(), obs.MemoryBudget(None),
                obs.Dtypes(), obs.Updates(enabled=False), obs.Profiler(), obs.ProgressLog(), obs.Checkpoints()]

    for seed in range(5):
        items = fresh()
        random.Random(seed).shuffle(items)
        order = [type(o).__name__ for o in obs.Observers(items).items]
        assert order.index("Memory") < order.index("TensorPeak") < order.index("MemoryBudget"), order
        assert order.index("Memory") < order.index("Checkpoints"), order
    items = fresh()
    got = obs.Observers(items)
    assert got.items[3].uses["peak_sampler"] is got.items[2]  # TensorPeak reads Memory's sampler
    with pytest.raises(ValueError, match=r"observer TensorPeak needs peak_sampler: no observer provides it"):
        obs.Observers([obs.TensorPeak()])
