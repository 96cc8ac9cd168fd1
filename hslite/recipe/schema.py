"""The typed recipe schema: every key a recipe or override may set, its default and why, and the checks across keys.

A recipe can only set fields that exist here, and every value is type-checked against these dataclasses
(`recipe.config` loads and merges), so a recipe can name registered components but never code.
"""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from hslite.datasets.preprocess import NORMALISATIONS
from hslite.datasets.settings import DataSettings
from hslite.datasets.splits import SPLIT_KINDS
from hslite.errors import ConfigError
from hslite.preflight_check.price.regime import DEFAULT_MIN_EFFICIENCY
from hslite.ranges import (
    AT_LEAST_0,
    AT_LEAST_1,
    BATCH_LIMIT,
    POSITIVE,
    SEED,
    Interval,
    range_problems,
    ranged,
)

# What output.loggers may name: csv (logs/metrics.csv, written whether named or not) and run/loggers.py's trackers.
LOGGERS = ("csv", "tensorboard", "mlflow", "wandb")


@dataclass
class DataConfig(DataSettings):
    """Which scene, how it is preprocessed and split, and how patches are batched; and where the run holds them."""

    # GPU plans: keep the padded cube in GPU memory and gather patches there (no patch crosses the bus; needs
    # num_workers=0; the probe then times that path); false gathers on the host into pinned memory
    gather_on_device: bool = False
    # host memory a fit may use, GB (the scene is refused up front when its estimate is larger); 0 means what this
    # machine, or its cgroup, has available when the run starts
    host_memory_gb: float = ranged(0.0, AT_LEAST_0)


@dataclass
class ModelConfig:
    """Which registered architecture, at which size."""

    name: str = "cnn3d"  # registered model (`hslite models`)
    size: str = "small"  # preset of that model ("small", "large"; channel_vit also vit_b, vit_l, vit_giant, vit_e)
    # G, contiguous band groups (aligned to VIS/NIR/SWIR-1/SWIR-2 when wavelengths are known): channel_vit's own
    # (0: its preset's 4), and for other models the groups that channel-subset rotation masks (0: 4)
    band_groups: int = ranged(0, AT_LEAST_0)
    # cnn1d: read the mean spectrum of the data.patch_size window beside the centre pixel's (the paper's model: false)
    window_mean: bool = False
    # fine-tune: a local state dict or Lightning checkpoint to start from (read weights-only); "" means from scratch
    pretrained: str = ""
    # parameter prefixes the checkpoint does not set (e.g. [head] for another number of classes): fresh, and trained
    pretrained_exclude: list[str] = field(default_factory=list)
    freeze_backbone: bool = False  # with pretrained: train only the pretrained_exclude parameters


@dataclass
class TrainConfig:
    """Optimisation and loop length."""

    max_epochs: int = ranged(50, AT_LEAST_1)  # passes over the training pixels
    max_steps: int = ranged(-1, Interval(-1, -1), AT_LEAST_1)  # optimiser steps cap; -1 means no cap
    lr: float = ranged(1e-3, POSITIVE)  # peak AdamW learning rate
    weight_decay: float = ranged(1e-4, AT_LEAST_0)  # AdamW decoupled weight decay; 0 means none
    warmup_epochs: int = ranged(2, AT_LEAST_0)  # linear warm-up before the cosine decay, epochs; 0 means none
    seed: int = ranged(0, SEED)  # seeds Python, NumPy, torch and the split
    class_weights: bool = False  # weight the loss by inverse class frequency of the training pixels
    # once validation has chosen the epoch, train afresh on training + validation pixels for that many epochs and test
    # that model, as an SVM's grid search refits (run/refit.py)
    refit: bool = False
    limit_train_batches: float = ranged(1.0, *BATCH_LIMIT)  # share (≤ 1.0) or count (> 1) of training batches per epoch
    limit_val_batches: float = ranged(1.0, *BATCH_LIMIT)  # share or count of validation batches per epoch
    limit_test_batches: float = ranged(1.0, *BATCH_LIMIT)  # share or count of test batches; 1.0 means all
    check_val_every_n_epoch: int = ranged(1, AT_LEAST_1)  # validate every this many epochs
    progress: bool = True  # rich progress bar
    deterministic: bool = False  # deterministic kernels only (torch.use_deterministic_algorithms), in every rank


