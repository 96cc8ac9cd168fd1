"""Run one recipe end to end as a library call: scene -> model -> pre-flight gate -> Trainer from the Plan -> reports.

    from hslite.config import load_config
    from hslite.fit import fit
    result = fit(load_config("salinas_a_1gpu", ["data.root=../shared/data"]))
    print(result.run_dir, result.metrics["OA"])

The CLI and `compare` both call `fit`; nothing here parses command lines.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch

from hslite.config import Config, to_yaml
from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.io import write_geotiff
from hslite.models import get_model
from hslite.parallel.plan import Plan, plan_from_config, trainer_kwargs
from hslite.parallel.rank_setup import quiet_lightning
from hslite.preflight.verdict import Verdict
from hslite.report import plot_confusion, plot_map, print_summary, write_json
from hslite.task import HSIClassifier


@dataclass
class RunResult:
    """What a finished run left behind."""

    run_dir: Path
    metrics: dict[str, Any]
    plan: Plan


class TrainThroughput(pl.Callback):
    """Time per training batch, logged so it survives spawned ranks (their callbacks die with them).

    A batch's time runs from its start to the next batch's start: forward, backward, optimiser, all-reduce, the
    loop's hooks and fetching the next batch, but not validation or start-up. The median is what the pre-flight
    prediction is compared with.
    """

    def __init__(self) -> None:
        self.batch_seconds: list[float] = []
        self.samples = 0
        self._start: float | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        self._start = None  # the gap across validation is not a batch

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:  # noqa: D102
        now = time.perf_counter()
        if self._start is not None:
            self.batch_seconds.append(now - self._start)
        self._start = now

    def on_train_batch_end(  # noqa: D102
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += len(batch[1]) * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:  # noqa: D102
        if self._start is not None:  # the epoch's last batch: to its end, there is no next start
            self.batch_seconds.append(time.perf_counter() - self._start)
        # Skip the first batch of the run (lazy initialisation, DDP's first single bucket) in the median.
        steady = self.batch_seconds[1:] or self.batch_seconds
        module.log_dict(
            {
                "perf/median_batch_seconds": float(np.median(steady)),
                "perf/train_batch_seconds": float(sum(self.batch_seconds)),
                "perf/train_samples": float(self.samples),
                "perf/epochs": float(trainer.current_epoch + 1),
                "perf/optimizer_steps": float(trainer.global_step),
            },
            sync_dist=True,
            reduce_fx="max",  # the slowest rank sets the pace of a synchronous step
        )


def build_datamodule(cfg: Config) -> HSIDataModule:
    """The datamodule a recipe describes (plain arguments, no Config inside)."""
    d = cfg.data
    return HSIDataModule(
        scene=d.scene,
        root=d.root,
        download=d.download,
        remove_bands=list(d.remove_bands),
        remove_ranges_nm=[tuple(r) for r in d.remove_ranges_nm],
        drop_water_bands=d.drop_water_bands,
        normalisation=d.normalisation,
        pca_components=d.pca_components,
        patch_size=d.patch_size,
        split=d.split,
        train_fraction=d.train_fraction,
        val_fraction=d.val_fraction,
        train_per_class=d.train_per_class,
        val_per_class=d.val_per_class,
        block_size=d.block_size,
        split_file=d.split_file,
        batch_size=d.batch_size,
        eval_batch_size=d.eval_batch_size,
        augment=d.augment,
        num_workers=d.num_workers,
        seed=cfg.train.seed,
    )


def build_task(cfg: Config, datamodule: HSIDataModule) -> HSIClassifier:
    """Model from the registry wrapped in the classification task."""
    model = get_model(
        cfg.model.name,
        in_bands=datamodule.num_bands,
        num_classes=datamodule.num_classes,
        patch_size=cfg.data.patch_size,
        size=cfg.model.size,
    )
    weights = None
    if cfg.train.class_weights:
        train = datamodule.split.train
        labels = datamodule.scene.gt[train[:, 0], train[:, 1]] - 1
        counts = np.bincount(labels, minlength=datamodule.num_classes).astype(np.float64)
        weights = torch.tensor(counts.sum() / np.maximum(counts, 1) / datamodule.num_classes, dtype=torch.float32)
    return HSIClassifier(
        model,
        num_classes=datamodule.num_classes,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        warmup_epochs=cfg.train.warmup_epochs,
        class_weights=weights,
    )


def _gate(cfg: Config, plan: Plan) -> Verdict | None:
    """Run the pre-flight check; refuse a NO-GO plan (exit 3) unless preflight.enforce=false."""
    if not cfg.preflight.enabled:
        return None
    from hslite.preflight.check import PreflightRefused, preflight_check
    from hslite.preflight.report import print_verdict

    verdict = preflight_check(cfg, single_device_only=plan.world_size == 1)
    if not verdict.go:
        print_verdict(verdict)
        if cfg.preflight.enforce:
            raise PreflightRefused(
                f"pre-flight NO-GO for {plan.describe()}: {'; '.join(verdict.reasons[:2])}. "
                "Set preflight.enforce=false to run it anyway."
            )
    return verdict


def _predicted_vs_measured(verdict: Verdict, plan: Plan, metrics: dict[str, Any]) -> dict[str, Any]:
    """The verdict, with the measured step time beside the predicted one (the base for calibration)."""
    report = verdict.to_dict()
    predicted = report["requested_prediction"]["step_seconds"]
    measured = metrics["median_batch_seconds"] * plan.accumulate  # one optimiser step = G micro-batches
    report["measured"] = {
        "step_seconds": measured,
        "predicted_step_seconds": predicted,
        "relative_error": (predicted - measured) / measured if measured > 0 else None,
        "samples_per_second": metrics["train_samples_per_second"],
    }
    metrics["predicted_step_seconds"] = predicted
    metrics["measured_step_seconds"] = measured
    return report


def _new_run_dir(cfg: Config) -> tuple[Path, Path]:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    final = Path(cfg.output.root) / cfg.recipe / stamp
    work = final.with_name(stamp + ".incomplete")
    work.mkdir(parents=True)
    return work, final


def _load_best(task: HSIClassifier, checkpoint: Path | None) -> None:
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
        task.load_state_dict(state)


def fit(cfg: Config) -> RunResult:
    """Train, test and report one recipe; returns the run folder and its metrics.

    Everything that can fail on bad input (config, plan, data, model) fails before the run folder exists; the folder
    is written as `<stamp>.incomplete` and renamed only when the run finished, so a crash never leaves a run that looks
    done.
    """
    plan = plan_from_config(cfg)
    quiet_lightning()
    verdict = _gate(cfg, plan)
    pl.seed_everything(cfg.train.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg)
    datamodule.prepare_data()
    datamodule.setup("fit")
    task = build_task(cfg, datamodule)

    work_dir, run_dir = _new_run_dir(cfg)
    try:
        (work_dir / "config.yaml").write_text(to_yaml(cfg))
        datamodule.split.save(work_dir / "split.npz")
        metrics = _train_and_evaluate(cfg, plan, datamodule, task, work_dir)
        if verdict is not None:
            write_json(work_dir / "preflight.json", _predicted_vs_measured(verdict, plan, metrics))
        write_json(work_dir / "metrics.json", metrics)
        os.replace(work_dir, run_dir)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    print_summary(metrics, run_dir, datamodule.class_names)
    return RunResult(run_dir=run_dir, metrics=metrics, plan=plan)


def _train_and_evaluate(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier, work_dir: Path
) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    callbacks: list[pl.Callback] = [TrainThroughput()]
    checkpoint = None
    if cfg.output.save_checkpoint:
        checkpoint = ModelCheckpoint(
            dirpath=work_dir / "checkpoints", filename="best", monitor="val/OA", mode="max", save_top_k=1
        )
        callbacks.append(checkpoint)
    kwargs = trainer_kwargs(plan, progress=cfg.train.progress)
    callbacks += kwargs.pop("callbacks", [])
    steps_per_epoch = max(1, len(datamodule.train_dataloader()) // plan.dp)
    if cfg.train.limit_train_batches > 1:
        steps_per_epoch = min(steps_per_epoch, int(cfg.train.limit_train_batches))
    trainer = pl.Trainer(
        **kwargs,
        max_epochs=cfg.train.max_epochs,
        max_steps=cfg.train.max_steps,
        limit_train_batches=_limit(cfg.train.limit_train_batches),
        limit_val_batches=_limit(cfg.train.limit_val_batches),
        check_val_every_n_epoch=cfg.train.check_val_every_n_epoch,
        log_every_n_steps=min(50, steps_per_epoch),
        callbacks=callbacks,
        logger=CSVLogger(work_dir, name="logs", version=""),
        default_root_dir=work_dir,
        enable_checkpointing=cfg.output.save_checkpoint,
    )
    wall_start = time.perf_counter()
    trainer.fit(task, datamodule=datamodule)
    train_seconds = time.perf_counter() - wall_start

    perf = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")}
    best = Path(checkpoint.best_model_path) if checkpoint and checkpoint.best_model_path else None
    _load_best(task, best)
    evaluator = pl.Trainer(
        **trainer_kwargs(plan.with_(devices=1, num_nodes=1, compression="none"), progress=False),
        logger=False,
        limit_test_batches=_limit(cfg.train.limit_test_batches),
    )
    test = evaluator.test(task, datamodule=datamodule, verbose=False)[0]
    metrics: dict[str, Any] = {
        "OA": test["test/OA"],
        "AA": test["test/AA"],
        "kappa": test["test/kappa"],
        "per_class_accuracy": task.per_class_accuracy.tolist(),
        "class_names": datamodule.class_names,
        "epochs": int(perf["perf/epochs"]),
        "optimizer_steps": int(perf["perf/optimizer_steps"]),
        "train_seconds": train_seconds,
        "train_batch_seconds": perf["perf/train_batch_seconds"],
        "median_batch_seconds": perf["perf/median_batch_seconds"],
        "train_samples": int(perf["perf/train_samples"]),
        "train_samples_per_second": perf["perf/train_samples"] / max(perf["perf/train_batch_seconds"], 1e-9),
        "plan": plan.to_dict(),
        "split_counts": datamodule.split.counts(datamodule.scene.gt),
        "best_checkpoint": str(best.relative_to(work_dir)) if best else None,
    }
    confusion = task.confusion_matrix.numpy()
    metrics["confusion_matrix"] = confusion.tolist()
    plot_confusion(work_dir / "confusion.png", confusion, datamodule.class_names)
    if cfg.output.save_map:
        predicted = _predict_scene(evaluator, task, datamodule)
        plot_map(work_dir / "map.png", predicted, datamodule.scene.gt, datamodule.class_names)
        write_geotiff(work_dir / "prediction.tif", predicted, datamodule.scene.crs, datamodule.scene.transform)
    return metrics


def _predict_scene(trainer: pl.Trainer, task: HSIClassifier, datamodule: HSIDataModule) -> np.ndarray:
    """Class (1..C) of every pixel of the scene, predicted in batches."""
    batches = cast(list[torch.Tensor], trainer.predict(task, dataloaders=datamodule.predict_dataloader()))
    flat = torch.cat(batches).numpy().astype(np.int64) + 1
    return flat.reshape(datamodule.scene.gt.shape)


def _limit(value: float) -> float | int | None:
    """Lightning's limit_*_batches: None for 'all' (its default, so it does not announce it), a count above 1."""
    if value == 1.0:
        return None
    return int(value) if value > 1 else float(value)
