"""Failure semantics a GPU job meets: who is blamed when hslite's stall watch ends a rank or NCCL's watchdog aborts the
waiting ranks (SIGABRT), and a rank's solo work (rank 0 writing a checkpoint) longer than the collectives' deadline
does not end a healthy job."""

from __future__ import annotations

import json
import signal
import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from test_ddp import FixedData
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from hslite.models import get_model
from hslite.parallel.deadlines import Deadlines
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.rank_watch import launched_failure, rank_failure
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.task import HSIClassifier

WATCHDOG_LINE = (
    "[rank0]:[E1203 08:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] "
    "Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=41, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=15000) ran for 15012 milliseconds before "
    "timing out."
)


COLLECTIVE = Deadlines(collective=15)


def _failure(
    codes: list[int], first: int, folder, logs: dict[int, str] | None = None, stalled: dict[int, float] | None = None
) -> str:
    for rank, text in (logs or {}).items():
        (folder / f"rank{rank}.log").write_text(text)
    procs = [SimpleNamespace(exitcode=code) for code in codes]
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=procs)))
    name = signal.Signals(-codes[first]).name
    error = ProcessExitedException(f"process {first} terminated with signal {name}", first, 1234, codes[first], name)
    return str(rank_failure(error, trainer, folder, COLLECTIVE, stalled or {}))


def test_a_rank_the_stall_watch_ended_is_named_with_its_silence_not_as_a_killed_rank(tmp_path):
    # The watch SIGKILLed rank 1; rank 0's collective then failed on the closed connection.
    text = _failure([1, -signal.SIGKILL], 1, tmp_path, stalled={1: 31.2})
    assert text.startswith(
        "rank 1 stopped responding: no heartbeat for 31 s (parallel.deadlines.stall=30), so hslite ended it"
    ), text


def test_nccl_watchdog_abort_blames_the_rank_that_stalled_not_the_one_that_waited(tmp_path):
    # Rank 1 stalled; NCCL's watchdog aborted rank 0 (which waited), then the launcher SIGKILLed rank 1.
    text = _failure([-signal.SIGABRT, -signal.SIGKILL], 0, tmp_path, {0: WATCHDOG_LINE})
    assert text.startswith(
        "rank 1 stopped responding: rank 0 waited 15 s (parallel.deadlines.collective) for it in a collective"
    ), text


def test_nccl_watchdog_abort_of_several_waiters_blames_the_one_rank_left(tmp_path):
    codes = [-signal.SIGABRT, -signal.SIGABRT, -signal.SIGTERM, -signal.SIGABRT]  # rank 2 stalled, answered SIGTERM
    text = _failure(codes, 1, tmp_path, {1: WATCHDOG_LINE})
    assert text.startswith("rank 2 stopped responding: rank 1 waited"), text


def test_without_logs_a_peer_the_launcher_had_to_kill_marks_the_abort_as_the_watchdog(tmp_path):
    text = _failure([-signal.SIGKILL, -signal.SIGABRT], 1, tmp_path)
    assert text.startswith("rank 0 stopped responding: rank 1 waited"), text


def test_a_rank_that_aborts_by_itself_is_the_one_blamed(tmp_path):
    # A genuine crash (an assertion in a kernel library): the others answered the launcher's SIGTERM.
    text = _failure([-signal.SIGTERM, -signal.SIGABRT], 1, tmp_path, {1: "terminate called after throwing ..."})
    assert text.startswith("rank 1 was killed by SIGABRT"), text


def test_a_killed_rank_is_still_blamed_first(tmp_path):
    text = _failure([-signal.SIGABRT, -signal.SIGKILL], 1, tmp_path)
    assert text.startswith("rank 1 was killed by SIGKILL"), text


