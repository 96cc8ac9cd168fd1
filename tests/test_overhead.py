"""The training loop's measured cost per micro-step: real Lightning runs around a linear layer, cached."""

from __future__ import annotations

import json

import pytest
import torch

from hslite.cache import write_cache
from hslite.parallel.plan import Plan
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.preflight_check.measure.loop_cost import measure_step_overhead


def test_one_process_loop_is_measured_once_net_of_its_layers_bare_step_then_read_from_the_cache(own_cache):
    seconds = measure_step_overhead(Plan(devices=1), num_classes=16)
    assert 0 <= seconds < 1, "a linear layer's Lightning step takes milliseconds, not seconds"
    cached = [json.loads(path.read_text()) for path in own_cache.rglob("overhead-*.json")]
    assert len(cached) == 1
    loop, bare = cached[0]["result"]["step_seconds"], cached[0]["result"]["bare_step_seconds"]
    # The layer's own step is priced by the probe for the plan's model: the loop is what Lightning adds around it.
    # Two medians of a few steps each: on a busy machine the loop's can come out below the bare step's, priced 0.
    assert 0 < bare and 0 < loop and seconds == pytest.approx(max(0.0, loop - bare))
    assert measure_step_overhead(Plan(devices=1), num_classes=16) == seconds


@pytest.mark.distributed
def test_two_gloo_ranks_run_the_plans_own_ddp_loop_priced_net_of_their_bare_ddp_step(own_cache):
    seconds = measure_step_overhead(Plan(devices=2, batch_size=8), num_classes=4)
    # Per step, not per run: two processes' start-up, gloo's rendezvous and Lightning's setup take seconds, and a
    # figure that took them in would be that large.
    assert 0 <= seconds < 1, f"{seconds:.3g} s per step of a linear layer's DDP loop"
    cached = [json.loads(path.read_text()) for path in own_cache.rglob("overhead-*.json")]
    assert len(cached) == 1 and cached[0]["key"]["ranks"] == 2
    loop, bare = cached[0]["result"]["step_seconds"], cached[0]["result"]["bare_step_seconds"]
    # The ranks met at an all-reduce in each bare DDP step, which every plan prices on its own.
    assert 0 < bare and 0 < loop and seconds == pytest.approx(max(0.0, loop - bare))
    assert measure_step_overhead(Plan(devices=2, batch_size=8), num_classes=4) == seconds  # read back, net


def test_a_record_from_before_the_bare_step_was_timed_is_measured_again(own_cache, monkeypatch):
    from hslite.preflight_check.measure import loop_cost

    key = loop_cost._cache_key(Plan(devices=2, batch_size=loop_cost.BATCH_SIZE), 4)
    write_cache("overhead", key, {"step_seconds": 0.009})  # it holds the ranks' meeting, counted twice
    assert loop_cost.cached_step_overhead(Plan(devices=2), 4) is None
    write_cache("overhead", key, {"step_seconds": 0.009, "meeting_seconds": 0.006})  # one morning's: no 1-rank step
    assert loop_cost.cached_step_overhead(Plan(devices=2), 4) is None
    write_cache("overhead", key, {"step_seconds": 0.009, "bare_step_seconds": 0.006})
    assert loop_cost.cached_step_overhead(Plan(devices=2), 4) == pytest.approx(0.003)
    write_cache("overhead", key, {"step_seconds": 0.004, "bare_step_seconds": 0.005})  # two noisy medians
    assert loop_cost.cached_step_overhead(Plan(devices=2), 4) == 0.0


def test_the_ranks_loop_is_timed_with_the_plans_own_trainer(own_cache, monkeypatch):
    from hslite.preflight_check.measure import loop_cost

    trainers: list[dict] = []

    class Recorder:
        """Lightning's Trainer as far as the measurement uses it; the slowest rank's median comes back."""

        def __init__(self, **kwargs) -> None:
            trainers.append(kwargs)
            self.callback_metrics = {"perf/median_batch_seconds": torch.tensor(0.004),
                                     "perf/bare_step_seconds": torch.tensor(0.001)}  # fmt: skip

        def fit(self, task, train_dataloaders) -> None:
            trainers[-1]["batches"] = len(train_dataloaders.dataset)

    monkeypatch.setattr(loop_cost.pl, "Trainer", Recorder)
    assert measure_step_overhead(Plan(devices=2, batch_size=8), num_classes=4) == pytest.approx(0.003)
    plans_own = trainer_kwargs(Plan(devices=2, batch_size=loop_cost.BATCH_SIZE), progress=False)
    (used,) = trainers
    assert (used["accelerator"], used["devices"], used["num_nodes"]) == ("cpu", 2, 1)
    assert type(used["strategy"]) is type(plans_own["strategy"])  # the DDP strategy `hslite fit` trains with
    assert used["batches"] == 2 * loop_cost.STEPS_PER_RANK  # each rank steps as often as one process would
    assert any(isinstance(callback, loop_cost.BareStepTimer) for callback in used["callbacks"])