@dataclass
class DeadlinesConfig:
    """Seconds a multi-process run waits in each phase before it is ended (`hslite/parallel/deadlines.py`)."""

    # every collective after start-up; on GPUs also NCCL's watchdog limit (passed: SIGABRT of every rank), so long
    # enough for legitimate skew (cuDNN autotuning, the last smaller batch, epoch-end work); hangs are the stall's
    collective: float = ranged(600.0, POSITIVE)
    # every rank reaches the rendezvous and builds the first communicator (passed: each rank raises, saying how long
    # it waited); ranks start one after another, each importing torch and Lightning
    startup: float = ranged(600.0, POSITIVE)
    # a barrier after one rank's solo work (a checkpoint, an evaluation, a map), over gloo on every device (passed:
    # every rank raises, rank 0 naming the ranks that did not come)
    fence: float = ranged(1800.0, POSITIVE)
    # a spawned rank that shows no heartbeat this long (frozen: stopped, a GIL held, swapping) is ended and named, and
    # the job stops (a launcher's ranks: the collective deadline does it)
    stall: float = ranged(30.0, POSITIVE)


@dataclass
class ParallelConfig:
    """The layout over devices; validated as a Plan before any process starts."""

    accelerator: str = "auto"  # "cpu", "gpu", or "auto" (gpu when CUDA is available)
    devices: int = ranged(1, AT_LEAST_1)  # devices per node (CPU processes on a CPU box)
    num_nodes: int = ranged(1, AT_LEAST_1)  # nodes; more than 1 runs under torchrun or srun (README "Several nodes")
    precision: str = "32-true"  # "32-true", "bf16-mixed" or "16-mixed"
    accumulate: int = ranged(1, AT_LEAST_1)  # micro-batches per optimiser step; 1 means off
    compression: str = "none"  # gradient all-reduce compression: "none", "int8", "bf16" or "fp16"
    chag: int = ranged(1, AT_LEAST_1)  # ranks sharing one batch's band groups (channel parallelism); 1 means off
    rotation_groups: int = ranged(0, AT_LEAST_0)  # band groups active per step (channel-subset rotation); 0 means off
    fsdp: bool = False  # shard parameters, gradients and optimiser state
    # with fsdp on several nodes: shard inside each node, one replica per node (HSDP); FSDP's per-layer gathers
    # then stay inside a node, which the mapping rule asks for when the link between nodes is much slower
    hybrid_shard: bool = False
    tf32: bool = True  # CUDA only: fp32 matmuls/convolutions on TF32 tensor cores (the probe times it); false: fp32
    cudnn_benchmark: bool = True  # CUDA only: cuDNN times kernels per input shape (off under train.deterministic)
    # "manual" trains the layout above; "auto" trains the fastest plan the pre-flight predicts at this global batch on
    # the devices present (the layout above is only where the search starts), because which trick pays depends on
    # the model and the box, and the pre-flight has measured both (recipe/auto_plan.py; plan_choice.json says why)
    plan: str = "manual"
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)


@dataclass
class PreflightConfig:
    """The go/no-go check that runs before every multi-device fit."""

    enabled: bool = True  # run the check in `hslite fit`; single-device runs skip the link measurement
    enforce: bool = True  # refuse (exit 3) a NO-GO plan; false means warn and run anyway
    # GO needs E = ECD(N)/ECD(1) ≥ this (0.5: r ≤ 1, communication no longer than compute)
    min_efficiency: float = ranged(DEFAULT_MIN_EFFICIENCY, Interval(0, 1, lo_open=True))
    # topology profile to price devices that are not visible: a bundled name or a .yaml path; None means measure
    topology: str | None = None
    # GPU profile (`hslite/preflight_check/hardware/devices/`) whose roofline prices the compute of GPUs that are not
    # here, so that a box you are about to buy gets a GO/NO-GO and not only links and memory; None means undecided
    # there. GPUs that are here are measured instead.
    device: str | None = None
    # one efficiency for every kind of kernel (matmuls, convolutions, memory traffic); 0: the profile's own
    device_efficiency: float = ranged(0.0, Interval(0, 0), Interval(0, 1, lo_open=True))
    fresh: bool = False  # re-measure instead of using cached probe and link results
    probe_steps: int = ranged(5, AT_LEAST_1)  # timed steps per probe, after warm-up


