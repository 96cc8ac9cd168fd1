"""The pre-flight gate of a recipe: its Plan, its datamodule and model, this box's devices and links -> Verdict.

`hslite fit` and `hslite preflight` both call `preflight_check` once the config and the data are known to be good.
The probe times batches from the datamodule that trains (the same bands, PCA, patches and gather), and the model
comes from the same builder; the training-loop cost is measured by `parallel.loop_cost`, handed to the pre-flight as
a callable, so `preflight_check/` never builds a Trainer and never reads a Config. `preflight_check` picks one of three
ways to price: devices measured here, GPUs priced from a device profile, or links and memory only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hslite.datasets.datamodule import HSIDataModule
from hslite.errors import ConfigError
from hslite.parallel.box import visible_devices
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.rank_setup import quiet_lightning
from hslite.preflight_check.decide.check_plans import (
    Scope,
    Sources,
    price_absent_devices,
    price_from_profile,
    run_preflight,
)
from hslite.preflight_check.decide.verdict import PreflightUndecided, Verdict
from hslite.preflight_check.hardware.device_profile import DeviceProfile, list_devices, load_device
from hslite.preflight_check.hardware.launcher_cuda import device_memory_bytes, forked_cuda_devices
from hslite.preflight_check.hardware.links import measure_links_for
from hslite.preflight_check.hardware.topology import Topology, list_topologies, load_topology
from hslite.preflight_check.measure.fake_tensors import fake_mode
from hslite.preflight_check.measure.probe import ProbeOptions, probe_for_plans
from hslite.preflight_check.measure.step_counts import count_step
from hslite.preflight_check.measure.timers import wall_seconds
from hslite.preflight_check.measurements import StepCounts
from hslite.recipe.build import build_model, checked_rotation, plan_from_config, prepared_datamodule
from hslite.recipe.recipe_parts import RecipeParts
from hslite.recipe.schema import Config

MAX_PRICED_DEVICES = 16  # the largest box hslite is for


def check_recipe(cfg: Config, *, from_profile: bool = False) -> Verdict:
    """The pre-flight of a recipe on its own: plan and data validated first, then `preflight_check`."""
    plan = plan_from_config(cfg)
    quiet_lightning()
    datamodule = prepared_datamodule(cfg)
    with fake_mode():  # refuses band groups the plan cannot split or rotate, before any probe; allocates nothing
        checked_rotation(cfg, plan, datamodule, build_model(cfg, datamodule))
    return preflight_check(cfg, plan, datamodule, from_profile=from_profile)


def _keeps_rng(check: Callable[..., Verdict]) -> Callable[..., Verdict]:
    """Run `check` on a fork of torch's random state, so that the training after it draws the same numbers.

    A fresh probe seeds torch's generator and a cached one does not, so without the fork the same seed would train
    differently depending on the probe cache (the augmentation's own generator: `training_batches`). Of the CUDA
    generators, only those of `forked_cuda_devices`.
    """

    @functools.wraps(check)
    def with_own_rng(cfg: Config, plan: Plan, *args: Any, **kwargs: Any) -> Verdict:
        devices = forked_cuda_devices(plan, kwargs.get("from_profile", False))
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
    topology: Topology | None = None,
) -> Verdict:
    """Probe, measure or read the links, price every candidate plan and decide: the recipe's pre-flight.

    The probe uses the recipe's own batches and model; links are measured here or read from `preflight.topology`.
    GPUs that are not here are priced from `preflight.device`'s profile when given, else by links and memory only;
    `from_profile` prices from the profile even where the GPUs are here (benchmarks/gpu_smoke.py compares the two).
    `single_device_only` (a one-device fit) prices the requested device alone: no processes, no AMP probe.
    `max_devices` prices device counts up to it instead of up to this box's devices (`parallel.plan=auto` asks for
    every count `fit` can start, CPU processes included). `topology`: links measured on a launched job's own ranks
    (`preflight.job_links`), which replace `preflight.topology`'s.
    """
    have = visible_devices(plan.accelerator)
    if topology is None and cfg.preflight.topology:
        topology = load_topology(cfg.preflight.topology)
    profile = _device_profile(cfg)
    _check_decidable(plan, have, topology)
    compute_here = not (plan.accelerator == "gpu" and (from_profile or not torch.cuda.is_available()))
    if from_profile and (profile is None or topology is None):
        raise ConfigError("pricing from a device profile needs preflight.device=NAME and preflight.topology=NAME.")
    recipe = RecipeParts.of(cfg, plan, datamodule, have, topology, compute_here)
    if compute_here:
        return _measured(recipe, profile, single_device_only, max_devices)
    assert topology is not None  # `_check_decidable` asks for one for every GPU plan on a box without GPUs
    if profile is not None:
        return _priced_from_profile(recipe, profile, topology)
    return _priced_without_compute(recipe, topology)


def _check_decidable(plan: Plan, have: int, topology: Topology | None) -> None:
    """Refuse a plan whose devices are not here when no topology profile says what they would be.

    CPU "devices" are processes: any count can be started and measured here (sharing cores is what is priced).
    """
    if topology is not None:
        return
    if plan.num_nodes > 1:
        absent = f"the plan spans {plan.num_nodes} nodes and only this one is visible"
    elif plan.accelerator == "gpu" and plan.devices > have:
        absent = f"the plan needs {plan.devices} GPUs per node but this box has {have} visible"
    else:
        return
    raise PreflightUndecided(
        f"cannot check {plan.describe()}: {absent}. To price its links and memory from a profile of the intended "
        f"machine, add preflight.topology=NAME (one of: {', '.join(list_topologies())}), and its compute too, for "
        f"a GO/NO-GO, with preflight.device=NAME (one of: {', '.join(list_devices())}); to check this box, "
        + (f"ask for at most {have} devices." if have else "use parallel.accelerator=cpu (gloo processes).")
    )


def _measured(
    recipe: RecipeParts, profile: DeviceProfile | None, single_device_only: bool, max_devices: int | None
) -> Verdict:
    """The plan's devices are here: probe one, measure the links (or read them from the topology), price, decide."""
    cfg, plan, topology = recipe.cfg, recipe.plan, recipe.topology
    options = ProbeOptions(cache_key=recipe.cache_key, fresh=cfg.preflight.fresh, steps=cfg.preflight.probe_steps,
                           measure_compression=plan.compression_enabled, measure_fsdp=plan.fsdp,
                           band_group_sizes=recipe.band_group_sizes)  # fmt: skip
    probe_for = probe_for_plans(recipe.model_factory, recipe.make_batch, options)
    links_for = None if topology else (lambda p: measure_links_for(p, fresh=cfg.preflight.fresh))
    memory_bytes = None if topology else functools.partial(device_memory_bytes, plan.accelerator)
    most = max(plan.devices, min(max_devices or recipe.have, MAX_PRICED_DEVICES))
    priced_devices = 1 if single_device_only else (None if topology else most)  # a topology has its own count
    verdict = run_preflight(
        plan,
        Sources(probe_for, links_for, memory_bytes, topology=topology, loop_seconds_for=recipe.loop_seconds_for),
        Scope(
            max_devices=priced_devices,
            chag_supported=recipe.chag_supported,
            band_groups=recipe.band_groups,
            amp=not single_device_only,
        ),
        cfg.preflight.min_efficiency,
    )
    if topology is not None:
        verdict.reasons.append(recipe.topology_reason)
        verdict.reasons.append(
            f"training-loop cost timed with this job's {plan.world_size} ranks; other layouts priced with one local "
            "rank's loop"
            if topology.job_loop_seconds is not None
            else "training-loop cost of several ranks not measurable here: one local rank's figure is used"
        )
    if profile is not None:
        instead = (
            f"compute measured on this box's {torch.cuda.get_device_name(0)}, which takes precedence over a profile"
            if plan.accelerator == "gpu"
            else "the plan's devices are CPU processes, measured here (parallel.accelerator=gpu prices it on that GPU)"
        )
        verdict.reasons.append(f"preflight.device={profile.name} not used: {instead}")
    return verdict


