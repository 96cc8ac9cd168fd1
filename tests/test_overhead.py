"""The training loop's measured cost per micro-step: real Lightning runs around a linear layer, cached."""

from __future__ import annotations

import math

import pytest

from hslite.parallel.loop_cost import measure_step_overhead
from hslite.parallel.plan import Plan


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A private cache dir, so each test measures instead of reading a figure from another run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_one_process_loop_is_measured_once_then_read_from_the_cache(own_cache):
    seconds = measure_step_overhead(Plan(devices=1), num_classes=16)
    assert 0 < seconds < 1, "a linear layer's Lightning step takes milliseconds, not seconds"
    cached = list(own_cache.rglob("overhead-*.json"))
    assert len(cached) == 1
    assert measure_step_overhead(Plan(devices=1), num_classes=16) == seconds


@pytest.mark.distributed
def test_two_gloo_ranks_run_the_plans_own_ddp_loop(own_cache):
    seconds = measure_step_overhead(Plan(devices=2, batch_size=8), num_classes=4)
    assert math.isfinite(seconds) and seconds > 0
    assert len(list(own_cache.rglob("overhead-*.json"))) == 1
