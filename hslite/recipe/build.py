"""A recipe's parts from its Config: the Plan, the datamodule, the model and the task.

The one place that reads a Config into components; datasets, models, `parallel/` and `preflight_check/` take the plain
arguments handed out here, so they stay usable from a notebook without a recipe.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import cast

import numpy as np
import torch
from torch import nn

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.settings import DataSettings
from hslite.errors import ConfigError
from hslite.models import get_model, has_band_groups
from hslite.models.band_groups import spectral_band_groups
from hslite.models.pretrained import load_pretrained
from hslite.parallel.box import resolve_accelerator
from hslite.parallel.channels.rotation import DEFAULT_GROUPS, RotationSchedule, check_rotation
from hslite.parallel.deadlines import Deadlines
from hslite.parallel.plan import Compression, Plan, Precision
from hslite.recipe.schema import Config
from hslite.task import HSIClassifier


def plan_from_config(cfg: Config) -> Plan:
    """The validated Plan a recipe asks for (whether this box can run it is `check_visible`'s question)."""
    p = cfg.parallel
    # The config's strings are checked against the Plan's literals by the Plan itself, in a sentence naming each
    return Plan(
        devices=p.devices,
        num_nodes=p.num_nodes,
        accelerator=resolve_accelerator(p.accelerator),
        batch_size=cfg.data.batch_size,
        accumulate=p.accumulate,
        precision=cast(Precision, p.precision),
        compression=cast(Compression, p.compression),
        chag=p.chag,
        rotation_groups=p.rotation_groups,
        fsdp=p.fsdp,
        hybrid_shard=p.hybrid_shard and p.fsdp,  # how FSDP shards; nothing without it
        tf32=p.tf32,
        cudnn_benchmark=p.cudnn_benchmark and not cfg.train.deterministic,  # cuDNN's timing picks kernels by chance
    )


def deadlines_from_config(cfg: Config) -> Deadlines:
    """The phase deadlines a recipe sets (parallel.deadlines.*) for the process groups and watch of its ranks."""
    return Deadlines(**vars(cfg.parallel.deadlines))


# The Plan fields a recipe sets under parallel.* (its per-device batch is data.batch_size).
_PARALLEL_FIELDS = (
    "devices", "num_nodes", "accelerator", "accumulate", "precision", "compression", "chag", "rotation_groups", "fsdp",
    "hybrid_shard", "tf32", "cudnn_benchmark",
)  # fmt: skip


def config_for_plan(cfg: Config, plan: Plan) -> Config:
    """The recipe with `plan`'s layout written in (parallel.* and data.batch_size): plan_from_config's inverse.

    parallel.plan becomes "manual": the config says what trained, and loading it again trains the same plan.
    """
    layout = {name: getattr(plan, name) for name in _PARALLEL_FIELDS}
    return replace(
        cfg,
        data=replace(cfg.data, batch_size=plan.batch_size),
        parallel=replace(cfg.parallel, plan="manual", **layout),
    )


def build_datamodule(cfg: Config) -> HSIDataModule:
    """The datamodule a recipe describes (plain arguments, no Config inside)."""
    d = cfg.data
    gpu_plan = resolve_accelerator(cfg.parallel.accelerator) == "gpu"
    on_gpu = gpu_plan and torch.cuda.is_available()
    if d.gather_on_device and not gpu_plan:
        raise ConfigError(
            "data.gather_on_device=true keeps the cube in GPU memory, and this run is on CPU processes: drop it, or "
            "set parallel.accelerator=gpu."
        )
    # GPU batches are gathered into pinned memory, so the copy up overlaps the step (batch_buffers.to_device), or on
    # the GPU itself. Not where no GPU is here: a GPU plan is then only priced, from a device profile.
    return HSIDataModule(
        DataSettings(**{f.name: getattr(d, f.name) for f in fields(DataSettings)}),
        seed=cfg.train.seed,
        pin_memory=on_gpu,
        gather_device="cuda" if on_gpu and d.gather_on_device else None,
    )


def prepared_datamodule(cfg: Config) -> HSIDataModule:
    """The recipe's datamodule with its files checked (downloaded when allowed) and its split and patches built."""
    from hslite.recipe.memory_check import check_host_memory

    datamodule = build_datamodule(cfg)
    datamodule.prepare_data()
    check_host_memory(cfg, datamodule)  # before a pixel is read: a scene too large is one sentence, not the OOM killer
    datamodule.setup("fit")
    return datamodule


def build_model(cfg: Config, datamodule: HSIDataModule) -> nn.Module:
    """The registered model sized for the datamodule's bands, classes and patch (the datamodule must be set up).

    With `model.pretrained`, it starts from that checkpoint's weights (`models.pretrained`), its backbone frozen when
    `model.freeze_backbone`: what `fit` trains and the pre-flight probes.
    """
    model = model_for(cfg, datamodule.num_bands, datamodule.num_classes, datamodule.input_wavelengths_nm)
    if cfg.model.pretrained:
        load_pretrained(model, cfg.model.pretrained, cfg.model.pretrained_exclude, cfg.model.freeze_backbone)
    elif cfg.model.freeze_backbone or cfg.model.pretrained_exclude:
        raise ConfigError(
            "model.freeze_backbone and model.pretrained_exclude apply to a pretrained start: add "
            "model.pretrained=PATH (a state dict or checkpoint), or drop them."
        )
    return model


def model_for(cfg: Config, in_bands: int, num_classes: int, wavelengths_nm: np.ndarray | None) -> nn.Module:
    """The recipe's registered model for `in_bands` input bands (centred at `wavelengths_nm`) and `num_classes`."""
    options: dict[str, object] = {"window_mean": True} if cfg.model.window_mean else {}
    if cfg.model.band_groups and has_band_groups(cfg.model.name):
        options["num_groups"] = cfg.model.band_groups
    return get_model(
        cfg.model.name,
        in_bands=in_bands,
        num_classes=num_classes,
        patch_size=cfg.data.patch_size,
        size=cfg.model.size,
        wavelengths_nm=wavelengths_nm,
        **options,
    )


def band_groups_for(cfg: Config, datamodule: HSIDataModule, model: nn.Module) -> list[tuple[int, int]]:
    """The model's own band groups, or for a model without them the groups rotation masks (model.band_groups)."""
    own = getattr(model, "band_groups", None)
    if own is not None:
        return list(own)
    count = min(cfg.model.band_groups or DEFAULT_GROUPS, datamodule.num_bands)
    return spectral_band_groups(datamodule.input_wavelengths_nm, datamodule.num_bands, count)


def check_model_for_plan(plan: Plan, model: nn.Module, band_groups: list[tuple[int, int]]) -> None:
    """Refuse, before anything runs, band groups the plan cannot split across ranks or rotate through."""
    if plan.chag_enabled:
        from hslite.parallel.channels.channel_groups import check_divides

        if getattr(model, "band_groups", None) is None:
            raise ConfigError(
                f"parallel.chag={plan.chag} splits a model's band groups across ranks, and {type(model).__name__} "
                "has none: use model.name=channel_vit, or parallel.chag=1."
            )
        check_divides(len(band_groups), plan.chag)
    if plan.rotation_enabled:
        check_rotation(len(band_groups), plan.rotation_groups, plan.chag)


def build_task(cfg: Config, plan: Plan, datamodule: HSIDataModule) -> HSIClassifier:
    """The model wrapped in the classification task, with class weights from the training pixels when asked.

    `plan` is the recipe's Plan (`plan_from_config`), derived once by the caller; a model whose band groups it cannot
    split or rotate is refused here.
    """
    weights = None
    if cfg.train.class_weights:
        train = datamodule.split.train
        labels = datamodule.scene.gt[train[:, 0], train[:, 1]] - 1
        counts = np.bincount(labels, minlength=datamodule.num_classes).astype(np.float64)
        weights = torch.tensor(counts.sum() / np.maximum(counts, 1) / datamodule.num_classes, dtype=torch.float32)
    model = build_model(cfg, datamodule)
    task = HSIClassifier(
        model,
        num_classes=datamodule.num_classes,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        warmup_epochs=cfg.train.warmup_epochs,
        class_weights=weights,
    )
    task.rotation = checked_rotation(cfg, plan, datamodule, model)
    return task


def checked_rotation(cfg: Config, plan: Plan, datamodule: HSIDataModule, model: nn.Module) -> RotationSchedule | None:
    """Refuse a model whose band groups `plan` cannot split or rotate; its rotation schedule when `plan` rotates."""
    band_groups = band_groups_for(cfg, datamodule, model)
    check_model_for_plan(plan, model, band_groups)
    if not plan.rotation_enabled:
        return None
    return RotationSchedule(band_groups, plan.rotation_groups, cfg.train.seed, plan.chag)
