"""HSIClassifier: the LightningModule that trains any registered model on patches.

Loss, optimiser and metrics live here; the model and the data know nothing of them. Labels are zero-based class
indices; -1 marks an unlabelled pixel and is ignored by the loss and the metrics.

A training step never makes the host wait for the GPU, except on the steps where Lightning writes the loggers
(`Trainer(log_every_n_steps)`): a wait empties the GPU's queue of kernels, which for the small HSI models (launch-bound
on a GPU) costs about as much as the step. tests/test_host_syncs.py counts the waits.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCohenKappa, MulticlassConfusionMatrix

from hslite.models.band_groups import BandRotation, GroupedForward
from hslite.optim import adamw, warmup_cosine

IGNORE_INDEX = -1


class TrainingScores(Metric):
    """OA, AA and kappa of the batches seen, from a (true class × predicted class) count updated without a host sync.

    torchmetrics' classification metrics wait for the GPU in every update, `validate_args=False` or not: ignore_index
    drops the ignored targets with a boolean index (its size is known only on the device) and the counts go through
    `torch.bincount`, whose CUDA kernel reads the largest value back first. Here an ignored target is counted with
    weight 0 instead of dropped, and the counts are an equality test of each sample's cell against every cell (n × C²
    booleans: no atomics, so deterministic, and no read-back). The scores are torchmetrics' definitions
    (MulticlassAccuracy micro and macro, MulticlassCohenKappa), taken from the summed counts in `compute`, where the
    ranks' counts are summed too; tests/test_task_metrics.py checks them against torchmetrics.
    """

    full_state_update = False

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.counts: torch.Tensor
        self.add_state("counts", torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        logits: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        *,
        counts: torch.Tensor | None = None,
    ) -> None:
        """Count a batch of logits (n, C) against its targets (n,), ignore_index ones left out; or add `counts`.

        `counts`: (C, C) counts summed from `batch_counts` beforehand. The task sums an epoch's on the device and
        updates once: torchmetrics' update wrapper costs more per call than the counting itself.
        """
        if counts is None:
            assert logits is not None and target is not None, "update(logits, target) or update(counts=...)"
            counts = self.batch_counts(logits, target, self.num_classes, self.ignore_index)
        self.counts += counts

    @staticmethod
    def batch_counts(
        logits: torch.Tensor, target: torch.Tensor, c: int, ignore_index: int = IGNORE_INDEX
    ) -> torch.Tensor:
        """The (true class × predicted class) counts of one batch, made without waiting for the device."""
        cells = target.clamp(min=0) * c + logits.argmax(dim=1)
        counted = (cells[:, None] == torch.arange(c * c, device=cells.device)) & (target != ignore_index)[:, None]
        return counted.sum(dim=0).view(c, c)

    def compute(self) -> dict[str, torch.Tensor]:
        """OA (micro accuracy), AA (macro: mean recall over the classes true or predicted at least once) and kappa."""
        counts = self.counts.float()
        total, hits = counts.sum(), counts.diagonal()
        true, predicted = counts.sum(dim=1), counts.sum(dim=0)
        seen = (true + predicted > 0).float()  # torchmetrics' macro average leaves out classes with no tp, fp or fn
        recall = hits / true.clamp(min=1)
        expected_hits = (true * predicted).sum() / total  # the trace of the chance-agreement matrix
        return {
            "OA": hits.sum() / total.clamp(min=1),
            "AA": (recall * seen).sum() / seen.sum().clamp(min=1),
            "kappa": 1 - (total - hits.sum()) / (total - expected_hits),
        }


class HSIClassifier(pl.LightningModule):
    """Cross-entropy classification of pixels from their patches, with OA / AA / kappa / per-class metrics."""

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        warmup_epochs: int = 2,
        class_weights: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.num_classes = num_classes
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_epochs = warmup_epochs
        self.channel_groups: GroupedForward | None = None  # set on each rank by a channel-group strategy
        self.rotation: BandRotation | None = None  # channel-subset rotation of the training steps
        self.save_hyperparameters(ignore=["model", "class_weights"])
        self.configure_losses(class_weights)
        self.configure_metrics()

    def configure_losses(self, class_weights: torch.Tensor | None) -> None:
        """Cross-entropy that skips unlabelled pixels; optional per-class weights."""
        self.loss = nn.CrossEntropyLoss(weight=class_weights, ignore_index=IGNORE_INDEX)

    def configure_metrics(self) -> None:
        """Validation and test: torchmetrics' collection, cloned per split with its prefix; training: TrainingScores."""
        c = self.num_classes

        def collection(prefix: str, sync_on_compute: bool = True) -> MetricCollection:
            common: dict = {"ignore_index": IGNORE_INDEX, "sync_on_compute": sync_on_compute}
            return MetricCollection(
                {
                    "OA": MulticlassAccuracy(c, average="micro", **common),
                    "AA": MulticlassAccuracy(c, average="macro", **common),
                    "kappa": MulticlassCohenKappa(c, **common),
                },
                prefix=prefix,
            )

        self.train_metrics = TrainingScores(c)
        self._train_counts: torch.Tensor | None = None  # the epoch's counts so far, for train_metrics at its end
        self._loss_sum: torch.Tensor | None = None  # train/loss since the last logging step (training_step)
        self._loss_steps = 0
        self.val_metrics = collection("val/")
        self.test_step_metrics = collection("test/")  # `trainer.test`: every rank tests its share, synced as val/
        # `score` sees the whole test set in one process; in a launched job that is rank 0 alone while the others
        # wait, so a sync on compute would wait for ranks that never call it.
        self.test_metrics = collection("test/", sync_on_compute=False)
        self.test_per_class = MulticlassAccuracy(c, average="none", ignore_index=IGNORE_INDEX, sync_on_compute=False)
        self.test_confusion = MulticlassConfusionMatrix(c, ignore_index=IGNORE_INDEX, sync_on_compute=False)

    def configure_model(self) -> None:
        """Shard the model when the strategy is FSDP (`parallel.fsdp`); every other strategy keeps it whole.

        Lightning calls this on each rank after the process group exists and before the optimiser is made, so AdamW
        holds only this rank's shards.
        """
        shard = getattr(self.trainer.strategy, "shard", None) if self._trainer is not None else None
        if shard is not None:  # parallel.fsdp.ShardedStrategy; looked up by name: the task does not import parallel/
            shard(self.model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of patches (n, B, p, p); under channel groups for this rank's samples (own_targets).

        A model trained under rotation is evaluated as the ensemble of the band-group subsets it trained on.
        """
        if self.rotation is not None and not self.training:
            return self.rotation.evaluate(self.model, x, self.channel_groups)
        if self.channel_groups is not None:
            return self.channel_groups(self.model, x)
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One optimisation step's loss.

        train/loss is the mean loss of the steps since the last logging step, summed on the device and logged on
        logging steps (every `log_every_n_steps`) and at each epoch's last batch only: each `self.log` call runs
        Lightning's result-collection bookkeeping, a large share of what it adds to a small model's step
        (benchmarks/framework_tax.py sets hslite's step beside a bare Lightning loop's), and the loggers read only the
        logging steps' values anyway. It is not on
        the progress bar, which shows the validation scores: Lightning reads a bar value to the host every batch.
        """
        x, y = batch
        logits = self.training_logits(x)
        loss = self.batch_loss(logits, y)
        own = self.own_targets(y)
        if len(own):  # a chag rank's slice of a batch may be empty
            counts = TrainingScores.batch_counts(logits.detach(), own, self.num_classes)
            self._train_counts = counts if self._train_counts is None else self._train_counts + counts
        self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
        self._loss_steps += 1
        trainer = self.trainer  # Lightning's own rule for when it writes the loggers; and each epoch's last batch
        if trainer._logger_connector.should_update_logs or trainer.is_last_batch:
            self.log("train/loss", self._loss_sum / self._loss_steps, batch_size=len(y))
            self._loss_sum, self._loss_steps = None, 0
        return loss

    @staticmethod
    def update_metrics(metrics: list[Metric | MetricCollection], logits: torch.Tensor, y: torch.Tensor) -> None:
        """Update each of `metrics`, unless this rank has no samples (a chag rank's slice of a batch under chag)."""
        if len(y):  # torchmetrics cannot reshape an empty batch
            for metric in metrics:
                metric.update(logits, y)

    def own_targets(self, y: torch.Tensor) -> torch.Tensor:
        """The targets of the logits this rank computes: all of y, or its samples under channel groups."""
        return y if self.channel_groups is None else self.channel_groups.own_samples(y)

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of batch y as DDP should average it; under channel groups this rank's share (loss_share)."""
        if self.channel_groups is None:
            return self.loss(logits, y)
        return self.channel_groups.loss_share(self.loss, logits, y)

    def training_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits as a training step computes them: under rotation, with this optimiser step's band groups only."""
        if self.rotation is None:
            return self(x)
        active = self.rotation.active_groups(self.global_step)
        if self.channel_groups is not None:
            return self.channel_groups(self.model, x, active)
        return self.rotation.forward(self.model, x, active)

    def on_train_epoch_end(self) -> None:
        """Log the epoch's training metrics."""
        if self._train_counts is not None:
            self.train_metrics.update(counts=self._train_counts)
            self._train_counts = None
        scores = self.train_metrics.compute()  # torchmetrics has summed the ranks' counts
        self.log_dict({f"train/{name}": value for name, value in scores.items()})
        self.train_metrics.reset()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate validation loss and metrics."""
        self.evaluation_step(batch, "val/loss", self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        """Log validation OA/AA/kappa (the checkpoint monitors val/OA)."""
        self.log_scores(self.val_metrics, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate test loss and metrics, for `trainer.test(task, datamodule=dm)` in a Lightning script.

        `hslite fit` tests through `score` instead. AA here is torchmetrics' macro average, as val/AA is; `score`'s
        leaves out a class with no test pixel.
        """
        self.evaluation_step(batch, "test/loss", self.test_step_metrics)

    def on_test_epoch_end(self) -> None:
        """Log test OA/AA/kappa: what `trainer.test` returns."""
        self.log_scores(self.test_step_metrics)

    def evaluation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], loss_name: str, metrics: MetricCollection
    ) -> None:
        """A validation or test batch: its loss logged (averaged over the ranks) and `metrics` updated."""
        x, y = batch
        logits = self(x)
        self.log(loss_name, self.batch_loss(logits, y), sync_dist=True, batch_size=len(y))
        self.update_metrics([metrics], logits, self.own_targets(y))

    def log_scores(self, metrics: MetricCollection, prog_bar: bool = False) -> None:
        """Log the scores `metrics` accumulated over the epoch (torchmetrics syncs the ranks' states), then reset it."""
        self.log_dict(metrics.compute(), prog_bar=prog_bar)
        metrics.reset()

    def score(self, predicted: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        """Test OA, AA, kappa, per-class accuracy and confusion matrix of predicted classes against targets.

        A class with no test pixel (a spatially disjoint split can leave one out) has no accuracy: None, not 0, and
        AA is the mean over the classes present (torchmetrics' macro average counts a predicted, absent class as 0).
        """
        for metric in (self.test_metrics, self.test_per_class, self.test_confusion):
            metric.reset()
            metric.update(predicted, targets)
        scores: dict[str, Any] = {
            name.removeprefix("test/"): float(value) for name, value in self.test_metrics.compute().items()
        }
        confusion = self.test_confusion.compute().cpu().numpy()
        per_class = self.test_per_class.compute().cpu().tolist()
        present = [acc if n else None for acc, n in zip(per_class, confusion.sum(1), strict=True)]
        scores["per_class_accuracy"] = present
        scores["AA"] = float(np.mean([acc for acc in present if acc is not None]))
        scores["confusion_matrix"] = confusion
        return scores

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Predicted zero-based class of every pixel in the batch."""
        x, _ = batch
        return self(x).argmax(dim=1)

    def configure_optimizers(self):  # noqa: D102 - Lightning hook
        optimizer = adamw(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        epochs = max(1, self.trainer.max_epochs or 1)
        warmup_steps = min(total_steps // 2, self.warmup_epochs * math.ceil(total_steps / epochs))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, max(1, warmup_steps), total_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