def test_gloo_timeouts_still_blame_the_rank_that_had_to_be_killed(tmp_path):
    procs = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=-signal.SIGKILL)]
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=procs)))
    error = ProcessRaisedException("RuntimeError: [gloo] Timed out waiting 15000ms for recv operation", 0, 1234)
    text = str(rank_failure(error, trainer, tmp_path, COLLECTIVE, {}))
    assert text.startswith("rank 1 stopped responding: rank 0 waited")


# ------------------------------------------------------------------------------ a long solo phase, fenced
SOLO_SECONDS = 12.0  # rank 0's checkpoint write
# The collectives' deadline in this test: the write lasts more than twice as long, and the ranks' own steps and
# epoch-end reductions, on a loaded 2-core box, stay well within it. Start-up keeps its own (the ranks' imports).
DEADLINES = Deadlines(collective=5)


class SlowRankZeroWrite(TorchCheckpointIO):
    """Only rank 0 writes a checkpoint; here it takes SOLO_SECONDS, as a large model on a slow disk would."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(SOLO_SECONDS)
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_rank_zero_writing_a_checkpoint_longer_than_the_deadline_does_not_end_the_job(tmp_path):
    torch.manual_seed(0)
    task = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3), num_classes=4, warmup_epochs=0)
    kwargs = trainer_kwargs(Plan(devices=2, batch_size=16), progress=False, deadlines=DEADLINES)
    kwargs["strategy"].checkpoint_io = SlowRankZeroWrite()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = pl.Trainer(
        **{**kwargs, "callbacks": [*kwargs["callbacks"], checkpoints]},
        max_epochs=1, limit_val_batches=0, logger=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(task, datamodule=FixedData(16))
    assert (tmp_path / "last.ckpt").is_file()


GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:4508. This is typically caused by a remote worker crashing."
)


def _activity(folder, rank: int, node: int, doing: str, ago: float) -> None:
    entry = {"doing": doing, "at": time.time() - ago, "node": node, "host": f"host{node}"}
    (folder / f"rank{rank}.json").write_text(json.dumps(entry))


def test_a_launched_rank_whose_peer_closed_names_the_stalest_rank_and_its_node(tmp_path):
    _activity(tmp_path, 0, 0, "training epoch 3", 0.1)
    _activity(tmp_path, 1, 1, "training epoch 2", 30)
    _activity(tmp_path, 2, 1, "training epoch 3", 1)
    text = str(launched_failure(RuntimeError(GLOO_CLOSED), 0, tmp_path, COLLECTIVE))
    assert text.startswith("rank 1 on node 1 (host1) stopped answering; its last sign was training epoch 2 (30 s ago)")
    assert "saw its collective fail (Connection closed by peer [127.0.0.1]:4508)" in text


def test_a_launched_rank_a_stall_watch_ended_is_the_one_named_with_its_silence(tmp_path):
    _activity(tmp_path, 0, 0, "training epoch 3", 0.1)
    _activity(tmp_path, 1, 0, "training epoch 3", 31)
    _activity(tmp_path, 2, 1, "training epoch 2", 40)  # older, but a node that went on answering
    (tmp_path / "rank1.stalled").write_text(json.dumps({"silent_seconds": 31.4}))
    text = str(launched_failure(RuntimeError(GLOO_CLOSED), 0, tmp_path, COLLECTIVE))
    assert text.startswith(
        "rank 1 on node 0 (host0) stopped responding: no heartbeat for 31 s (parallel.deadlines.stall=30), so hslite "
        "ended it; its last sign was training epoch 3"
    ), text


@pytest.mark.parametrize(
    "error",
    [RuntimeError("Connection refused by the label server"), ValueError("NCCL is not a gloo word here")],
    ids=["connection-word", "nccl-word"],
)
def test_an_error_that_is_not_a_collectives_is_left_as_it_is(tmp_path, error):
    _activity(tmp_path, 0, 0, "training epoch 3", 0.1)
    _activity(tmp_path, 1, 1, "training epoch 2", 30)
    assert launched_failure(error, 0, tmp_path, COLLECTIVE) is None
