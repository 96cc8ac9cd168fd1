"""Run one recipe end to end as a library call: plan -> data -> model -> pre-flight gate -> Trainer -> run folder.

    from hslite.recipe.config import load_config
    from hslite.run.fit import fit
    result = fit(load_config("salinas_a_1gpu", ["data.root=../shared/data"]))
    print(result.run_dir, result.metrics["OA"])

The CLI and `compare` both call `fit`; nothing here parses command lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from hslite.allocator import keep_freed_memory
from hslite.atomic import atomic_write
from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.fitted import FittedPreprocessing
from hslite.datasets.geotiff_out import write_geotiff
from hslite.datasets.scenes import to_label_codes
from hslite.datasets.splits import Split
from hslite.errors import DataError
from hslite.parallel.compression_guard import kind_at_level
from hslite.parallel.plan import Plan, check_visible, trainer_kwargs
from hslite.parallel.rank_setup import quiet_lightning
from hslite.parallel.rank_watch import RankActivity, rank_failure
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.usage import RankUsage, usage_metrics
from hslite.preflight.verdict import Verdict
from hslite.recipe.build import build_task, plan_from_config, prepared_datamodule
from hslite.recipe.config import to_yaml
from hslite.recipe.schema import Config
from hslite.run.checkpoints import AtomicCheckpointIO, BestCheckpoint, LastCheckpoint, load_weights, read_checkpoint
from hslite.run.folder import RunFolder, check_writable
from hslite.run.outputs import plot_confusion, plot_map, print_summary, write_json
from hslite.run.resume import LAST, check_checkpoint_config, flat_config
from hslite.run.training_state import TrainingState
from hslite.task import HSIClassifier


@dataclass
class RunResult:
    """What a finished run left behind."""

    run_dir: Path
    metrics: dict[str, Any]
    plan: Plan


def _gate(cfg: Config, plan: Plan, datamodule: HSIDataModule) -> Verdict | None:
    """Run the pre-flight check; refuse a NO-GO plan (exit 3) unless preflight.enforce=false."""
    if not cfg.preflight.enabled:
        return None
    from hslite.preflight.report import print_verdict
    from hslite.recipe.gate import PreflightRefused, preflight_check

    verdict = preflight_check(cfg, plan, datamodule, single_device_only=plan.world_size == 1)
    if not verdict.go:
        print_verdict(verdict)
        if cfg.preflight.enforce:
            raise PreflightRefused(
                f"pre-flight NO-GO for {plan.describe()}: {'; '.join(verdict.reasons[:2])}. "
                "Set preflight.enforce=false to run it anyway."
            )
    return verdict


def _predicted_vs_measured(verdict: Verdict, plan: Plan, metrics: dict[str, Any]) -> dict[str, Any]:
    """The verdict, with the measured step time beside the predicted one when the plan that ran is the one priced."""
    report = verdict.to_dict()
    report["plan_that_ran"] = metrics["plan_that_ran"]
    if metrics["plan_that_ran"] != plan.describe():
        report["measured"] = None  # a guard changed the plan mid-run: no like-for-like pair to compare
        return report
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


def fit(cfg: Config) -> RunResult:
    """Train, test and report one recipe; returns the run folder and its metrics.

    Everything that can fail on bad input (config, plan, data, model) fails before the pre-flight probes and before
    the run folder exists. The folder is `<stamp>.incomplete` while the run lasts, `<stamp>` once complete, and
    `<stamp>.failed` (with error.txt, logs and checkpoints) when anything, Ctrl-C or SIGTERM included, stops it.
    With parallel.plan=auto the plan is chosen first (`auto_plan.choose_plan`) and the chosen config is what runs.
    """
    choice = None
    if cfg.parallel.plan == "auto":
        from hslite.recipe.auto_plan import choose_plan

        choice = choose_plan(cfg)
        print(choice.paragraph)
        cfg = choice.cfg
    plan = check_visible(plan_from_config(cfg))
    quiet_lightning()
    keep_freed_memory()
    pl.seed_everything(cfg.train.seed, workers=True, verbose=False)
    datamodule = prepared_datamodule(cfg)
    task = build_task(cfg, plan, datamodule)  # refuses band groups the plan cannot split or rotate
    resume, last = _resume_point(cfg, datamodule)
    parent = Path(cfg.output.root) / cfg.recipe
    check_writable(resume.parent if resume else parent, _checkpoint_bytes(task) if cfg.output.save_checkpoint else 0)
    verdict = choice.verdict if choice is not None else _gate(cfg, plan, datamodule)

    with RunFolder(parent, resume=resume) as run:
        if resume is None:
            atomic_write(run.path / "config.yaml", lambda f: f.write(to_yaml(cfg).encode()))
            if choice is not None:
                write_json(run.path / "plan_choice.json", choice.to_dict())
            datamodule.split.save(run.path / "split.npz")
            FittedPreprocessing.from_datamodule(datamodule).save(run.path / "preprocessing.npz")  # for hslite predict
        metrics = _train_and_evaluate(cfg, plan, datamodule, task, run, last)
        metrics["resumed"] = run.resumptions
        if verdict is not None:
            write_json(run.path / "preflight.json", _predicted_vs_measured(verdict, plan, metrics))
        write_json(run.path / "metrics.json", metrics)
    print_summary(metrics, run.path, datamodule.class_names)
    return RunResult(run_dir=run.path, metrics=metrics, plan=plan)


def _resume_point(cfg: Config, datamodule: HSIDataModule) -> tuple[Path | None, bytes | None]:
    """The run folder that cfg.resume names and its last.ckpt's bytes, once both checkpoint and split are this run's.

    The checkpoint is read here, once: Lightning restores from these bytes, not from the file (`AtomicCheckpointIO`).
    """
    if not cfg.resume:
        return None, None
    run = Path(cfg.resume)
    path = run / "checkpoints" / LAST
    last = path.read_bytes() if path.is_file() else None  # None: read_checkpoint says the file is missing
    check_checkpoint_config(read_checkpoint(path, last), cfg, path)
    if not datamodule.split.same_pixels(Split.load(run / "split.npz")):
        raise DataError(
            f"{run}/split.npz differs from the split drawn now for the same seed (a changed label file or hslite "
            "version); the run cannot be continued on other pixels. Start a new run."
        )
    return run, last


def _checkpoint_bytes(task: HSIClassifier) -> int:
    """About what best.ckpt and last.ckpt take: weights + AdamW's two moments, each, plus a temporary copy."""
    weights = sum(p.numel() * p.element_size() for p in task.parameters())
    return 3 * 3 * weights


