"""Your own Lightning script, gated by hslite's pre-flight: the verdict first, then the fit the gate lets through.

    python examples/own_script/train.py                 # 2 CPU processes, int8 all-reduce; ~1 min on 2 cores
    python examples/own_script/train.py --devices 1     # one process
    python examples/own_script/train.py --enforce       # a NO-GO plan raises hslite.PreflightRefused on every rank

A team's own LightningModule and DataModule (a spectral 1-D CNN on pixels of a synthetic scene here) train with
hslite's strategy; `hslite.preflight(module=...)` prices the plan on the module's own training_step and optimiser
and prints the verdict, and `hslite.PreflightGate` checks it again on the launched ranks before the first step.
"""

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hslite
from hslite.strategies import CompressedDDPStrategy

BANDS, CLASSES = 103, 9


class SpectralCNN(pl.LightningModule):
    """A 1-D CNN over each pixel's spectrum, with label smoothing and SGD: a step that is not hslite's."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv1d(1, 32, 7, padding=3), nn.BatchNorm1d(32), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(32, 64, 5, padding=2), nn.BatchNorm1d(64), nn.ReLU(), nn.AdaptiveAvgPool1d(8),
            nn.Flatten(), nn.Linear(64 * 8, 128), nn.ReLU(), nn.Linear(128, CLASSES),
        )  # fmt: skip

    def forward(self, spectra: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of spectra (pixels × bands)."""
        return self.net(spectra.unsqueeze(1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Label-smoothed cross-entropy: what the pre-flight times, not hslite's own loss."""
        loss = nn.functional.cross_entropy(self(batch["spectra"]), batch["label"], label_smoothing=0.1)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accuracy of the held-out pixels."""
        accuracy = (self(batch["spectra"]).argmax(1) == batch["label"]).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD with Nesterov momentum: no Adam state, which the pre-flight's memory figure shows."""
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, nesterov=True)


class Pixels(TensorDataset):
    """Batches as dicts, as many teams' loaders give them."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        spectra, label = super().__getitem__(index)
        return {"spectra": spectra, "label": label}


class SyntheticScene(pl.LightningDataModule):
    """Labelled pixels whose class shows in a smooth spectral signature under noise."""

    def __init__(self, pixels: int = 8192, batch_size: int = 64) -> None:
        super().__init__()
        self.pixels, self.batch_size = pixels, batch_size

    def setup(self, stage: str) -> None:
        """Draw the scene: three Gaussian bumps per class signature, noise of 0.3."""
        generator = torch.Generator().manual_seed(0)
        wavelengths = torch.linspace(0, 1, BANDS)
        centres = torch.rand(CLASSES, 3, generator=generator)
        signatures = sum(torch.exp(-((wavelengths - centres[:, k : k + 1]) ** 2) / 0.02) for k in range(3))
        labels = torch.randint(0, CLASSES, (self.pixels,), generator=generator)
        spectra = signatures[labels] + 0.3 * torch.randn(self.pixels, BANDS, generator=generator)
        cut = self.pixels * 3 // 4
        self.train_set, self.val_set = Pixels(spectra[:cut], labels[:cut]), Pixels(spectra[cut:], labels[cut:])

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of `batch_size` pixels per device."""
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """The held-out quarter."""
        return DataLoader(self.val_set, batch_size=256)


class StepTimer(pl.Callback):
    """Median wall time of a training step on rank 0, to set beside the pre-flight's prediction."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        """Start the clock."""
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        """Stop it."""
        self.seconds.append(time.perf_counter() - self.start)


def main() -> None:
    """Ask the pre-flight, then fit with the gate, and set the measured step beside the predicted one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--enforce", action="store_true", help="refuse a NO-GO plan instead of training it anyway")
    parser.add_argument("--min-efficiency", type=float, default=0.5, help="the E a multi-device plan must reach")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)

    # Lightning starts ranks 1..N-1 by running this script again (rank_zero_only.rank says which one this is): the
    # verdict is asked for once, by the process the user started.
    if rank_zero_only.rank == 0:
        verdict = hslite.preflight(
            module=SpectralCNN(),
            datamodule=SyntheticScene(),
            plan={"devices": args.devices},
            min_efficiency=args.min_efficiency,
        )
        predicted = verdict.predictions[verdict.requested].step_seconds
        print(f"pre-flight: {verdict.decision} for {verdict.requested.describe()}, predicted step "
              f"{predicted * 1e3:.2f} ms")  # fmt: skip
        print("  " + "\n  ".join(verdict.reasons))

    gate, timer = hslite.PreflightGate(args.min_efficiency, enforce=args.enforce), StepTimer()
    strategy = CompressedDDPStrategy("int8") if args.devices > 1 else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         callbacks=[gate, timer], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(SpectralCNN(), datamodule=SyntheticScene())
    if trainer.is_global_zero:
        measured = statistics.median(timer.seconds[len(timer.seconds) // 10 :])
        print(f"gate on the launched ranks: {gate.verdict.decision}, E = {gate.verdict.efficiency:.2f}")
        print(f"measured step {measured * 1e3:.2f} ms (median, rank 0) against predicted {predicted * 1e3:.2f} ms")
        print(f"validation accuracy {float(trainer.callback_metrics['val_acc']):.2%}")


if __name__ == "__main__":
    main()
