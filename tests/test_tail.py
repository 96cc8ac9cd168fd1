"""The straggler's price: a plan of N synchronised ranks waits for the slowest, priced at the 0.5^(1/N) quantile."""

from __future__ import annotations

import random
import statistics

import pytest

from hslite.preflight_check.price.tail import MIN_TAIL_SAMPLES, quantile, slowest_rank_quantile, tail_factor, tail_note


def test_the_quantile_is_the_median_of_the_slowest_of_n_ranks():
    assert slowest_rank_quantile(1) == 0.5
    assert [round(100 * slowest_rank_quantile(n)) for n in (2, 4, 8, 16)] == [71, 84, 92, 96]
    # Simulated: the median over many steps of the slowest of 4 ranks' draws is the 84th percentile of one rank's.
    rng = random.Random(0)
    draws = [rng.lognormvariate(0.0, 0.3) for _ in range(200_000)]
    slowest = [max(draws[i : i + 4]) for i in range(0, len(draws), 4)]
    assert statistics.median(slowest) == pytest.approx(quantile(draws, slowest_rank_quantile(4)), rel=0.01)


def test_quantile_interpolates_as_numpy_does():
    samples = [4.0, 1.0, 3.0, 2.0]
    assert [quantile(samples, q) for q in (0.0, 0.5, 1.0, 1 / 3)] == pytest.approx([1.0, 2.5, 4.0, 2.0])


def test_one_rank_and_a_flat_distribution_wait_for_no_one():
    samples = [0.01] * 30
    assert tail_factor(samples, 1) == 1.0 and tail_factor(samples, 8) == 1.0
    assert tail_factor([0.01, 0.02] * 3, 8) == 1.0  # too few steps to say: not priced, and the note says so
    assert "not priced" in tail_note([0.01] * (MIN_TAIL_SAMPLES - 1), 4, 1)
    assert tail_note(samples, 1, 1) is None


def test_the_wait_grows_with_ranks_and_shrinks_with_accumulated_micro_steps():
    samples = [0.010 + 0.001 * i for i in range(20)]  # 10-29 ms, median 19.5 ms
    factors = [tail_factor(samples, n) for n in (2, 4, 8)]
    assert 1.0 < factors[0] < factors[1] < factors[2]
    assert factors[1] == pytest.approx(quantile(samples, 0.5**0.25) / 0.0195)
    assert tail_factor(samples, 4, accumulate=4) - 1 == pytest.approx((factors[1] - 1) / 2)  # excess / √G
    assert "p84 of 20 timed steps (the median slowest of 4 ranks over 4 micro-steps)" in tail_note(samples, 4, 4)


def test_the_cost_model_prices_a_multi_rank_step_at_the_tail_and_one_device_at_the_median():
    from test_costmodel import gpu_plan, make_probe

    from hslite.preflight_check.measurements import LinkModel
    from hslite.preflight_check.price.costmodel import predict

    probe = make_probe()
    skewed = make_probe(step_seconds_samples=[0.010] * 16 + [0.020] * 4)
    link = LinkModel(0.0, float("inf"))
    for plan in (gpu_plan(1), gpu_plan(4)):
        flat, tail = predict(plan, probe, link, 2**34), predict(plan, skewed, link, 2**34)
        expected = 1.0 if plan.world_size == 1 else quantile(skewed.step_seconds_samples, 0.5**0.25) / 0.010
        assert tail.compute_seconds == pytest.approx(flat.compute_seconds * expected)
    assert any("median slowest of 4 ranks" in note for note in tail.notes)