def _train_and_evaluate(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier, run: RunFolder, last: bytes | None
) -> dict[str, Any]:
    from lightning.pytorch.loggers import CSVLogger

    work_dir, last_path = run.path, run.path / "checkpoints" / LAST
    resume_from = None if last is None else last_path  # Lightning restores from `last`, the bytes read already
    callbacks: list[pl.Callback] = [TrainThroughput(), RankUsage(), TrainingState(flat_config(cfg))]
    if plan.world_size > 1:
        callbacks.append(RankActivity(work_dir / "ranks"))
    checkpoint = None
    if cfg.output.save_checkpoint:
        checkpoint = BestCheckpoint(work_dir / "checkpoints")
        callbacks += [checkpoint, LastCheckpoint(last_path, cfg.output.checkpoint_every_n_epochs)]
    kwargs = trainer_kwargs(plan, progress=cfg.train.progress, deterministic=cfg.train.deterministic)
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
        # Lightning's CSV logger empties a metrics.csv it finds: a resumed part writes its own, logs/resumed-<n>/.
        logger=CSVLogger(work_dir, name="logs", version=f"resumed-{len(run.resumptions)}" if run.resumptions else ""),
        default_root_dir=work_dir,
        enable_checkpointing=cfg.output.save_checkpoint,
        plugins=[AtomicCheckpointIO(None if last is None else {last_path: last})],
    )
    wall_start = time.perf_counter()
    try:
        trainer.fit(task, datamodule=datamodule, ckpt_path=resume_from, weights_only=True)  # whatever the strategy
    except Exception as err:
        failed = rank_failure(err, trainer, work_dir / "ranks")
        if failed is None:
            raise
        raise failed from None
    train_seconds = time.perf_counter() - wall_start

    perf = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")}
    best = Path(checkpoint.best_model_path).resolve() if checkpoint and checkpoint.best_model_path else None
    if best is not None:
        task.load_state_dict(load_weights(best))
    scored, predicted = _predictions(cfg, plan, datamodule, task)
    scene, test = datamodule.scene, datamodule.split.test
    targets = scene.gt[test[: len(scored), 0], test[: len(scored), 1]] - 1
    scores = task.score(torch.from_numpy(scored), torch.from_numpy(targets))
    metrics: dict[str, Any] = {
        "OA": scores["OA"],
        "AA": scores["AA"],
        "kappa": scores["kappa"],
        "per_class_accuracy": scores["per_class_accuracy"],
        "class_names": datamodule.class_names,
        "epochs": int(perf["perf/epochs"]),
        "optimizer_steps": int(perf["perf/optimizer_steps"]),
        "train_seconds": train_seconds,
        "train_batch_seconds": perf["perf/train_batch_seconds"],
        "median_batch_seconds": perf["perf/median_batch_seconds"],
        "train_samples": int(perf["perf/train_samples"]),
        "train_samples_per_second": perf["perf/train_samples"] / max(perf["perf/train_batch_seconds"], 1e-9),
        "plan": plan.to_dict(),
        "plan_that_ran": _plan_that_ran(plan, trainer),
        "usage": usage_metrics(trainer.callback_metrics, plan.accelerator),
        "split_counts": datamodule.split.counts(scene.gt),
        "split_protocol": datamodule.split.protocol,
        "leakage_audit": datamodule.leakage_audit(),
        "best_checkpoint": str(best.relative_to(work_dir.resolve())) if best else None,
    }
    confusion = scores["confusion_matrix"]
    metrics["confusion_matrix"] = confusion.tolist()
    plot_confusion(work_dir / "confusion.png", confusion, datamodule.class_names)
    if predicted is not None:
        classes = predicted.reshape(scene.gt.shape) + 1
        plot_map(work_dir / "map.png", classes, scene.gt, datamodule.class_names, scene.label_codes)
        codes = to_label_codes(classes, scene.label_codes)  # an own scene's map is in its label file's codes
        write_geotiff(work_dir / "prediction.tif", codes, scene.crs, scene.transform)
    return metrics


