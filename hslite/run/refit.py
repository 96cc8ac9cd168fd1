"""`train.refit`: once validation has chosen the epoch, train afresh on training + validation pixels and test that.

What a grid search over an SVM does (scikit-learn's `refit=True`): the hyper-parameters are chosen on held-out
pixels, then the final model learns from those pixels too. On spatially disjoint blocks this matters: the validation
blocks hold fields no training block does, and both the RBF-SVM of benchmarks/time_to_accuracy.py and hslite score
far higher refit on them there (the benchmark prints both). The preprocessing stays fitted on the training pixels
alone, as the SVM's scaling does, so
`hslite predict` reads the same preprocessing.npz. The chosen epoch count is the schedule's length: warm-up and
cosine decay run over it as they ran over `train.max_epochs`. On several devices the second training starts its
ranks as the first did (spawned, or the launcher's), and its weights come back the same way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from hslite.datasets.datamodule import HSIDataModule
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.launched import LaunchedJob
from hslite.parallel.ranks.rank_watch import RankActivity, watched_ranks
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.recipe.build import build_task, deadlines_from_config
from hslite.recipe.schema import Config
from hslite.run.checkpoints import AtomicCheckpointIO
from hslite.run.evaluate import batch_limit, log_interval
from hslite.run.launched_run import whole_task
from hslite.run.resume import flat_config
from hslite.run.training_state import TrainingState
from hslite.task import HSIClassifier


def refit(
    cfg: Config, plan: Plan, datamodule: HSIDataModule, run_dir: Path, epochs: int, job: LaunchedJob | None = None
) -> tuple[HSIClassifier, dict]:
    """A fresh model trained `epochs` epochs on training + validation pixels, and what metrics.json says of it.

    `job`: the launched job every rank of which calls this (`parallel.launched`); rank 0 gets the whole weights.

    Its weights replace checkpoints/best.ckpt (what `hslite predict` loads) when checkpoints are kept; its loss per
    step goes to logs/refit/metrics.csv, beside the first training's logs.
    """
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(cfg.train.seed, workers=True, verbose=False)
    datamodule.train_on_validation_too()
    task = build_task(cfg, plan, datamodule)
    deadlines = deadlines_from_config(cfg)
    kwargs = trainer_kwargs(plan, cfg.train.progress, cfg.train.deterministic, launched=job is not None,
                            deadlines=deadlines)  # fmt: skip
    callbacks = [*kwargs.pop("callbacks", []), TrainThroughput(), TrainingState(flat_config(cfg))]
    if plan.world_size > 1:
        callbacks.append(RankActivity(run_dir / "ranks"))
    trainer = pl.Trainer(
        **kwargs,
        max_epochs=epochs,
        limit_train_batches=batch_limit(cfg.train.limit_train_batches),
        limit_val_batches=0,  # the validation pixels are training pixels now
        log_every_n_steps=log_interval(len(datamodule.train_dataloader()), plan, cfg.train.limit_train_batches),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        # CSV only, not output.loggers' trackers: a second training from step 0 in the first one's TensorBoard folder
        # would hide that one's curves (it drops steps logged again), and in its MLflow run would interleave with
        # them. The trackers get the refitted model's test scores (`loggers.log_test_scores`).
        logger=CSVLogger(run_dir, name="logs", version="refit"),
        default_root_dir=run_dir,
        enable_checkpointing=False,
        plugins=[AtomicCheckpointIO(None)],
    )
    start = time.perf_counter()
    with watched_ranks(trainer, run_dir / "ranks", deadlines, job):
        trainer.fit(task, datamodule=datamodule)
    seconds = time.perf_counter() - start
    task = whole_task(trainer, task, job, plan, lambda: build_task(cfg, plan, datamodule))
    if cfg.output.save_checkpoint:
        trainer.save_checkpoint(run_dir / "checkpoints" / "best.ckpt", weights_only=True)
    report: dict[str, Any] = {
        "epochs": epochs,
        "train_seconds": seconds,
        "train_pixels": len(datamodule.split.train) + len(datamodule.split.val),
    }
    return task, report