def _priced_without_compute(recipe: RecipeParts, topology: Topology) -> Verdict:
    """GPUs that are not here and no profile of them: links and memory from the topology, compute undecided."""
    verdict = price_absent_devices(
        recipe.plan,
        recipe.footprint_for,
        topology,
        f"this box has no GPU, so the {recipe.plan.describe()} plan's step time cannot be timed here (add "
        f"preflight.device=NAME, one of {', '.join(list_devices())}, to price it from that GPU's datasheet)",
        Scope(chag_supported=recipe.chag_supported, band_groups=recipe.band_groups),
    )
    verdict.reasons.append(recipe.topology_reason)
    return verdict


def _device_profile(cfg: Config) -> DeviceProfile | None:
    if not cfg.preflight.device:
        return None
    profile = load_device(cfg.preflight.device)
    return profile.with_efficiency(cfg.preflight.device_efficiency) if cfg.preflight.device_efficiency else profile


def _priced_from_profile(recipe: RecipeParts, profile: DeviceProfile, topology: Topology) -> Verdict:
    """GPUs that are not here, compute from the profile's roofline; host work (gather, loop) timed on this CPU."""
    cfg, plan, make_batch = recipe.cfg, recipe.plan, recipe.make_batch
    gathers: dict[int, float] = {}

    def gather_seconds(batch_size: int) -> float:
        # The least of five after a warm-up: other work on this box only ever adds to a gather's time.
        if batch_size not in gathers:
            make_batch(batch_size)
            timed = [wall_seconds(lambda: make_batch(batch_size), torch.device("cpu")) for _ in range(5)]
            gathers[batch_size] = min(timed)
        return gathers[batch_size]

    def counts_for(p: Plan) -> StepCounts:
        return count_step(recipe.model_factory, make_batch, precision=p.precision, cache_key=recipe.cache_key,
                          band_groups=recipe.band_group_sizes is not None,
                          fresh=cfg.preflight.fresh)  # fmt: skip

    scope = Scope(chag_supported=recipe.chag_supported, band_groups=recipe.band_groups)
    verdict = price_from_profile(plan, recipe.footprint_for, counts_for, gather_seconds, profile, topology, scope,
                                 cfg.preflight.min_efficiency, recipe.loop_seconds_for)  # fmt: skip
    verdict.reasons.append(
        f"host work timed on this CPU with one process, which the GPU box's own CPU does instead: the batch gather "
        f"({gather_seconds(plan.batch_size) * 1e3:.3g} ms at b{plan.batch_size}) and the training loop's own cost "
        f"(Lightning, metrics; {recipe.loop_seconds_for(plan) * 1e3:.3g} ms per micro-step)"
    )
    return verdict
