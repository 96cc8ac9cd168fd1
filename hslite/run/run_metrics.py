"""metrics.json's training figures: the scores, what the timing and usage callbacks measured, the plan that ran."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from hslite.datasets.datamodule import HSIDataModule
from hslite.parallel.compression.guard import kind_at_level
from hslite.parallel.plan import Plan
from hslite.parallel.trainer.usage import usage_metrics


def run_metrics(
    scores: dict[str, Any], trainer: pl.Trainer, train_seconds: float, plan: Plan, datamodule: HSIDataModule
) -> dict[str, Any]:
    """metrics.json's scores, training figures and the data's audit (the caller adds the checkpoint and confusion)."""
    perf = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")}
    return {
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
        "split_counts": datamodule.split.counts(datamodule.scene.gt),
        "split_protocol": datamodule.split.protocol,
        "leakage_audit": datamodule.leakage_audit(),
    }


def _plan_that_ran(plan: Plan, trainer: pl.Trainer) -> str:
    """The plan as it ended: the compression guard may have relaxed int8 to bf16 or none during the run."""
    bits = trainer.callback_metrics.get("compression/level")
    if not plan.compression_enabled or bits is None:
        return plan.describe()
    return plan.with_(compression=kind_at_level(plan.compression, int(bits))).describe()
