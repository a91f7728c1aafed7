"""helpers.nb.walk's readers: which batch a walk found, whether its runs are a finished walk, and
which runs ended for another reason than the budget (synthetic summaries, no jobs)."""

from helpers.nb import walk


def row(fits: dict[int, bool]) -> dict[int, dict]:
    return {b: {"memory_budget_fits": f, "status": "completed" if f else "failed",
                "reason": None if f else "peak over --memory-budget-gib"} for b, f in fits.items()}


def test_largest_is_the_fit_below_the_first_miss():
    assert walk.largest(row({5: True, 6: True, 7: False})) == 6
    assert walk.largest(row({3: False, 4: True})) == 0  # a fit above a miss does not count
    assert walk.largest(row({1: False})) == 0


def test_walked_needs_the_start_consecutive_batches_and_a_miss_above_the_fit():
    assert walk.walked(row({5: True, 6: True, 7: False}), start=5)
    assert walk.walked(row({6: True, 7: False}), start=6)  # the prediction was right: two jobs
    assert walk.walked(row({4: True, 5: False, 6: False}), start=6)  # walked down from a miss
    assert walk.walked(row({1: True, 2: False}), start=0)  # a prediction of 0 starts at 1
    assert not walk.walked(row({5: True, 6: True, 7: False}), start=4)  # did not begin at the start
    assert not walk.walked(row({5: True, 7: False}), start=5)  # skipped a batch
    assert not walk.walked(row({5: True, 6: True}), start=5)  # no miss above the fit


def test_failures_lists_only_runs_the_budget_did_not_stop():
    runs = row({5: True, 6: False})
    runs[7] = {"memory_budget_fits": False, "status": "failed", "reason": "rank 1 exited with SIGKILL"}
    assert walk.failures({"full_shard": runs}) == {"full_shard b7": "rank 1 exited with SIGKILL"}


def started(batches: list[int]) -> dict[int, dict]:
    """A row whose jobs started in the order given."""
    return {b: {"started_at": 1.8e9 + i} for i, b in enumerate(batches)}


def test_in_order_needs_the_start_first_then_one_sequence_a_job():
    assert walk.order(started([6, 5, 4])) == [6, 5, 4]
    assert walk.in_order(started([5, 6, 7]), start=5)
    assert walk.in_order(started([6, 5, 4]), start=6)  # walked down
    assert walk.in_order(started([1, 2]), start=0)  # a prediction of 0 starts at 1
    assert not walk.in_order(started([6, 5, 7]), start=6)  # jumped two sequences
    assert not walk.in_order(started([5, 6, 7]), start=6)  # did not begin at the prediction
    assert not walk.in_order({}, start=1)