def _predictions(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier
) -> tuple[np.ndarray, np.ndarray | None]:
    """Predicted classes of the scored test pixels, and of the whole scene when a map is asked (None otherwise).

    train.limit_test_batches limits the test pass only, and a map is always of the whole scene: with a map asked and
    no limit, one pass over the scene serves both; otherwise the test pass and the map are two.
    """
    if cfg.output.save_map and cfg.train.limit_test_batches == 1.0:
        return _scored_from_the_map(plan, datamodule, task)
    return _tested_then_mapped(cfg, plan, datamodule, task)


def _scored_from_the_map(plan: Plan, datamodule: HSIDataModule, task: HSIClassifier) -> tuple[np.ndarray, np.ndarray]:
    """One pass: the whole scene is predicted, and its test pixels are scored from that map."""
    predicted = _predict(_evaluator(plan), task, datamodule.predict_dataloader())
    test = datamodule.split.test
    return predicted.reshape(datamodule.scene.gt.shape)[test[:, 0], test[:, 1]], predicted


def _tested_then_mapped(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, task: HSIClassifier
) -> tuple[np.ndarray, np.ndarray | None]:
    """Two passes: the test pixels (as many batches as train.limit_test_batches), then the scene when a map is asked."""
    tester = _evaluator(plan, limit_predict_batches=_limit(cfg.train.limit_test_batches))
    scored = _predict(tester, task, datamodule.test_dataloader())
    return scored, _predict(_evaluator(plan), task, datamodule.predict_dataloader()) if cfg.output.save_map else None


def _evaluator(plan: Plan, **limits: Any) -> pl.Trainer:
    """A one-device Trainer for inference, whatever the plan trained on."""
    return pl.Trainer(**trainer_kwargs(plan.single_device(), progress=False), logger=False, **limits)


def _plan_that_ran(plan: Plan, trainer: pl.Trainer) -> str:
    """The plan as it ended: the compression guard may have relaxed int8 to bf16 or none during the run."""
    bits = trainer.callback_metrics.get("compression/level")
    if not plan.compression_enabled or bits is None:
        return plan.describe()
    return plan.with_(compression=kind_at_level(plan.compression, int(bits))).describe()


def _predict(trainer: pl.Trainer, task: HSIClassifier, loader: DataLoader) -> np.ndarray:
    """Zero-based predicted class of every sample of `loader`, in its order."""
    batches = cast(list[torch.Tensor], trainer.predict(task, dataloaders=loader))
    return torch.cat(batches).numpy().astype(np.int64)


def _limit(value: float) -> float | int | None:
    """Lightning's limit_*_batches: None for 'all' (its default, so it does not announce it), a count above 1."""
    if value == 1.0:
        return None
    return int(value) if value > 1 else float(value)
