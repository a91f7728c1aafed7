"""The README stays a short front door, and it and the docs/ pages stay true to the repository.

No job runs here. Checked: the README's length and its links to every page; every relative link
(and ``#anchor``) in README.md and docs/*.md; every ``python -m helpers.X`` / ``torchrun ... -m
helpers.X`` the pages show (the module exists and ``--help`` works); every ``make TARGET``; every
repository path and every ``helpers.a.b`` name written in code.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 150

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a ``# comment`` in bash is not a heading)."""
    return FENCE.sub("", page.read_text())


def code(page: Path) -> str:
    """What the page shows as code: its fenced blocks and its inline `spans`, a line per span.

    A trailing backslash joins a command's continuation line to it."""
    blocks = FENCE.findall(page.read_text())
    spans = re.findall(r"`([^`\n]+)`", prose(page))
    return "\n".join(blocks + spans).replace("\\\n", " ")


def ids(pages, pattern) -> list[str]:
    """Sorted distinct matches of pattern's first group in the pages' code."""
    return sorted({m for p in pages for m in re.findall(pattern, code(p), re.M)})


# ---- 1. the README is short and leads to every page -------------------------------------------

def test_readme_is_at_most_150_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move a section to docs/ and link it"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in LINK.findall(prose(README))}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


# ---- 2. relative links and anchors resolve ----------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", prose(page), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif frag and frag not in anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    assert not bad, f"{page.name}: {bad}"


# ---- 3. commands, make targets, paths and names -------------------------------------------------

MODULES = ids(PAGES, r"(?:python|torchrun)\b[^\n]*?-m (helpers(?:\.\w+)+)")
# A command that takes positional arguments without argparse: any argument it does not expect
# prints its usage and exits 1.
USAGE_ONLY = {"helpers.loading"}


def test_the_pages_show_commands():
    assert {"helpers.train", "helpers.compare"} <= set(MODULES), MODULES


@pytest.mark.parametrize("module", MODULES)
def test_command_exists_and_answers_help(module):
    path = REPO / Path(*module.split("."))
    assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"no module {module}"
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == (1 if module in USAGE_ONLY else 0), out
    assert f"usage: python -m {module}" in out, out


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    shown = ids(PAGES, r"(?:^|\s)make ([a-z][\w-]*)")
    assert shown
    missing = sorted(set(shown) - targets)
    assert not missing, f"not in the Makefile: {missing}"


def expand(path: str) -> list[str]:
    """``zero{0,1}.yaml`` -> ``zero0.yaml``, ``zero1.yaml``."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in expand(path[:m.start()] + alt + path[m.end():])]


MADE_BY_RUNS = {"notebooks/runs"}  # written by jobs (git ignores it), named by `make clean`


def test_repository_paths_exist():
    top = r"(?<![\w/.])((?:launch_configs|helpers|benchmarks|tests|notebooks|docs)/[\w./{},*-]*)"
    configs = r"(?<![\w/.])((?:fsdp|deepspeed|slurm)/[\w{},]+\.(?:yaml|json|sbatch))"  # relative to launch_configs/
    paths = ids(PAGES, top) + ["launch_configs/" + p for p in ids(PAGES, configs)]
    assert any(p.startswith("launch_configs/") for p in paths)
    missing = [p for p in paths if p.rstrip("/") not in MADE_BY_RUNS
               for one in expand(p.rstrip(".,")) if not list(REPO.glob(one))]
    assert not missing, f"no such path in the repository: {missing}"


def resolves(dotted: str) -> bool:
    """``helpers.a.b`` is a package or module, or a module (or package) followed by one name it defines."""
    here = REPO
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        module, rest = ((here / f"{part}.py"), parts[i + 1:]) if (here / f"{part}.py").is_file() else \
            (here / "__init__.py", parts[i:])
        if not rest:
            return True
        defined = rf"^(?:def |class |async def )?{re.escape(rest[0])}\b"
        return len(rest) == 1 and module.is_file() and bool(re.search(defined, module.read_text(), re.M))
    return (here / "__init__.py").is_file()


def test_helpers_names_resolve():
    names = ids(PAGES, r"(?<![\w/.])(helpers(?:\.\w+)+)")
    bad = [n for n in names if not resolves(n)]
    assert not bad, f"named in the pages but not in helpers/: {bad}"


# ---- 6. the README's minutes are the committed notebooks' ------------------------------------

ROW = re.compile(r"^\| \[?`(\d\d_\w+)`.*\| *([\d.]+) *\| *([\d.]+) *\|$", re.M)


def test_readme_lists_every_notebook_with_its_reading_and_running_minutes():
    """Reading at 200 words a minute and running as the committed outputs timed it (helpers.nb.freshness.size);
    `make minutes` prints them. Running within half a minute: a re-execution moves it."""
    from helpers.nb.freshness import size

    listed = {m[0]: (float(m[1]), float(m[2])) for m in ROW.findall(README.read_text())}
    notebooks = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(listed) == [p.stem for p in notebooks], "README's notebook tables list another set of notebooks"
    wrong = {}
    for p in notebooks:
        z, (read, run) = size(p), listed[p.stem]
        if abs(read - z["read_min"]) > 0.15 or abs(run - z["run_min"]) > 0.5:
            wrong[p.stem] = {"README": (read, run), "committed": (round(z["read_min"], 1), round(z["run_min"], 1))}
    assert not wrong, f"README minutes (read, run) differ from the committed notebooks: {wrong}"
