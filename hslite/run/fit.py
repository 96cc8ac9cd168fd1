"""Run one recipe end to end as a library call: plan -> data -> model -> pre-flight gate -> Trainer -> run folder.

    from hslite.recipe.config import load_config
    from hslite.run.fit import fit
    result = fit(load_config("salinas_a_1gpu", ["data.root=../shared/data"]))
    print(result.run_dir, result.metrics["OA"])

The CLI, `compare` and `hslite.fit` (hslite/api.py) call `fit`; nothing here parses command lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from hslite.atomic import atomic_write
from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.fitted import FittedPreprocessing
from hslite.datasets.splits import Split
from hslite.errors import ConfigError, DataError
from hslite.parallel.box import check_visible
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.launched import LaunchedJob, launched_job
from hslite.parallel.ranks.rank_setup import quiet_lightning
from hslite.parallel.ranks.rank_watch import RankActivity, watched_ranks
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.trainer.trainer_args import process_group_backend, trainer_kwargs
from hslite.parallel.trainer.usage import RankUsage
from hslite.preflight_check.decide.verdict import Verdict
from hslite.preflight_check.hardware.topology import Topology, max_cross_node_ratio
from hslite.recipe.build import build_task, deadlines_from_config, plan_from_config, prepared_datamodule
from hslite.recipe.config import to_yaml
from hslite.recipe.schema import Config
from hslite.run.checkpoints import AtomicCheckpointIO, BestCheckpoint, LastCheckpoint, load_weights, read_checkpoint
from hslite.run.evaluate import batch_limit, log_interval, predictions
from hslite.run.folder import RunFolder, check_writable
from hslite.run.launched_run import FolderView, measured_links, run_folder, whole_task
from hslite.run.loggers import check_installed, log_test_scores, tracker_environment, tracker_loggers
from hslite.run.outputs import print_summary, write_json, write_scene_outputs
from hslite.run.refit import refit
from hslite.run.resume import LAST, check_checkpoint_config, flat_config
from hslite.run.run_metrics import run_metrics
from hslite.run.training_state import TrainingState
from hslite.task import HSIClassifier


@dataclass
class RunResult:
    """What a finished run left behind."""

    run_dir: Path
    metrics: dict[str, Any]
    plan: Plan

    @property
    def best_checkpoint(self) -> Path | None:
        """checkpoints/best.ckpt (what `hslite predict` loads), or None when output.save_checkpoint=false."""
        path = self.run_dir / "checkpoints" / "best.ckpt"
        return path if path.is_file() else None


def _gate(cfg: Config, plan: Plan, datamodule: HSIDataModule, measured: Topology | None = None) -> Verdict | None:
    """Run the pre-flight check; refuse a NO-GO plan (exit 3) unless preflight.enforce=false.

    `measured`: a launched job's links, measured on its ranks (they replace preflight.topology's).
    """
    if not cfg.preflight.enabled:
        return None
    from hslite.preflight_check.decide.report import print_verdict
    from hslite.preflight_check.decide.verdict import PreflightRefused
    from hslite.recipe.gate import preflight_check

    verdict = preflight_check(cfg, plan, datamodule, single_device_only=plan.world_size == 1, topology=measured)
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
    Under torchrun or srun every rank calls `fit` (`parallel.launched`, `run.launched_run`): each returns the run.
    """
    check_installed(cfg.output.loggers)
    job = launched_job(deadlines_from_config(cfg))
    choice = None
    if cfg.parallel.plan == "auto" and job is not None:
        raise ConfigError(
            f"parallel.plan=auto chooses how many ranks to start, but {job.launcher} started them already "
            f"({job.num_nodes} node(s) × {job.per_node}): name the layout (parallel.devices, parallel.chag, ...)."
        )
    if cfg.parallel.plan == "auto":
        from hslite.recipe.auto_plan import choose_plan

        choice = choose_plan(cfg)
        print(choice.paragraph)
        cfg = choice.cfg
    plan = check_visible(plan_from_config(cfg), launched=job is not None)
    if job is not None:
        job.check(plan)
        job.join(process_group_backend(plan.accelerator))
    quiet_lightning()
    pl.seed_everything(cfg.train.seed, workers=True, verbose=False)
    datamodule = prepared_datamodule(cfg)
    task = build_task(cfg, plan, datamodule)  # refuses band groups the plan cannot split or rotate
    resume, last = _resume_point(cfg, datamodule)
    parent = Path(cfg.output.root) / cfg.recipe
    check_writable(resume.parent if resume else parent, _checkpoint_bytes(task) if cfg.output.save_checkpoint else 0)
    verdict: Verdict | None = None
    job_record: dict[str, Any] = {}  # a launched job's measured links and mesh, for preflight.json
    if choice is not None:
        verdict = choice.verdict
    elif job is not None:
        measured = None
        if cfg.preflight.enabled:
            measured, job_record = measured_links(
                job, plan, max_cross_node_ratio(cfg.preflight.topology), datamodule.num_classes
            )
        # A NO-GO is refused on every rank. Also the fence that keeps rank 0 from renaming a resumed folder (in
        # run_folder) before every rank has read its checkpoint (in _resume_point).
        verdict = job.from_leader(lambda: _gate(cfg, plan, datamodule, measured))
    else:
        verdict = _gate(cfg, plan, datamodule)  # None when preflight.enabled=false

    leader = job is None or job.leader
    with run_folder(parent, resume, job) as run, tracker_environment(cfg.output.loggers):
        if resume is None and leader:
            atomic_write(run.path / "config.yaml", lambda f: f.write(to_yaml(cfg).encode()))
            if choice is not None:
                write_json(run.path / "plan_choice.json", choice.to_dict())
            datamodule.split.save(run.path / "split.npz")
            FittedPreprocessing.from_datamodule(datamodule).save(run.path / "preprocessing.npz")  # for hslite predict
        metrics = _train_and_evaluate(cfg, plan, datamodule, task, run, last, job)
        if leader:
            metrics["resumed"] = run.resumptions
            if verdict is not None:
                write_json(
                    run.path / "preflight.json", {**_predicted_vs_measured(verdict, plan, metrics), **job_record}
                )
            write_json(run.path / "metrics.json", metrics)
    if job is not None:  # rank 0's folder, renamed now, and metrics, on every rank
        run_dir, metrics = job.from_leader(lambda: (run.path, metrics))
    else:
        run_dir = run.path
    if leader:
        print_summary(metrics, run_dir, datamodule.class_names)
    return RunResult(run_dir=run_dir, metrics=metrics, plan=plan)


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
    cfg: Config,
    plan: Plan,
    datamodule: HSIDataModule,
    task: HSIClassifier,
    run: RunFolder | FolderView,
    last: bytes | None,
    job: LaunchedJob | None,
) -> dict[str, Any]:
    """Train (and refit) on every rank; evaluate where the run's reports are written (empty metrics elsewhere)."""
    trainer, checkpoint = _trainer(cfg, plan, datamodule, run, last, launched=job is not None)
    resume_from = None if last is None else run.path / "checkpoints" / LAST  # Lightning restores from the bytes read
    wall_start = time.perf_counter()
    with watched_ranks(trainer, run.path / "ranks", deadlines_from_config(cfg), job):
        trainer.fit(task, datamodule=datamodule, ckpt_path=resume_from, weights_only=True)  # whatever the strategy
    train_seconds = time.perf_counter() - wall_start
    task = whole_task(trainer, task, job, plan, lambda: build_task(cfg, plan, datamodule))
    leader = job is None or job.leader

    best = Path(checkpoint.best_model_path).resolve() if checkpoint and checkpoint.best_model_path else None
    if best is not None and leader:
        task.load_state_dict(load_weights(best))
    refitted = None
    if cfg.train.refit:

        def chosen_epochs() -> int:
            return int(read_checkpoint(best)["epoch"]) + 1 if best is not None else max(1, trainer.current_epoch)

        epochs = chosen_epochs() if job is None else job.from_leader(chosen_epochs)  # rank 0 reads the checkpoint
        task, refitted = refit(cfg, plan, datamodule, run.path, epochs, job)
    if not leader:
        return {}
    scored, predicted = predictions(cfg, plan, datamodule, task)
    scene, test = datamodule.scene, datamodule.split.test
    targets = scene.gt[test[: len(scored), 0], test[: len(scored), 1]] - 1
    scores = task.score(torch.from_numpy(scored), torch.from_numpy(targets))
    write_scene_outputs(run.path, scores["confusion_matrix"], predicted, scene, datamodule.class_names)
    metrics = run_metrics(scores, trainer, train_seconds, plan, datamodule)
    # the training's last step as rank 0 counted it: trainer.global_step is 0 where the ranks were spawned
    log_test_scores(trainer, scores, datamodule.class_names, step=metrics["optimizer_steps"])
    return {
        **metrics,
        "best_checkpoint": str(best.relative_to(run.path.resolve())) if best else None,
        "refit": refitted,
        "confusion_matrix": scores["confusion_matrix"].tolist(),
    }


