"""The pre-flight of a team's own LightningModule: its own step probed, the plan read from a Trainer, the verdict.

    verdict = hslite.preflight(module=MyModule(), datamodule=MyData(), plan={"devices": 2})
    verdict = hslite.preflight(module=MyModule(), sample_batch=batch, plan={"devices": 8}, device="rtx_3090",
                               topology="pcie4_8")   # GPUs that are not here, priced from their datasheet

The probe times the module's `training_step` and `configure_optimizers` (`preflight.lightning_step`) on one device,
the links are measured here (or handed in: `PreflightGate` measures the launched job's own), and `run_preflight`
prices every plan the way it prices a recipe's. Channel groups and rotation split hslite's band-group models inside
hslite's task, so a script's plan is data parallel (plain, compressed) or FSDP. With a device profile
(`preflight_module_on_profile`) the module's step is counted on fake tensors instead of timed, and priced on that
GPU's roofline, as a recipe's is with preflight.device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import lightning.pytorch as pl

from hslite.errors import ConfigError
from hslite.parallel.box import visible_devices
from hslite.parallel.plan import Accelerator, Compression, Plan, Precision
from hslite.preflight_check.decide.check_plans import Scope, Sources, price_from_profile, run_preflight
from hslite.preflight_check.decide.verdict import Verdict
from hslite.preflight_check.hardware.device_profile import load_device
from hslite.preflight_check.hardware.launcher_cuda import device_memory_bytes
from hslite.preflight_check.hardware.links import measure_links_for
from hslite.preflight_check.hardware.topology import Topology, load_topology
from hslite.preflight_check.measure.footprint import measure_footprint
from hslite.preflight_check.measure.loop_cost import cached_step_overhead, measure_step_overhead
from hslite.preflight_check.measure.probe import ProbeOptions, probe_for_plans
from hslite.preflight_check.measure.step_counts import count_step
from hslite.preflight_check.measurements import LinkModel
from hslite.preflight_check.own_script.lightning_step import lightning_workload
from hslite.preflight_check.price.regime import DEFAULT_MIN_EFFICIENCY

MAX_PRICED_DEVICES = 16  # the largest box hslite is for, as for a recipe
LOOP_CLASSES = 2  # the loop-cost stand-in's outputs: a script's own metrics are not known, so the fewest


def preflight_module(
    module: pl.LightningModule,
    batch: Any,
    plan: Plan,
    *,
    link_for: Callable[[Plan], LinkModel] | None = None,
    max_devices: int | None = None,
    topology: Topology | None = None,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    probe_steps: int = 5,
    measure_loop: bool = True,
    fresh: bool = False,
) -> Verdict:
    """Probe `module`'s own step on batches like `batch`, price `plan` and its alternatives, and decide.

    `plan.batch_size` is taken from `batch` (its rows are the per-device micro-batch). `link_for` defaults to
    measuring this box (cached, spawned ranks: a script needs its `if __name__ == "__main__":` guard) or, with
    `topology`, to that profile's. The training loop's own cost is measured with hslite's task around a linear layer
    in the plan's ranks (Lightning's loop and DDP's meeting at each all-reduce; the module's own logging is in its
    probed step); `measure_loop=False` reads only what an earlier measurement on this host cached (a caller inside a
    launched job cannot start a Trainer of its own) and prices no loop where there is none. The probe is not
    cached: a script's step is its code, which changes between runs.
    """
    workload = lightning_workload(module, batch)
    plan = plan.with_(batch_size=workload.batch_size)
    if plan.chag_enabled or plan.rotation_enabled:
        raise ConfigError(
            "channel groups and rotation split hslite's band-group models inside hslite's task; a script's own "
            "module trains them through the recipes (hslite.fit(..., model=YourModel)): set chag=1, rotation_groups=0."
        )
    shardable = hasattr(type(module), "FSDP_UNITS")
    options = ProbeOptions(
        step=workload.step,
        steps=probe_steps,
        measure_compression=plan.compression_enabled,
        measure_fsdp=plan.fsdp and shardable,
    )
    probe_for = probe_for_plans(workload.model_factory, workload.make_batch, options)
    if link_for is None and topology is None:
        link_for = functools.partial(measure_links_for, fresh=fresh)
    memory = None if topology else functools.partial(device_memory_bytes, plan.accelerator)
    most = max_devices or max(plan.devices, min(visible_devices(plan.accelerator), MAX_PRICED_DEVICES))

    unpriced_loops: list[str] = []

    def loop_seconds_for(p: Plan) -> float:
        if measure_loop:
            return measure_step_overhead(p, LOOP_CLASSES, fresh=fresh)
        cached = cached_step_overhead(p, LOOP_CLASSES)
        if cached is None:
            unpriced_loops.append(f"{p.devices}×{p.accelerator}")
        return cached or 0.0

    verdict = run_preflight(
        plan,
        Sources(probe_for, link_for, memory, topology=topology, loop_seconds_for=loop_seconds_for),
        Scope(max_devices=None if topology else most),
        min_efficiency,
    )
    verdict.reasons.append(
        f"probed: {workload.step.label}'s own training_step and configure_optimizers, on batches of "
        f"{workload.batch_size} rows cycled from one batch of its data (the DataLoader itself is not timed)"
    )
    if unpriced_loops:
        verdict.reasons.append(
            f"the training loop's own cost is not priced for {', '.join(unpriced_loops)} (not measured on this host "
            "yet: hslite.preflight(module=...) outside the Trainer measures and caches it)"
        )
    if plan.fsdp and not shardable:
        verdict.reasons.append(
            f"FSDP's own overhead not probed: {type(module).__name__} declares no FSDP_UNITS (the submodules to "
            "gather one at a time)"
        )
    return verdict


def preflight_module_on_profile(
    module: pl.LightningModule,
    batch: Any,
    plan: Plan,
    device: str,
    topology: str,
    *,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    fresh: bool = False,
) -> Verdict:
    """Price `module`'s own step on GPUs that are not here: the `device` profile's roofline, `topology`'s links.

    The step (its training_step and configure_optimizers, at the plan's precision and the batch's rows) is counted
    on fake tensors, so a model larger than this box costs no memory to price; the plan is priced on GPUs. The
    training loop's own cost is one CPU process's here, the host work the GPU box's own CPU does.
    """
    workload = lightning_workload(module, batch)
    plan = plan.with_(batch_size=workload.batch_size, accelerator="gpu")
    profile, box = load_device(device), load_topology(topology)

    def footprint_for(p: Plan):
        return measure_footprint(workload.model_factory, workload.make_batch, batch_size=p.batch_size,
                                 precision=p.precision, step=workload.step)  # fmt: skip

    def counts_for(p: Plan):
        return count_step(workload.model_factory, workload.make_batch, precision=p.precision, step=workload.step)

    def loop_seconds_for(_: Plan) -> float:
        return measure_step_overhead(Plan(), LOOP_CLASSES, fresh=fresh)

    verdict = price_from_profile(plan, footprint_for, counts_for, lambda batch_size: 0.0, profile, box, Scope(),
                                 min_efficiency, loop_seconds_for)  # fmt: skip
    verdict.reasons.append(
        f"counted: {workload.step.label}'s own training_step and configure_optimizers on fake tensors, at "
        f"{workload.batch_size} rows per device; the batch's gather (the script's own DataLoader) is not priced"
    )
    return verdict


def plan_of_trainer(trainer: pl.Trainer, batch_size: int) -> Plan:
    """The Plan a Trainer runs: its devices, nodes, precision, accumulation and strategy, at `batch_size` per device."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from hslite.parallel.strategies.ddp import CompressedDDPStrategy

    accelerators: dict[type, Accelerator] = {CPUAccelerator: "cpu", CUDAAccelerator: "gpu"}
    accelerator = accelerators.get(type(trainer.accelerator))
    strategy = trainer.strategy
    if accelerator is None:
        raise ConfigError(
            "the pre-flight prices CPU processes and CUDA GPUs; this Trainer runs on "
            f"{type(trainer.accelerator).__name__}."
        )
    fsdp = isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not fsdp:
        raise ConfigError(
            f"the pre-flight prices data parallelism (DDPStrategy, hslite.strategies.CompressedDDPStrategy) and FSDP "
            f"(FSDPStrategy, hslite.strategies.ShardedStrategy); this Trainer uses {type(strategy).__name__}."
        )
    compression = strategy.compression if isinstance(strategy, CompressedDDPStrategy) else "none"
    return Plan(devices=trainer.num_devices, num_nodes=trainer.num_nodes, accelerator=accelerator,
                batch_size=batch_size, accumulate=trainer.accumulate_grad_batches,
                precision=cast(Precision, str(trainer.precision)),  # a precision the Plan does not price is refused
                compression=cast(Compression, compression), fsdp=fsdp)  # fmt: skip


def plan_from(settings: Plan | Mapping[str, Any] | None) -> Plan:
    """A Plan from a Plan or a dict of its fields ({"devices": 4, "accelerator": "gpu"}); one device on CPU if None."""
    if settings is None or isinstance(settings, Plan):
        return settings or Plan()
    fields = set(Plan.__dataclass_fields__)
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ConfigError(f"plan has no field {', '.join(unknown)}; its fields are {', '.join(sorted(fields))}.")
    return Plan(**settings)


def first_batch(datamodule: pl.LightningDataModule) -> Any:
    """One batch of `datamodule`'s training loader (set up for "fit" first, as the Trainer would)."""
    datamodule.prepare_data()
    datamodule.setup("fit")
    try:
        return next(iter(datamodule.train_dataloader()))
    except StopIteration:
        raise ConfigError(f"{type(datamodule).__name__}.train_dataloader() yields no batch to probe.") from None
