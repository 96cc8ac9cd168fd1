"""fit's batch timer: a batch runs from its start to the next one's, so fetching data counts; validation does not."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hslite.parallel import timing
from hslite.parallel.timing import TrainThroughput


def _clock(monkeypatch, read):
    """Stand `read` in for the timer's clock, in timing.py's own reference to it (not the process-wide time module)."""
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=read))


def test_batch_time_includes_the_fetch_before_the_next_batch_and_not_the_gap_across_validation(monkeypatch):
    # Epoch 0: batches start at 0, 1, 3 and the epoch ends at 6. Validation runs until 100; epoch 1: 100, 104, end 105.
    ticks = iter([0.0, 1.0, 3.0, 6.0, 100.0, 104.0, 105.0])
    _clock(monkeypatch, lambda: next(ticks))
    logged: dict[str, float] = {}
    module = SimpleNamespace(log_dict=lambda metrics, **_: logged.update(metrics))
    timer = TrainThroughput()
    batch = (torch.zeros(4, 3), torch.zeros(4))
    for epoch, batches in ((0, 3), (1, 2)):
        # One rank's view; the max over ranks is the strategy's all-reduce (two real ranks: tests/test_ddp.py).
        strategy = SimpleNamespace(reduce=lambda values, reduce_op: values, root_device=torch.device("cpu"))
        trainer = SimpleNamespace(world_size=2, current_epoch=epoch, global_step=0, strategy=strategy)
        timer.on_train_epoch_start(trainer, module)
        for i in range(batches):
            timer.on_train_batch_start(trainer, module, batch, i)
            timer.on_train_batch_end(trainer, module, None, batch, i)
        timer.on_train_epoch_end(trainer, module)
    monkeypatch.undo()

    assert next(ticks, None) is None, "the timer did not read the stand-in clock at every batch start and epoch end"
    assert timer.batch_seconds == [1.0, 2.0, 3.0, 4.0, 1.0]  # 6 -> 100 (validation) is no batch's time
    assert logged["perf/median_batch_seconds"] == 2.5  # the run's first batch is left out
    assert logged["perf/train_samples"] == 5 * 4 * 2


def test_on_a_gpu_the_epoch_ends_only_when_its_queued_work_has_run(monkeypatch):
    # Steps do not wait for the GPU (task.py), so the epoch's last batch may still be queued when the epoch ends.
    order: list[str] = []
    _clock(monkeypatch, lambda: order.append("clock") or float(len(order)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(f"sync {device}"))
    strategy = SimpleNamespace(reduce=lambda values, reduce_op: values, root_device=torch.device("cuda:1"))
    trainer = SimpleNamespace(world_size=1, current_epoch=0, global_step=1, strategy=strategy)
    module = SimpleNamespace(log_dict=lambda metrics, **_: None)
    timer = TrainThroughput()
    timer.on_train_epoch_start(trainer, module)
    timer.on_train_batch_start(trainer, module, (torch.zeros(2, 3), torch.zeros(2)), 0)
    timer.on_train_epoch_end(trainer, module)
    monkeypatch.undo()
    assert order == ["clock", "sync cuda:1", "clock"]
