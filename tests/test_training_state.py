"""A checkpoint carries each rank's CUDA random state (dropout masks are drawn on the GPU) and a resume puts it back,
on the rank's own device only (CPU-only here: torch.cuda's generator calls are stood in for); every rank's state, a
compressing strategy's included, is gathered in one collective per checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from collective_recorder import RecordCollectives, check_collectives, recorded
from test_ddp import FixedData

from hslite.models import get_model
from hslite.parallel.deadlines import Deadlines
from hslite.parallel.plan import Plan
from hslite.parallel.strategies.ddp import CHECKPOINT_KEY, CompressedDDPStrategy
from hslite.parallel.trainer.trainer_args import process_group_backend, trainer_kwargs
from hslite.run.checkpoints import LastCheckpoint, read_checkpoint
from hslite.run.training_state import TrainingState
from hslite.task import HSIClassifier


def _trainer(device: str) -> SimpleNamespace:
    return SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(device)), train_dataloader=None, world_size=1, global_rank=0
    )


def test_a_gpu_rank_saves_and_restores_its_own_cuda_random_state(monkeypatch):
    saved_state = torch.tensor([7, 8, 9], dtype=torch.uint8)
    read, written = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: read.append(device) or saved_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: written.append((state, device)))
    trainer = _trainer("cuda:1")
    checkpoint: dict = {}
    TrainingState({}).on_save_checkpoint(trainer, None, checkpoint)
    assert read == [torch.device("cuda:1")]
    assert torch.equal(checkpoint["hslite"]["ranks"][0]["cuda"], saved_state)

    TrainingState({}).on_load_checkpoint(trainer, None, checkpoint)
    ((state, device),) = written
    assert device == torch.device("cuda:1") and torch.equal(state, saved_state)


def test_a_cpu_rank_touches_no_cuda_generator(monkeypatch):
    def refuse(*args):
        raise AssertionError("a CPU rank read or set a CUDA generator")

    monkeypatch.setattr(torch.cuda, "get_rng_state", refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state", refuse)
    checkpoint: dict = {}
    TrainingState({}).on_save_checkpoint(_trainer("cpu"), None, checkpoint)
    assert "cuda" not in checkpoint["hslite"]["ranks"][0]
    TrainingState({}).on_load_checkpoint(_trainer("cpu"), None, checkpoint)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_checkpoint_gathers_random_states_and_compression_residuals_in_one_collective(tmp_path):
    plan = Plan(devices=2, batch_size=8)
    kwargs = trainer_kwargs(plan, progress=False)
    kwargs["strategy"] = CompressedDDPStrategy(
        "int8", start_method="spawn", process_group_backend="gloo", deadlines=Deadlines(collective=60)
    )
    torch.manual_seed(0)
    task = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3), num_classes=4, warmup_epochs=0)
    last = tmp_path / "last.ckpt"
    callbacks = [RecordCollectives(tmp_path / "calls"), TrainingState({"test": "gather"}), LastCheckpoint(last, 1)]
    trainer = pl.Trainer(
        **{**kwargs, "callbacks": [*kwargs["callbacks"], *callbacks]},
        max_epochs=2, limit_val_batches=0, logger=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(task, datamodule=FixedData(plan.batch_size))

    calls = recorded(tmp_path / "calls")
    check_collectives(calls, 2, process_group_backend("gpu"))  # both ranks gather at the same points, as NCCL needs
    gathers = [call for call in calls[0] if call["op"] == "gather_object"]
    assert len(gathers) == 2, f"{len(gathers)} object gathers for the 2 checkpoints (one per epoch end)"
    saved = read_checkpoint(last)
    assert [sorted(rank) for rank in saved["hslite"]["ranks"]] == [["augmentation", "numpy", "python", "torch"]] * 2
    compression = saved[CHECKPOINT_KEY]
    assert compression["world_size"] == 2 and [rank["kind"] for rank in compression["ranks"]] == ["int8", "int8"]
    residuals = [rank["residuals"] for rank in compression["ranks"]]
    assert residuals[0] and sorted(residuals[0]) == sorted(residuals[1])
    assert any(not torch.equal(residuals[0][name], residuals[1][name]) for name in residuals[0])  # each rank its own
