"""FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy, on CPU (gloo) and GPU (NCCL) alike.

Lightning's `FSDPStrategy` refuses CPU, and `ModelParallelStrategy` launches by re-running the script (a library call
such as `fit` cannot work that way, and inside pytest it relaunches pytest). `ShardedStrategy` is
ModelParallelStrategy with every rank data-parallel (`data_parallel_size` = world size: its single-node default would
make every device tensor-parallel and shard no data), launched by spawning like hslite's DDP, and with full-state
checkpoints: one file that loads back on any world size, and on one device for test, map and predict. What is
sharded, unit by unit, is `fsdp_policy`'s choice. Hybrid sharding (HSDP, `replicas` > 1, one replica per node) shards
over a (replicate, shard) mesh whose shard groups are a node's consecutive ranks: FSDP2 gathers and reduce-scatters
inside a node and all-reduces each shard across the replicas.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from hslite.parallel.deadlines import DEFAULT_DEADLINES, Deadlines, FencedBarrier
from hslite.parallel.spawned_rank import end_finished_rank
from hslite.parallel.strategies.ddp import DestroyedAtExit
from hslite.parallel.strategies.fsdp_policy import shard_model

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ShardedStrategy(DestroyedAtExit, FencedBarrier, ModelParallelStrategy):
    """FSDP2 over every rank, spawned, with full-state checkpoints and fenced barriers; the task shards with it.

    `HSIClassifier.configure_model` calls `shard`; `deadlines.FencedBarrier` says why barriers are fences and
    `strategies.DestroyedAtExit` why each rank destroys its group at exit.
    """

    def __init__(
        self,
        world_size: int,
        precision: str,
        backend: str,
        spawn: bool = True,
        replicas: int = 1,
        deadlines: Deadlines = DEFAULT_DEADLINES,
    ) -> None:
        super().__init__(
            data_parallel_size=world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=backend,
            deadlines=deadlines,
        )
        self.compute_precision, self.spawn, self.replicas = precision, spawn, replicas

    def shard(self, model: nn.Module) -> None:
        """Shard `model` over the data-parallel mesh (the LightningModule's configure_model calls this).

        Every rank stays data-parallel (Lightning's sampler reads the 1-D mesh); under hybrid sharding the same ranks
        are viewed as (replicas, ranks per replica), row-major as torchrun and srun number a node's ranks.
        """
        mesh = self.device_mesh["data_parallel"]
        if self.replicas > 1:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.replicas, self.world_size // self.replicas)
            mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))
        shard_model(model, mesh, self.compute_precision)

    def _configure_launcher(self) -> None:
        if not self.spawn:  # a launcher started the ranks (`parallel.launched`): Lightning's launcher starts none
            super()._configure_launcher()
            return
        self._launcher = _FullStateLauncher(self, start_method="spawn")


class _FullStateLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the trained weights back whole: rank 0's own state dict holds only its shards."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # The rank's last collective is behind it and rank 0's result is on the SimpleQueue (written synchronously).
        end_finished_rank()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        # Lightning's own version saves `lightning_module.state_dict()`, whose DTensors are this rank's shards only.
        state = trainer.strategy.lightning_module_state_dict()  # a collective: full on rank 0, empty elsewhere
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            trainer.strategy.checkpoint_io.save_checkpoint(state, weights_path)
        checkpoint = trainer.checkpoint_callback
        best = getattr(checkpoint, "best_model_path", None) if checkpoint else None
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))
