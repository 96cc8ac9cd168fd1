"""A checkpoint carries each rank's CUDA random state (dropout masks are drawn on the GPU) and a resume puts it back,
on the rank's own device only. CPU-only here: torch.cuda's generator calls are stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hslite.run.training_state import TrainingState


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
