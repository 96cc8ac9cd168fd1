"""What every way of pricing a recipe reads (`gate.py`): its plan, model, batches and probe names, and this box.

The model is built once where it is measured here, and never allocated where it is priced from profiles (fake
tensors, `preflight.fake_tensors`); the batches are the datamodule's own, augmentation included.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from hslite.datasets.batches.patches import PatchDataset
from hslite.datasets.datamodule import HSIDataModule
from hslite.models import architecture_digest, has_band_groups
from hslite.parallel.plan import Plan
from hslite.preflight_check.hardware.topology import Topology
from hslite.preflight_check.measure.fake_tensors import fake_mode
from hslite.preflight_check.measure.footprint import measure_footprint
from hslite.preflight_check.measure.loop_cost import measure_step_overhead, measure_step_overhead_apart
from hslite.preflight_check.measurements import Footprint
from hslite.recipe.build import build_model
from hslite.recipe.schema import Config


def training_batches(datamodule: HSIDataModule, seed: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """Random batches of b training samples gathered by the datamodule's own dataset (augmentation included).

    The batches are flipped by a generator of their own: drawn with the dataset's, a fresh probe advanced the flips
    training then saw, and the same seed scored differently after a fresh probe than after a cached one.
    They are gathered by a gatherer of their own too (a shallow copy, sharing the host cube): with
    `data.gather_on_device` the probe's copy of the cube on the probed GPU goes when the probe does. Placed through
    the datamodule's gatherer, it would stay on that GPU beside rank 0's for the whole run.
    """
    dataset = cast(PatchDataset, datamodule.train_dataloader().dataset).with_own_augmentation(seed)
    dataset.gatherer = copy.copy(dataset.gatherer)
    generator = torch.Generator().manual_seed(seed)

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        index = torch.randint(0, len(dataset), (batch_size,), generator=generator).tolist()  # type: ignore[arg-type]
        return dataset.__getitems__(index)  # type: ignore[attr-defined]

    return make_batch


@dataclass(frozen=True)
class RecipeParts:
    """What every way of pricing a recipe reads: its plan, model, batches and probe names, and this box's devices."""

    cfg: Config
    plan: Plan
    classes: int
    have: int  # devices of the plan's accelerator visible here
    topology: Topology | None
    compute_here: bool  # False: the plan's GPUs are priced, not timed, and host work is timed on this CPU
    make_batch: Callable[[int], tuple[Tensor, Tensor]]
    model_factory: Callable[[], nn.Module]
    band_group_sizes: list[int] | None  # bands per group of a band-group model (its `encode_group` work is split)
    chag_supported: bool  # the model has band groups that channel groups can split
    name_key: str  # model, size and input: the readable part of cache_key
    architecture: str  # `architecture_digest` of the model: the rest of cache_key

    @property
    def band_groups(self) -> int:
        """The model's band groups, which a channel-group count must divide (0: none)."""
        return len(self.band_group_sizes or ())

    @property
    def cache_key(self) -> str:
        """The probes' cache key: by architecture too, for another model under one name or an older version of it."""
        return f"{self.name_key}-{self.architecture}"

    @classmethod
    def of(
        cls, cfg: Config, plan: Plan, datamodule: HSIDataModule, have: int, topology: Topology | None, here: bool
    ) -> RecipeParts:
        """The recipe's parts, its model built once (`here`) or never allocated (priced from profiles).

        Measured here, each measurement gets a copy of the model. Priced from profiles, it is built on fake tensors
        and rebuilt inside each count's own fake mode (`preflight.fake_tensors`): a model larger than this box is
        priced in seconds.
        """

        def build() -> nn.Module:
            torch.manual_seed(0)  # as each measurement seeds before it builds: the copies are the model it built
            return build_model(cfg, datamodule)

        if here:
            built = functools.cache(build)
            model, factory = built(), lambda: copy.deepcopy(built())
        else:
            with fake_mode():
                model = build()
            factory = build
        chag_supported = has_band_groups(cfg.model.name)
        sizes = [stop - start for start, stop in model.band_groups] if chag_supported else None  # type: ignore[union-attr]
        bands, classes, patch = datamodule.num_bands, datamodule.num_classes, cfg.data.patch_size
        # The data path the probe times is the one training runs (a batch gathered from the scene's padded input,
        # or from data.on_disk's compact bank of labelled patches, on the CPU or the GPU): a probe of one is not
        # the price of another, nor of a scene whose image is another size.
        rows, cols = datamodule.scene.gt.shape
        path = f"{'bank' if datamodule.settings.on_disk else 'image'}{rows}x{cols}-{datamodule.gather_device or 'cpu'}"
        return cls(cfg, plan, classes, have, topology, here, training_batches(datamodule, cfg.train.seed), factory,
                   sizes, chag_supported,
                   f"{cfg.model.name}-{cfg.model.size}-{bands}x{patch}x{patch}-c{classes}-{path}",
                   architecture_digest(model))  # fmt: skip

    @property
    def topology_reason(self) -> str:
        """Where links and memory come from when a topology profile prices them."""
        assert self.topology is not None
        if self.topology.measured:
            return f"links and device memory {self.topology.name}: {self.topology.describe_links()}"
        return f"links and device memory from the topology profile {self.topology.name!r}"

    def footprint_for(self, plan: Plan) -> Footprint:
        """The model's sizes at `plan`'s batch and precision, counted on its fake tensors."""
        return measure_footprint(self.model_factory, self.make_batch, batch_size=plan.batch_size,
                                 precision=plan.precision, band_group_sizes=self.band_group_sizes)  # fmt: skip

    def loop_seconds_for(self, plan: Plan) -> float:
        """The training loop's cost per micro-step: with `plan`'s ranks where this box starts them, else one rank's.

        Ranks this box cannot start (other nodes, absent GPUs) are priced with one local rank's loop, and GPUs
        priced from a profile with one CPU process's: the host work their own box's CPU does. A launched job's own
        layout is priced with the loop its ranks were timed running (`Topology.job_loop_seconds`).
        """
        job = self.topology
        if job is not None and job.job_loop_seconds is not None and (plan.num_nodes, plan.devices) == job.layout:
            return job.job_loop_seconds
        startable = self.topology is None and (plan.accelerator == "cpu" or plan.devices <= self.have)
        ranks = plan.devices if self.compute_here and startable and plan.num_nodes == 1 else 1
        accelerator = plan.accelerator if self.compute_here else "cpu"
        # A rank of a launched job (its process group is up) measures the loop in a process of its own.
        measure = measure_step_overhead_apart if torch.distributed.is_initialized() else measure_step_overhead
        return measure(Plan(devices=ranks, accelerator=accelerator), self.classes, fresh=self.cfg.preflight.fresh)