def _trainer(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, run: RunFolder | FolderView, last: bytes | None, launched: bool
) -> tuple[pl.Trainer, BestCheckpoint | None]:
    """The plan's Trainer with hslite's callbacks, and the best-checkpoint callback when checkpoints are kept."""
    from lightning.pytorch.loggers import CSVLogger

    work_dir, last_path = run.path, run.path / "checkpoints" / LAST
    callbacks: list[pl.Callback] = [TrainThroughput(), RankUsage(), TrainingState(flat_config(cfg))]
    if plan.world_size > 1:
        callbacks.append(RankActivity(work_dir / "ranks"))
    checkpoint = None
    if cfg.output.save_checkpoint:
        checkpoint = BestCheckpoint(work_dir / "checkpoints")
        callbacks += [checkpoint, LastCheckpoint(last_path, cfg.output.checkpoint_every_n_epochs)]
    kwargs = trainer_kwargs(
        plan, cfg.train.progress, cfg.train.deterministic, launched=launched, deadlines=deadlines_from_config(cfg)
    )
    callbacks += kwargs.pop("callbacks", [])
    # output.loggers' trackers where the run's folder is made; the other launched ranks log nothing, may not see it
    leader = isinstance(run, RunFolder)
    trackers = tracker_loggers(cfg.output.loggers, work_dir, cfg.recipe, len(run.resumptions)) if leader else []
    trainer = pl.Trainer(
        **kwargs,
        max_epochs=cfg.train.max_epochs,
        max_steps=cfg.train.max_steps,
        limit_train_batches=batch_limit(cfg.train.limit_train_batches),
        limit_val_batches=batch_limit(cfg.train.limit_val_batches),
        check_val_every_n_epoch=cfg.train.check_val_every_n_epoch,
        log_every_n_steps=log_interval(len(datamodule.train_dataloader()), plan, cfg.train.limit_train_batches),
        callbacks=callbacks,
        # Lightning's CSV logger empties a metrics.csv it finds: a resumed part writes its own, logs/resumed-<n>/.
        logger=[
            CSVLogger(work_dir, name="logs", version=f"resumed-{len(run.resumptions)}" if run.resumptions else ""),
            *trackers,
        ],
        default_root_dir=work_dir,
        enable_checkpointing=cfg.output.save_checkpoint,
        plugins=[AtomicCheckpointIO(None if last is None else {last_path: last})],
    )
    return trainer, checkpoint
