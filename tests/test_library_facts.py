"""Every sentence the guide says about torch, DeepSpeed, Accelerate and transformers, checked against them.

The facts live in helpers/facts/ (one module per library). A fact that stops holding after a version bump
fails here with its id and its sentence: those are the sentences to rewrite. The building checks run together
with the reading ones in one subprocess (one-rank gloo group); two tests check reading facts in this process.
"""

import re
from pathlib import Path

import pytest

from helpers import facts

REPO = Path(__file__).resolve().parent.parent
REGISTRY = facts.load()
SHOWN = re.compile(r"facts\.(?:show|evidence)\(([^)]*)\)")
CITED = re.compile(r"(?:<!--|#) fact: ([a-z]+\.[\w.]+)")  # <!-- fact: id --> in markdown, # fact: id in code


@pytest.fixture(scope="module")
def verdicts():
    return facts.check(refresh=True)  # and store them: the notebooks that run next read them


@pytest.mark.parametrize("fid", sorted(REGISTRY))
def test_fact_holds_on_the_installed_library(fid, verdicts):
    f, v = REGISTRY[fid], verdicts[fid]
    if v.holds is None:
        pytest.skip(f"GPU only: {f.gpu_only}")
    assert v.holds, (f"library fact {fid} no longer holds on {f.library} {v.version} (read on {f.checked_on}): "
                     f"'{f.says}' evidence: {v.error or v.evidence}. Rewrite the sentences that cite it.")


def _cited() -> dict[str, set[str]]:
    """Fact ids each notebook source / markdown page / launch config cites (facts.show(...), <!-- fact: id --> in markdown, # fact: id in code)."""
    out = {}
    for p in [*sorted((REPO / "notebooks").glob("[0-9][0-9]_*.py")), REPO / "README.md",
              *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "launch_configs").rglob("*.yaml"))]:
        text = p.read_text()
        ids = {i for args in SHOWN.findall(text) for i in re.findall(r"[\"']([\w.]+)[\"']", args)}
        out[p.relative_to(REPO).as_posix()] = ids | set(CITED.findall(text))
    return out


def test_every_cited_fact_is_registered():
    unknown = {where: sorted(ids - set(REGISTRY)) for where, ids in _cited().items() if ids - set(REGISTRY)}
    assert not unknown, f"cited but not registered in helpers/facts: {unknown}"


def test_every_registered_fact_is_cited_somewhere():
    cited = set().union(*_cited().values())
    assert not set(REGISTRY) - cited, f"registered but cited by no notebook or page: {sorted(set(REGISTRY) - cited)}"


def test_a_changed_library_default_names_the_sentence(monkeypatch):
    """A version that changed a default fails the fact, and the message names the fact and its sentence."""
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(ds_config, "GRADIENT_CLIPPING_DEFAULT", 0.5)
    with pytest.raises(facts.FactFailed, match=r"deepspeed\.gradient_clipping_default .*'DeepSpeed clips gradients"):
        facts.show("deepspeed.gradient_clipping_default", here=True)


def test_a_fact_whose_check_breaks_fails_with_the_error(monkeypatch):
    """A check that raises (an attribute gone in a new version) is a failed fact, not a crash."""
    f = REGISTRY["deepspeed.gradient_clipping_default"]

    def gone():
        raise AttributeError("module 'deepspeed.runtime.config' has no attribute 'get_gradient_clipping'")

    monkeypatch.setitem(facts.REGISTRY, f.id, facts.Fact(f.id, f.says, f.library, f.checked_on, f.where, gone))
    v = facts.check([f.id], here=True)[f.id]
    assert v.holds is False and "no attribute" in v.error


def test_cli_lists_and_refuses_unknown_ids(capsys):
    from helpers.facts.__main__ import main

    assert main(["--list"]) == 0 and "deepspeed.gradient_clipping_default" in capsys.readouterr().out
    assert main(["no.such_fact"]) == 2 and "no fact no.such_fact" in capsys.readouterr().err
