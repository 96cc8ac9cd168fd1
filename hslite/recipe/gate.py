"""The pre-flight gate of a recipe: its Plan, its datamodule and model, this box's devices and links -> Verdict.

`hslite fit` and `hslite preflight` both call `preflight_check` once the config and the data are known to be good.
The probe times batches from the datamodule that trains (the same bands, PCA, patches and gather), and the model
comes from the same builder; the training-loop cost is measured by `parallel.loop_cost`, handed to the pre-flight as
a callable, so `preflight/` never builds a Trainer and never reads a Config.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.patches import PatchDataset
from hslite.errors import ConfigError, HSLiteError
from hslite.models import has_band_groups
from hslite.parallel.loop_cost import measure_step_overhead
from hslite.parallel.plan import Plan, visible_devices
from hslite.parallel.rank_setup import quiet_lightning
from hslite.preflight.device_profile import DeviceProfile, list_devices, load_device
from hslite.preflight.links import measure_links_for
from hslite.preflight.measurements import Footprint, StepCounts
from hslite.preflight.probe import PROBE_DEVICE, measure_footprint, probe_for_plans
from hslite.preflight.run import price_absent_devices, price_from_profile, run_preflight
from hslite.preflight.step_counts import count_step
from hslite.preflight.timers import wall_seconds
from hslite.preflight.topology import Topology, list_topologies, load_topology
from hslite.preflight.verdict import NO_GO_EXIT_CODE, UNDECIDED_EXIT_CODE, Verdict
from hslite.recipe.build import build_model, build_task, plan_from_config, prepared_datamodule
from hslite.recipe.config import Config

MAX_PRICED_DEVICES = 16  # the largest box hslite is for
# A band-group model's per-group work, the part channel groups split across ranks: its output is the group tokens.
TOKENIZER_MODULES = ("tokenizer", "partial_aggregation")


class PreflightRefused(HSLiteError):
    """The plan cannot be shown to pay (NO-GO)."""

    exit_code = NO_GO_EXIT_CODE


class PreflightUndecided(HSLiteError):
    """The plan's devices are not here and no profile says what they are: nothing can be priced."""

    exit_code = UNDECIDED_EXIT_CODE


def check_recipe(cfg: Config, *, from_profile: bool = False) -> Verdict:
    """The pre-flight of a recipe on its own: plan and data validated first, then `preflight_check`."""
    plan = plan_from_config(cfg)
    quiet_lightning()
    datamodule = prepared_datamodule(cfg)
    build_task(cfg, datamodule)  # refuses band groups the plan cannot split or rotate, before any probe
    return preflight_check(cfg, plan, datamodule, from_profile=from_profile)


