"""A library call leaves the caller's process as it found it; only processes hslite owns keep its settings."""

from __future__ import annotations

import logging
import os
import random
import signal
import warnings

import numpy as np
import pytest
import torch
from quick_fit import NO_PREFLIGHT, QUICK_FIT

import hslite
import hslite.process.allocator as allocator
from hslite.parallel.cuda_math import set_cuda_math
from hslite.parallel.ranks.rank_setup import quiet_lightning
from hslite.process.caller_state import QUIETED_LOGGERS, caller_state_kept


def _state():
    return {
        "threads": torch.get_num_threads(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "conv_tf32": torch.backends.cudnn.conv.fp32_precision,
        "filters": list(warnings.filters),
        "levels": [logging.getLogger(name).level for name in QUIETED_LOGGERS],
        "environ": dict(os.environ),
        "rng": (random.random(), np.random.rand(), torch.rand(1).item()),  # drawn from copies, below
        "sigterm": signal.getsignal(signal.SIGTERM),
    }


def _snapshot():
    """The state, with the random draws taken on restored generators so reading does not move them."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    state = _state()
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.random.set_rng_state(saved[2])
    return state


@pytest.fixture
def a_callers_state():
    """A caller with settings of its own: one thread, deterministic kernels (warn only), a seed, a precision."""
    with caller_state_kept():
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("high")
        torch.manual_seed(1234)
        warnings.simplefilter("default")
        yield


def test_everything_a_run_sets_comes_back_after_the_body_returns_or_raises(a_callers_state):
    before = _snapshot()
    with pytest.raises(RuntimeError, match="body failed"), caller_state_kept():
        torch.set_num_threads(2)
        torch.use_deterministic_algorithms(False)
        set_cuda_math(True, True)
        torch.backends.cudnn.deterministic = True
        quiet_lightning()
        os.environ["PL_GLOBAL_SEED"] = "0"
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        signal.signal(signal.SIGTERM, lambda *_: None)
        raise RuntimeError("body failed")
    assert _snapshot() == before


@pytest.mark.slow
def test_hslite_fit_leaves_the_callers_process_as_it_found_it(a_callers_state, tmp_path, monkeypatch):
    libc_calls = []

    class Libc:
        def __getattr__(self, name):
            return lambda *args: libc_calls.append(name) or 1

    class Ctypes:
        def CDLL(self, name):  # noqa: N802 - ctypes' own name
            return Libc()

    monkeypatch.setattr(allocator, "ctypes", Ctypes())
    before = _snapshot()
    run = hslite.fit("quickstart", [*QUICK_FIT, NO_PREFLIGHT, f"output.root={tmp_path}"])
    assert run.metrics["OA"] > 0
    after = _snapshot()
    assert {key: after[key] for key in before if after[key] != before[key]} == {}
    assert "mallopt" not in libc_calls  # glibc's thresholds are not a library call's to set: nothing reads them back


@pytest.mark.parametrize("spawned", [True, False])
def test_only_ranks_hslite_spawned_set_the_allocator(spawned, monkeypatch):
    from hslite.parallel.ranks import rank_setup

    calls = []
    monkeypatch.setattr(rank_setup, "keep_freed_memory", lambda: calls.append(1))
    with caller_state_kept():
        rank_setup.RankSetup(None, spawned=spawned).setup(None, None, "fit")
    assert calls == ([1] if spawned else [])
