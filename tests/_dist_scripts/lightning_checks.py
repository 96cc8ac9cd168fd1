"""CompressedDDPStrategy under a real Lightning Trainer on 2 CPU processes; run by tests/test_strategies.py.

    python tests/_dist_scripts/lightning_checks.py OUT_DIR

Ranks are forked by Lightning's multiprocessing launcher (start_method="fork"), never re-launched scripts.
  fit1: int8, buckets capped at 10 kB (≥ 2 buckets), checkpoint at step 3, stop at step 5.
  fit2: resume from the step-3 checkpoint, stop at step 6.
  guard: int8 with CompressionGuard and a scripted val/OA that drops twice: int8 → bf16 → none; 11 steps.
Each rank writes what it saw under OUT_DIR (residuals as .pt, the rest as JSON); the test compares.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hslite.parallel.compression.guard import CompressionGuard
from hslite.parallel.deadlines import Deadlines
from hslite.strategies import CompressedDDPStrategy  # the public place a user imports it from

SCRIPTED_OA = [0.80, 0.85, 0.83, 0.845, 0.80]  # drops of 2.0 and 4.5 points against the best, tolerance 1.0


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.validations = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            oa = SCRIPTED_OA[min(self.validations, len(SCRIPTED_OA) - 1)]
            self.log("val/OA", oa, sync_dist=True)
            self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=gen), torch.randint(0, 4, (256,), generator=gen))
    return DataLoader(data, batch_size=8)


class Recorder(Callback):
    """Dump the compression state at train start, at each checkpoint save, after each validation and at train end."""

    def __init__(self, out: Path, fit: str) -> None:
        self.out, self.fit, self.kinds = out, fit, []

    def _dump(self, trainer: pl.Trainer, event: str) -> None:
        state = trainer.strategy.compression_state
        name = f"{self.fit}_rank{trainer.global_rank}_{event}_step{trainer.global_step}"
        torch.save(state.state_dict()["residuals"], self.out / f"{name}.pt")

    def on_train_start(self, trainer, pl_module):
        self._dump(trainer, "start")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._dump(trainer, "save")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.kinds.append(trainer.strategy.compression)

    def on_train_end(self, trainer, pl_module):
        state = trainer.strategy.compression_state
        guard = next((c for c in trainer.callbacks if isinstance(c, CompressionGuard)), None)
        record = {
            "global_step": trainer.global_step,
            "calls": state.calls,
            "step": state.step,
            "bytes_sent": state.bytes_sent,
            "kind": state.kind,
            "kinds_after_validation": self.kinds,
            "switches": guard.switches if guard else [],
            "buckets": len(state._buckets),
            "loose_residuals": len(state._loose),
        }
        (self.out / f"{self.fit}_rank{trainer.global_rank}_end.json").write_text(json.dumps(record))


def trainer(out: Path, fit: str, max_steps: int, callbacks: list, **kwargs) -> pl.Trainer:
    strategy = CompressedDDPStrategy(
        "int8", bucket_cap_mb=0.01, start_method="fork", deadlines=Deadlines(collective=60)
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[*callbacks, Recorder(out, fit)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out / fit,
        **kwargs,
    )


def main(out: Path) -> None:
    ckpt_dir = out / "ckpt"
    save_at_3 = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer(out, "fit1", 5, [save_at_3], limit_val_batches=0, logger=False).fit(Tiny(), loader())
    trainer(out, "fit2", 6, [], limit_val_batches=0, logger=False, enable_checkpointing=False).fit(
        Tiny(), loader(), ckpt_path=ckpt_dir / "step=3.ckpt"
    )
    guard = CompressionGuard("val/OA", tolerance_points=1.0)
    trainer(
        out,
        "guard",
        11,
        [guard],
        val_check_interval=2,
        limit_val_batches=1,
        enable_checkpointing=False,
        logger=CSVLogger(out, name="guard_log"),
    ).fit(Tiny(), loader(), loader())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
