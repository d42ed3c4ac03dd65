"""bench/planner_bound.py's schedule searches on hand-built block curves whose answers are known."""

from __future__ import annotations

import pytest

from bench.planner_bound import cheapest, lagged, optimum


def test_optimum_meets_the_target_in_the_fewest_worker_hours():
    # Two one-hour blocks, 10 requests each; 18 of 20 must be met. Two workers each meet 9 + 9.
    curves = [{1: 5, 2: 9, 3: 10}, {1: 5, 2: 9, 3: 10}]
    got = optimum(curves, [0.0, 3600.0], [1.0, 1.0], fixed_size=0, total=20, target=0.9)
    assert got == {"attainment": 0.9, "worker_hours": 4.0, "sizes": [2, 2]}
    # The other pool's fixed workers count in every block.
    assert optimum(curves, [0.0, 3600.0], [1.0, 1.0], fixed_size=3, total=20, target=0.9)["worker_hours"] == 10.0
    # Out of reach: no schedule.
    assert optimum(curves, [0.0, 3600.0], [1.0, 1.0], fixed_size=0, total=21, target=1.0) is None


def test_optimum_beats_the_lagrange_sweep_where_that_overshoots():
    # 18 of 20 met takes one block at 3 workers and the other at 2 (8 + 10). A multiplier that
    # buys one block's third worker buys the other's too (the same curve), so the sweep goes
    # from 16 met to 20, at 3 + 3. Blocks of 36 s keep the multiplier inside the sweep's range.
    curves = [{1: 5, 2: 8, 3: 10}, {1: 5, 2: 8, 3: 10}]
    exact = optimum(curves, [0.0, 36.0], [0.01, 0.01], fixed_size=0, total=20, target=0.9)
    swept = cheapest(curves, [0.01, 0.01], fixed_size=0, total=20, target=0.9)
    assert exact["sizes"] in ([2, 3], [3, 2]) and exact["worker_hours"] == pytest.approx(0.05)
    assert swept["worker_hours"] == pytest.approx(0.06) and swept["attainment"] == 1.0


def test_optimum_does_not_grow_a_pool_back_within_the_hold():
    # Five-minute blocks; the middle one needs one worker, its neighbours three. Shrinking for it
    # and growing back five minutes later reverses a scale-down within 10 minutes.
    curves = [{1: 0, 3: 10}, {1: 10, 3: 10}, {1: 0, 3: 10}]
    starts, spans = [0.0, 300.0, 600.0], [1 / 12] * 3
    free = optimum(curves, starts, spans, fixed_size=0, total=30, target=1.0)
    held = optimum(curves, starts, spans, fixed_size=0, total=30, target=1.0, hold_s=600.0)
    assert free["sizes"] == [3, 1, 3] and free["worker_hours"] == pytest.approx(7 / 12)
    assert held["sizes"] == [3, 3, 3] and held["worker_hours"] == pytest.approx(9 / 12)
    # A hold shorter than a block binds nothing.
    assert optimum(curves, starts, spans, fixed_size=0, total=30, target=1.0, hold_s=300.0)["sizes"] == [3, 1, 3]


NEEDS_3 = {1: 0, 2: 5, 3: 10}  # a block of 10 requests that only 3 workers meet whole
NEEDS_1 = {1: 10, 2: 10, 3: 10}  # one that 1 worker meets


def test_the_causal_schedule_follows_a_load_its_past_predicts():
    # The load falls and stays down: sized from the block before, the schedule shrinks one block
    # late, and spends 11 worker-h where the static split (3 throughout) spends 15.
    curves = [NEEDS_3, NEEDS_3, NEEDS_1, NEEDS_1, NEEDS_1]
    got = lagged(curves, [10] * 5, [1.0] * 5, fixed_size=0, total=50, target=1.0, start=3, lag=1)
    assert got == {"attainment": 1.0, "worker_hours": 11.0, "sizes": [3, 3, 3, 1, 1]}


def test_the_causal_schedule_gains_nothing_where_the_past_misleads():
    # Heavy and light blocks alternate. Hindsight runs 3, 1, 3, 1 (8 worker-h); sized from the
    # block before, every heavy block follows a light one and misses whole.
    curves = [NEEDS_3, NEEDS_1, NEEDS_3, NEEDS_1]
    assert optimum(curves, [0.0, 3600.0, 7200.0, 10800.0], [1.0] * 4, 0, 40, 1.0)["worker_hours"] == 8.0
    assert lagged(curves, [10] * 4, [1.0] * 4, fixed_size=0, total=40, target=1.0, start=3, lag=1) is None
    # Sized from every block before, it keeps 3 workers: the static split's 12 worker-h.
    got = lagged(curves, [10] * 4, [1.0] * 4, fixed_size=0, total=40, target=1.0, start=3, lag=0)
    assert got == {"attainment": 1.0, "worker_hours": 12.0, "sizes": [3, 3, 3, 3]}
