"""A checkpoint's per-rank states (random generators, int8 residuals) are gathered to rank 0 only, which alone writes
the file: rank 1 receives none of them, and the file holds every rank's state in rank order, as before.

Two spawned gloo ranks call what Lightning calls when it saves (TrainingState's hook, then the strategy's
save_checkpoint), with and without TrainingState. Spawned ranks unpickle what they run: helpers live at module level.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments import LightningEnvironment

from hslite.parallel.strategies.ddp import CHECKPOINT_KEY, CompressedDDPStrategy
from hslite.run.checkpoints import read_checkpoint
from hslite.run.training_state import CHECKPOINT_KEY as STATE_KEY
from hslite.run.training_state import TrainingState

CONFIG = {"test": "gather to rank 0"}


def _strategy(rank: int) -> CompressedDDPStrategy:
    """A CompressedDDPStrategy as Lightning leaves it in rank `rank` of 2 CPU ranks, one int8 residual of its own."""
    environment = LightningEnvironment()
    environment.set_world_size(2)
    environment.set_global_rank(rank)
    strategy = CompressedDDPStrategy("int8", process_group_backend="gloo", cluster_environment=environment)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.compression_state._loose = {"head.weight": torch.full((3,), float(rank + 1))}
    return strategy


def _rank(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder, "store")), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(rank)
        strategy = _strategy(rank)
        with_state: dict = {"state_dict": {}, "optimizer_states": []}
        trainer = SimpleNamespace(strategy=strategy, train_dataloader=None)
        TrainingState(CONFIG).on_save_checkpoint(trainer, None, with_state)
        strategy.save_checkpoint(with_state, Path(folder, "with_state.ckpt"))
        alone: dict = {"state_dict": {}, "optimizer_states": []}
        strategy.save_checkpoint(alone, Path(folder, "alone.ckpt"))
        torch.save({"with_state": with_state, "alone": alone}, Path(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_rank_zero_alone_receives_the_ranks_states_and_writes_them_all(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    kept = torch.load(tmp_path / "rank1.pt", weights_only=False)
    # Rank 1 holds no rank's state, its own included; the keys are there, so its strategy did not gather again.
    assert kept["with_state"][STATE_KEY] == {"config": CONFIG, "ranks": []}
    assert kept["with_state"][CHECKPOINT_KEY] == {"world_size": 0, "ranks": []}
    assert kept["alone"][CHECKPOINT_KEY] == {"world_size": 0, "ranks": []}
    with_state, alone = read_checkpoint(tmp_path / "with_state.ckpt"), read_checkpoint(tmp_path / "alone.ckpt")
    assert with_state[STATE_KEY]["config"] == CONFIG
    seeded = [torch.Generator().manual_seed(rank).get_state() for rank in range(2)]
    generators = [state["torch"] for state in with_state[STATE_KEY]["ranks"]]
    assert len(generators) == 2 and all(map(torch.equal, generators, seeded))  # each rank's own, in rank order
    for written in (with_state[CHECKPOINT_KEY], alone[CHECKPOINT_KEY]):
        assert written["world_size"] == 2 and [state["kind"] for state in written["ranks"]] == ["int8", "int8"]
        residuals = [state["residuals"]["head.weight"].tolist() for state in written["ranks"]]
        assert residuals == [[1.0] * 3, [2.0] * 3]  # every rank's own, in rank order