def training_batches(datamodule: HSIDataModule, seed: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """Random batches of b training samples gathered by the datamodule's own dataset (augmentation included).

    The batches are flipped by a generator of their own: drawn with the dataset's, a fresh probe advanced the flips
    training then saw, and Salinas-A's seed 0 scored 99.86 % after a fresh probe and 99.44 % after a cached one.
    """
    dataset = cast(PatchDataset, datamodule.train_dataloader().dataset).with_own_augmentation(seed)
    generator = torch.Generator().manual_seed(seed)

    def make_batch(batch_size: int) -> tuple[Tensor, Tensor]:
        index = torch.randint(0, len(dataset), (batch_size,), generator=generator).tolist()  # type: ignore[arg-type]
        return dataset.__getitems__(index)  # type: ignore[attr-defined]

    return make_batch


def _memory_bytes(accelerator: str) -> int:
    """One device's memory budget: what the probed GPU has free, or this host's memory for CPU processes.

    Free, not total, on a GPU: other processes' allocations, the CUDA context this launching process keeps there
    while the ranks train and the libraries its probe loaded are not the ranks' to use. Read after the
    probe (`run_preflight` calls it when the first plan is priced) and after the probe has handed its cached blocks
    back (`probe_model`), because the ranks start after the probe: what is free then is their budget. Only the
    probed GPU is asked, since asking another creates a CUDA context there; with nothing else running on the others
    it is the tightest, the launcher's context sitting on it alone. Not in this figure: the CUDA context each
    spawned rank creates on its own GPU (a one-device plan trains in this process, whose context is already out).
    """
    if accelerator == "gpu" and torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info(PROBE_DEVICE)
        return int(free_bytes)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _absent(plan: Plan, have: int) -> str | None:
    # CPU "devices" are processes: any count can be started and measured here (sharing cores is what is priced).
    if plan.num_nodes > 1:
        return f"the plan spans {plan.num_nodes} nodes and only this one is visible"
    if plan.accelerator == "gpu" and plan.devices > have:
        return f"the plan needs {plan.devices} GPUs per node but this box has {have} visible"
    return None


def _forked_cuda_devices(plan: Plan, from_profile: bool) -> list[torch.device]:
    """The CUDA devices whose generators the check gives back: the probed GPU, or the current one, or none.

    The probed GPU when the check runs there; else the current device where CUDA is already up, as the probe's
    seeding reaches every CUDA generator; else none. Reading a GPU's generator creates a CUDA context on it (hundreds
    of MB) that this launching process then holds for the whole run, before a rank has started: forking every device
    cost that on each GPU. Other GPUs only ever run spawned ranks, which seed their own generators.
    """
    if not torch.cuda.is_available():
        return []
    if plan.accelerator == "gpu" and not from_profile:  # the probe runs there
        return [torch.device(PROBE_DEVICE)]
    return [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_initialized() else []


def _keeps_rng(check: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """Run `check` on a fork of torch's random state, so that the training after it draws the same numbers.

    A fresh probe seeds torch's generator and a cached one does not, so without the fork the same seed would train
    differently depending on the probe cache (the augmentation's own generator: `training_batches`). Of the CUDA
    generators, only those of `_forked_cuda_devices`.
    """

    @functools.wraps(check)
    def with_own_rng(cfg: Config, plan: Plan, *args: Any, **kwargs: Any) -> Verdict:
        devices = _forked_cuda_devices(plan, kwargs.get("from_profile", False))
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            return check(cfg, plan, *args, **kwargs)

    return with_own_rng


@_keeps_rng
def preflight_check(
    cfg: Config,
    plan: Plan,
    datamodule: HSIDataModule,
    *,
    single_device_only: bool = False,
    from_profile: bool = False,
    max_devices: int | None = None,
) -> Verdict:
    """Probe, measure or read the links, price every candidate plan and decide: the recipe's pre-flight.

    The probe uses the recipe's own batches and model; links are measured here or read from `preflight.topology`.
    GPUs that are not here are priced from `preflight.device`'s profile when given, else by links and memory only;
    `from_profile` prices from the profile even where the GPUs are here (benchmarks/gpu_smoke.py compares the two).
    `single_device_only` (a one-device fit) prices the requested device alone: no processes, no AMP probe.
    `max_devices` prices device counts up to it instead of up to this box's devices (`parallel.plan=auto` asks for
    every count `fit` can start, CPU processes included).
    """
    have = visible_devices(plan.accelerator)
    topology = load_topology(cfg.preflight.topology) if cfg.preflight.topology else None
    profile = _device_profile(cfg)
    absent = _absent(plan, have)
    if absent and topology is None:
        raise PreflightUndecided(
            f"cannot check {plan.describe()}: {absent}. To price its links and memory from a profile of the intended "
            f"machine, add preflight.topology=NAME (one of: {', '.join(list_topologies())}), and its compute too, for "
            f"a GO/NO-GO, with preflight.device=NAME (one of: {', '.join(list_devices())}); to check this box, "
            + (f"ask for at most {have} devices." if have else "use parallel.accelerator=cpu (gloo processes).")
        )
    bands, classes, patch = datamodule.num_bands, datamodule.num_classes, cfg.data.patch_size
    make_batch = training_batches(datamodule, cfg.train.seed)

    def model_factory() -> torch.nn.Module:
        return build_model(cfg, datamodule)

    tokenizer: dict[str, Any] = {}  # a band-group model's per-group work, which chag and rotation divide
    if has_band_groups(cfg.model.name):
        groups = model_factory().band_groups
        tokenizer = {
            "tokenizer_modules": TOKENIZER_MODULES,
            "band_group_sizes": [stop - start for start, stop in groups],  # type: ignore[union-attr]
        }
    cache_key = f"{cfg.model.name}-{cfg.model.size}-{bands}x{patch}x{patch}-c{classes}"

    def footprint_for(p: Plan) -> Footprint:
        return measure_footprint(model_factory, make_batch, batch_size=p.batch_size, precision=p.precision, **tokenizer)

    if plan.accelerator == "gpu" and (from_profile or not torch.cuda.is_available()):
        if profile is not None and topology is not None:
            counts_for = _counts_for(cfg, model_factory, make_batch, cache_key, tokenizer)
            return _price_from_profile(cfg, plan, profile, topology, footprint_for, counts_for, make_batch, classes)
        if from_profile:
            raise ConfigError("pricing from a device profile needs preflight.device=NAME and preflight.topology=NAME.")
        assert topology is not None  # `absent` is set for every GPU plan on a box without GPUs
        verdict = price_absent_devices(
            plan,
            footprint_for,
            topology,
            f"this box has no GPU, so the {plan.describe()} plan's step time cannot be timed here (add "
            f"preflight.device=NAME, one of {', '.join(list_devices())}, to price it from that GPU's datasheet)",
            chag_supported=has_band_groups(cfg.model.name),
        )
        verdict.reasons.append(f"links and device memory from the topology profile {cfg.preflight.topology!r}")
        return verdict

    probe_kwargs: dict[str, object] = {
        "cache_key": cache_key,
        "fresh": cfg.preflight.fresh,
        "steps": cfg.preflight.probe_steps,
        "measure_compression": plan.compression_enabled,
        "measure_fsdp": plan.fsdp,
    }
    probe_kwargs.update(tokenizer)
    notes = [f"links and device memory from the topology profile {cfg.preflight.topology!r}"] if topology else []
    if topology is not None:
        notes.append("training-loop cost of several ranks not measurable here: one local rank's figure is used")
    if profile is not None and plan.accelerator == "gpu":
        notes.append(
            f"preflight.device={profile.name} not used: compute measured on this box's "
            f"{torch.cuda.get_device_name(0)}, which takes precedence over a profile"
        )
    elif profile is not None:
        notes.append(
            f"preflight.device={profile.name} not used: the plan's devices are CPU processes, measured here "
            "(parallel.accelerator=gpu prices it on that GPU)"
        )

    def loop_seconds_for(p: Plan) -> float:
        # Ranks this box cannot start (other nodes, absent GPUs) are priced with one local rank's loop.
        runnable = topology is None and (p.accelerator == "cpu" or p.devices <= have)
        ranks = p.devices if runnable and p.num_nodes == 1 else 1
        return measure_step_overhead(Plan(devices=ranks, accelerator=p.accelerator), classes, fresh=cfg.preflight.fresh)

    verdict = run_preflight(
        plan,
        probe_for_plans(model_factory, make_batch, **probe_kwargs),
        None if topology else (lambda p: measure_links_for(p, fresh=cfg.preflight.fresh)),
        None if topology else functools.partial(_memory_bytes, plan.accelerator),
        cfg.preflight.min_efficiency,
        1
        if single_device_only
        else (None if topology else max(plan.devices, min(max_devices or have, MAX_PRICED_DEVICES))),
        topology=topology,
        chag_supported=has_band_groups(cfg.model.name),
        loop_seconds_for=loop_seconds_for,
        amp=not single_device_only,
    )
    verdict.reasons += notes
    return verdict


def _device_profile(cfg: Config) -> DeviceProfile | None:
    if not cfg.preflight.device:
        return None
    profile = load_device(cfg.preflight.device)
    return replace(profile, efficiency=cfg.preflight.device_efficiency) if cfg.preflight.device_efficiency else profile


def _counts_for(
    cfg: Config,
    model_factory: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    cache_key: str,
    tokenizer: dict[str, Any],
) -> Callable[[Plan], StepCounts]:
    def counts_for(plan: Plan) -> StepCounts:
        return count_step(
            model_factory,
            make_batch,
            precision=plan.precision,
            tokenizer_modules=tokenizer.get("tokenizer_modules", ()),
            cache_key=cache_key,
            fresh=cfg.preflight.fresh,
        )

    return counts_for


def _price_from_profile(
    cfg: Config,
    plan: Plan,
    profile: DeviceProfile,
    topology: Topology,
    footprint_for: Callable[[Plan], Footprint],
    counts_for: Callable[[Plan], StepCounts],
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    classes: int,
) -> Verdict:
    """GPUs that are not here, compute from the profile's roofline; host work (gather, loop) timed on this CPU."""
    gathers: dict[int, float] = {}

    def gather_seconds(batch_size: int) -> float:
        # The least of five after a warm-up: other work on this box only ever adds (it made some gathers 15× slower).
        if batch_size not in gathers:
            make_batch(batch_size)
            timed = [wall_seconds(lambda: make_batch(batch_size), torch.device("cpu")) for _ in range(5)]
            gathers[batch_size] = min(timed)
        return gathers[batch_size]

    def loop_seconds_for(p: Plan) -> float:
        return measure_step_overhead(Plan(accelerator="cpu"), classes, fresh=cfg.preflight.fresh)

    verdict = price_from_profile(
        plan,
        footprint_for,
        counts_for,
        gather_seconds,
        profile,
        topology,
        cfg.preflight.min_efficiency,
        chag_supported=has_band_groups(cfg.model.name),
        loop_seconds_for=loop_seconds_for,
    )
    verdict.reasons.append(
        f"host work timed on this CPU with one process, which the GPU box's own CPU does instead: the batch gather "
        f"({gather_seconds(plan.batch_size) * 1e3:.3g} ms at b{plan.batch_size}) and the training loop's own cost "
        f"(Lightning, metrics; {loop_seconds_for(plan) * 1e3:.3g} ms per micro-step)"
    )
    return verdict
