"""The notebooks' claim helper: a false sentence fails its cell; timings are compared by their spread."""

import pytest

from helpers.nb.claims import ClaimFailed, claim, timing


def test_a_true_claim_prints_its_numbers(capsys):
    claim("host holds everything", True, host_MB=1.23456, total_MB=1.23456)
    assert capsys.readouterr().out == "✓ host holds everything  [host_MB=1.235, total_MB=1.235]\n"


def test_a_false_claim_fails_with_the_sentence_and_numbers(capsys):
    with pytest.raises(ClaimFailed, match=r"no longer holds: offload is slower \[ratio=0\.9\]"):
        claim("offload is slower", 0.9 > 1, ratio=0.9)
    assert capsys.readouterr().out == ""


def test_timing_says_faster_or_slower_only_when_the_spreads_part():
    fast, slow = [0.10, 0.11, 0.12, 0.11], [0.20, 0.21, 0.19, 0.22]
    assert timing("a", fast, "b", slow).verdict == "faster"
    assert timing("a", slow, "b", fast).verdict == "slower"
    t = timing("a", [0.10, 0.30, 0.12, 0.25], "b", [0.11, 0.20, 0.28, 0.13])
    assert t.verdict == "within noise" and "within this machine's noise of b" in str(t)
    assert timing("a", slow, "b", fast).ratio == pytest.approx(0.205 / 0.11)


def test_timing_refuses_no_times():
    with pytest.raises(ValueError, match="no times for b"):
        timing("a", [0.1], "b", [])


class _Run:  # what step_times reads: a run's metrics.jsonl rows
    def __init__(self, times):
        import pandas as pd

        self.metrics = pd.DataFrame({"step_time_s": times})


def test_timing_runs_calls_no_verdict_when_one_run_drifted():
    """One run of a that drifted (slow from its middle on) against steady runs of b: the pooled spreads part,
    but a's other run is as fast as b's, so no verdict; two runs each that all part: a verdict."""
    from helpers.nb.claims import timing_runs

    drifted, steady_a = _Run([0.4] * 2 + [0.66] * 10), _Run([0.4] * 2 + [0.38] * 10)
    b1, b2 = _Run([0.4] * 2 + [0.39] * 10), _Run([0.4] * 2 + [0.40] * 10)
    assert timing("a", [0.66] * 10, "b", [0.39] * 10).verdict == "slower"  # one run each: fooled
    t = timing_runs("a", [drifted, steady_a], "b", [b1, b2])
    assert t.verdict == "within noise" and "run medians 660/380 vs 390/400 ms" in str(t)
    slow = timing_runs("a", [drifted, _Run([0.4] * 2 + [0.65] * 10)], "b", [b1, b2])
    assert slow.verdict == "slower"
    with pytest.raises(ValueError, match="needs two or more of each"):
        timing_runs("a", [drifted], "b", [b1, b2])


def test_ran_reads_summary_and_config_and_fails_on_a_changed_flag(tmp_path, capsys):
    from types import SimpleNamespace

    from helpers.nb.claims import ran

    def run(name, steps):
        return SimpleNamespace(name=name, summary={"backend": "fsdp", "steps": steps, "world_size": 2},
                               config={"train": {"model": "tiny", "lr": 3e-3}, "fsdp": {"sharding": "FULL_SHARD"}})

    ran("both train tiny for 40 steps on 2 ranks", [run("a", 40), run("b", 40)], model="tiny", steps=40,
        world_size=2, sharding="FULL_SHARD")
    out = capsys.readouterr().out
    assert out.startswith("✓ both train tiny") and "steps=40" in out and "sharding=FULL_SHARD" in out
    with pytest.raises(ClaimFailed, match=r"steps=\{a: 40, b: 12\}"):
        ran("both train for 40 steps", [run("a", 40), run("b", 12)], steps=40)
    with pytest.raises(KeyError, match="'seq' is in neither"):
        ran("x", [run("a", 40)], seq=64)


def test_in_turn_needs_each_run_to_start_after_the_previous_one_ended():
    from types import SimpleNamespace

    from helpers.nb.claims import in_turn

    def run(name, start, wall=10.0):
        return SimpleNamespace(name=name, summary={"started_at": start, "wall_time_s": wall})

    in_turn("a then b then c", [run("a", 0.0), run("b", 11.0), run("c", 30.0)])
    with pytest.raises(ClaimFailed, match="b then a"):
        in_turn("b then a", [run("b", 11.0), run("a", 0.0)])
    with pytest.raises(ClaimFailed):  # overlapping: b started before a had finished
        in_turn("a then b", [run("a", 0.0), run("b", 5.0)])


def test_reused_checks_the_copy_against_its_source_directory(tmp_path, capsys):
    import json
    from types import SimpleNamespace

    from helpers.nb.claims import reused

    src = tmp_path / "01_fsdp"
    src.mkdir()
    summary = {"job_key": "k1", "losses": [7.0, 6.5]}
    (src / "summary.json").write_text(json.dumps(summary))
    (src / "config.json").write_text(json.dumps({"out": str(src), "train": {"steps": 2}}))

    def copy(**changes):
        s = {**summary, "reused_from": str(src), "reuse_key": "k1", **changes.pop("summary", {})}
        return SimpleNamespace(name="11_fsdp", summary=s, config={"out": "11_fsdp", "train": {"steps": 2}, **changes})

    here = SimpleNamespace(name="11_zero3", summary={"reused_from": None}, config={})
    reused("the copy is 01's job", [copy(), here], lambda r: tmp_path / f"01_{r.name[3:]}")
    out = capsys.readouterr().out
    assert "reused=[11_fsdp]" in out and "ran_here=[11_zero3]" in out
    for bad in (copy(summary={"losses": [7.0, 6.4]}), copy(summary={"reuse_key": "k2"}), copy(train={"steps": 3}),
                copy(summary={"reused_from": str(tmp_path / "elsewhere")})):
        with pytest.raises(ClaimFailed, match="the copy is 01's job"):
            reused("the copy is 01's job", [bad], lambda r: tmp_path / f"01_{r.name[3:]}")
