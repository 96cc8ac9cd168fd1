"""hslite's Lightning strategies, for a team's own Lightning script: one place to import them from.

    import lightning.pytorch as pl
    from hslite.strategies import CompressedDDPStrategy

    trainer = pl.Trainer(accelerator="gpu", devices=4, strategy=CompressedDDPStrategy("int8"))
    trainer.fit(MyLightningModule(), datamodule=my_datamodule)

- `FencedDDPStrategy(deadlines=Deadlines(), **ddp_kwargs)`: Lightning's DDPStrategy (same keywords but `timeout`)
  with a deadline per phase: start-up, every collective (on GPUs NCCL's watchdog limit), and fences, barriers over a
  gloo group of their own that wait 30 minutes, so one rank writing a checkpoint alone cannot end a healthy job
  (`Deadlines` says why each is what it is). It destroys its process group at exit on every backend (Lightning does
  so for "nccl" only; a gloo group left alive can abort a finished run at exit). A rank that hangs alive is ended
  after `Deadlines.stall` by `hslite fit`'s stall watch; in your own script, after the collective deadline.
- `CompressedDDPStrategy(compression="int8", bucket_cap_mb=25.0, **ddp_kwargs)`: the above, with the gradient
  all-reduce compressed on every device type, CPU included: "int8" (per-chunk scales, error feedback: each rank keeps
  what rounding dropped and adds it to its next gradient; the residuals ride in checkpoints), "bf16", "fp16" or
  "none". `strategy.set_compression(kind)` switches it at run time.
- `ShardedStrategy(world_size, precision, backend, deadlines=Deadlines())`: FSDP2 (`fully_shard`) over every rank, on
  CPU (gloo) and GPU (NCCL), spawned, with full-state checkpoints that load on any world size. Your LightningModule
  shards its network in `configure_model`: `self.trainer.strategy.shard(self.net)`; the units gathered one at a time
  are the submodules the network's class names in `FSDP_UNITS` (`hslite.parallel.strategies.fsdp_policy`).

Channel groups and channel-subset rotation split a band-group model inside hslite's own task; from your own model,
use them through the recipes (`hslite.fit(..., model=YourModel)`, `parallel.chag=`, `parallel.rotation_groups=`).
"""

from hslite.parallel.deadlines import Deadlines
from hslite.parallel.strategies.ddp import CompressedDDPStrategy, FencedDDPStrategy
from hslite.parallel.strategies.fsdp import ShardedStrategy

__all__ = ["CompressedDDPStrategy", "Deadlines", "FencedDDPStrategy", "ShardedStrategy"]