@dataclass
class OutputConfig:
    """Where run folders go and what they hold."""

    root: str = "runs"  # run folders are <root>/<recipe>/<timestamp>/
    save_checkpoint: bool = True  # keep the best checkpoint by validation OA, and last.ckpt to resume from
    checkpoint_every_n_epochs: int = ranged(1, AT_LEAST_1)  # write last.ckpt (atomically) every this many epochs
    save_map: bool = True  # predict the whole scene: map.png and prediction.tif
    # trackers that get the training curves and test scores too, in the run folder (README "Trackers"): tensorboard,
    # mlflow (MLFLOW_TRACKING_URI if set), wandb; each needs its extra, pip install "hslite[NAME]". [] means the CSV
    # only: logs/metrics.csv is always written
    loggers: list[str] = field(default_factory=list)


@dataclass
class Config:
    """A whole recipe."""

    recipe: str = "quickstart"  # name of the recipe this config came from
    description: str = ""  # one line shown by `hslite recipes`
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # "last" (the newest unfinished run of this recipe under output.root) or a run folder: continue that run from its
    # last.ckpt, in its own folder, with the config it was started with (hslite/run/resume.py)
    resume: str | None = None


def check_config(cfg: Config) -> Config:
    """Raise one ConfigError listing every out-of-range value and inconsistent pair of values; return cfg."""
    problems = range_problems(cfg)
    d = cfg.data
    if d.split != "count" and d.train_fraction + d.val_fraction >= 1:
        problems.append(
            f"data.train_fraction={d.train_fraction} + data.val_fraction={d.val_fraction} = "
            f"{d.train_fraction + d.val_fraction:g} leaves no test pixels: the sum must be < 1; lower one of them."
        )
    if d.split == "count" and d.train_per_class < 1:
        problems.append(
            f"data.split=count needs data.train_per_class ≥ 1 (training pixels per class), got {d.train_per_class}."
        )
    for key, value, choices in (
        ("parallel.plan", cfg.parallel.plan, ("manual", "auto")),
        ("data.split", d.split, SPLIT_KINDS),
        ("data.normalisation", d.normalisation, NORMALISATIONS),
    ):
        if value not in choices:
            problems.append(f"{key} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}.")
    unknown = [name for name in cfg.output.loggers if name not in LOGGERS]
    if unknown:
        problems.append(
            f"output.loggers names {', '.join(repr(name) for name in unknown)}, which hslite has no logger for: "
            f"name only {', '.join(repr(name) for name in LOGGERS[:-1])} or {LOGGERS[-1]!r}."
        )
    if problems:
        raise ConfigError(" ".join(problems))
    return cfg


def valid_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key a recipe or override may set."""
    return [key for key, _, _ in described_keys(cls, prefix)]


def described_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, why) of every key a recipe or override may set; why is the field's comment above."""
    notes = _field_comments(cls)
    keys: list[tuple[str, Any, str]] = []
    for f in fields(cls):
        sub = f.default_factory if is_dataclass(f.default_factory) else None  # type: ignore[misc]
        if sub is not None:
            keys += described_keys(sub, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            factory: Any = f.default_factory  # MISSING when the field has a plain default
            default = f.default if f.default is not MISSING else factory()
            keys.append((prefix + f.name, default, notes.get(f.name, "")))
    return keys


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment where it is defined (the lines above it and the one after it), so it is said once."""
    notes: dict[str, str] = {}
    above: list[str] = []
    sources = [inspect.getsourcelines(klass)[0] for klass in cls.__mro__[::-1] if is_dataclass(klass)]
    for line in itertools.chain.from_iterable(sources):
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
            continue
        name = re.match(r"(\w+): ", text)
        if name:
            trailing = text.partition("  # ")[2]
            notes[name[1]] = " ".join([*above, trailing] if trailing else above)
        above = []
    return notes
