"""The pre-flight in one call: probe, measure or read the links, price every candidate plan, decide (docs/design.md).

    probe_for = probe_for_plans(model_factory, make_batch, ProbeOptions(cache_key="cnn3d-indian_pines"))
    verdict = run_preflight(plan, Sources(probe_for, measure_links_for, host_memory_bytes))  # or topology=...
    print(verdict.reasons); json.dump(verdict.to_dict(), f); sys.exit(verdict.exit_code)

Plans whose devices are not here go to `price_from_profile` when a GPU profile says what they are (compute from
its roofline), and to `price_absent_devices` otherwise: links and memory, no compute.
Everything arrives as a Plan and plain callables; the Config is read by `hslite.recipe.gate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.preflight_check.decide.verdict import Verdict, decide
from hslite.preflight_check.decide.whatif import decide_without_compute, predict_footprint
from hslite.preflight_check.hardware.device_profile import DeviceProfile
from hslite.preflight_check.hardware.topology import Topology
from hslite.preflight_check.measurements import Footprint, LinkModel, ProbeResult, StepCounts
from hslite.preflight_check.price.candidates import candidate_plans, largest_one_device_batch
from hslite.preflight_check.price.costmodel import Prediction, predict
from hslite.preflight_check.price.critical import critical_params_of_verdict
from hslite.preflight_check.price.regime import DEFAULT_MIN_EFFICIENCY
from hslite.preflight_check.price.roofline import profile_probe, profile_reasons, roofline_summary


@dataclass(frozen=True)
class Sources:
    """Where each figure the pre-flight prices with comes from: measured on this box, or read from a profile.

    `probe_for(plan)` is called once per distinct (precision, accelerator, CPU ranks per node, CUDA math, rotation)
    with a one-rank plan at the requested per-device batch and the plan's tf32, cudnn_benchmark and rotation; other
    batches come from the fitted c0 + c1·b (`probe_each_batch` asks it at each plan's own micro-batch instead: a
    profile prices any batch by formula, where a measured probe is timed at one and extrapolated).
    `probe_for_plans(factory, make_batch)` builds one (CPU ranks probed with the threads they will get).
    `device_memory_bytes` is one device's budget (host memory for CPU plans), or a callable read once, when the first
    plan is priced, after its probe and loop measurement: a GPU's free memory depends on what they left on it
    (`launcher_cuda.device_memory_bytes`). `link_for(plan)` gives the data-parallel link, once per distinct group:
    `measure_links_for` on this box, or a topology's `link_for`; `node_link_for` the link between nodes, for channel
    groups and hybrid sharding. `loop_seconds_for(plan)` is the training loop's cost per micro-step for the plan's
    ranks (once per distinct ranks and accelerator; `measure_step_overhead` on this box); without it the loop is not
    priced. `topology` fills in `link_for`, `node_link_for` and `device_memory_bytes` when they are not given.
    `cpu_cores`: the cores CPU ranks share (None: this machine's).
    """

    probe_for: Callable[[Plan], ProbeResult]
    link_for: Callable[[Plan], LinkModel] | None = None
    device_memory_bytes: int | Callable[[], int] | None = None
    topology: Topology | None = None
    node_link_for: Callable[[Plan], LinkModel] | None = None
    loop_seconds_for: Callable[[Plan], float] | None = None
    cpu_cores: int | None = None
    probe_each_batch: bool = False


@dataclass(frozen=True)
class Scope:
    """Which plans are candidates beside the requested one.

    `max_devices`: devices per node (None: the topology's, else the request's), in measured and what-if pricing
    alike; `chag_supported` and `band_groups`: the model splits into that many band groups, so channel-group plans
    are candidates; `amp=False` leaves AMP single-device plans out (a one-device fit on CPU need not pay for a bf16
    probe).
    """

    max_devices: int | None = None
    chag_supported: bool = False
    band_groups: int = 0
    amp: bool = True


def run_preflight(
    requested: Plan, sources: Sources, scope: Scope = Scope(), min_efficiency: float = DEFAULT_MIN_EFFICIENCY
) -> Verdict:
    """Probe, price every candidate and decide; the single entry point of the pre-flight check."""
    pricer = _Pricer(requested, sources)
    topology = sources.topology
    max_devices = scope.max_devices or (topology.gpus_per_node if topology else None) or requested.devices
    across_nodes = topology is not None and topology.per_layer_across_nodes
    predictions = _price_candidates(requested, pricer.price, scope, max_devices, across_nodes)
    verdict = decide(requested, predictions, min_efficiency)
    verdict.critical_params = critical_params_of_verdict(requested, predictions, pricer.plan_links,
                                                         pricer.probe_of(requested), topology, min_efficiency,
                                                         pricer.loop_seconds)  # fmt: skip
    return verdict


class _Pricer:
    """Prices plans from `sources`, asking each source once per distinct key and keeping what it said."""

    def __init__(self, requested: Plan, sources: Sources) -> None:
        topology = sources.topology
        self.link_for = sources.link_for or (topology.link_for if topology else None)
        self.node_link_for = sources.node_link_for or (topology.node_link_for if topology else None)
        self.memory_source = sources.device_memory_bytes or (topology.device_memory_bytes if topology else None)
        if self.link_for is None or self.memory_source is None:
            raise ConfigError(
                "run_preflight needs link_for and device_memory_bytes, or a topology profile that has both."
            )
        self.requested, self.sources = requested, sources
        self.memory: int | None = None
        self.probes: dict[tuple[Any, ...], ProbeResult] = {}
        self.links: dict[tuple[Any, ...], LinkModel] = {}
        self.loops: dict[tuple[Any, ...], float] = {}
        self.plan_links: dict[Plan, LinkModel] = {}  # each priced plan's data-parallel link, for P*

    def loop_seconds(self, plan: Plan) -> float:
        key = (plan.devices, plan.num_nodes, plan.accelerator)
        if self.sources.loop_seconds_for is not None and key not in self.loops:
            self.loops[key] = self.sources.loop_seconds_for(plan)
        return self.loops.get(key, 0.0)

    def memory_bytes(self) -> int:
        # Read once, when the first plan is priced: what a GPU has free depends on what its probe left there.
        if self.memory is None:
            source = self.memory_source
            self.memory = source() if callable(source) else int(source or 0)
        return self.memory

    def probe_of(self, plan: Plan) -> ProbeResult:
        """The probe `plan` is priced from: one rank of it, at the batch the probe is timed at."""
        requested = self.requested
        ranks_sharing_cores = plan.devices if plan.accelerator == "cpu" else 1  # sets the threads a CPU rank gets
        probe_batch = plan.batch_size if self.sources.probe_each_batch else requested.batch_size
        if (
            not self.sources.probe_each_batch
            and plan.accelerator == "cpu"
            and plan.world_size == 1 < requested.world_size
        ):
            # A lone CPU rank prices only one-device candidates, up to BATCH_SCALES' 4× the requested micro-batch;
            # probed at (b, b/2) it would extrapolate the biggest of them (usually the best) fourfold.
            probe_batch = largest_one_device_batch(requested)
        rotation = plan.rotation_groups  # CPU ranks time their channel-group meshes with it (ranks_together.py)
        key = (plan.precision, plan.accelerator, ranks_sharing_cores, probe_batch, plan.tf32, plan.cudnn_benchmark,
               rotation)  # fmt: skip
        if key not in self.probes:
            self.probes[key] = self.sources.probe_for(
                Plan(
                    devices=ranks_sharing_cores,
                    accelerator=plan.accelerator,
                    batch_size=probe_batch,
                    precision=plan.precision,
                    tf32=plan.tf32,
                    cudnn_benchmark=plan.cudnn_benchmark,
                    rotation_groups=rotation,
                )
            )
        return self.probes[key]

    def price(self, plan: Plan) -> Prediction:
        probe = self.probe_of(plan)
        link_key = (plan.devices, plan.num_nodes, plan.accelerator)
        if link_key not in self.links:
            self.links[link_key] = self.link_for(plan)  # type: ignore[misc]
        node_link = None
        if (plan.chag_enabled or plan.hybrid_shard) and self.node_link_for is not None:
            node_link = self.node_link_for(plan)
        # Measured before memory is read: a one-rank loop on a GPU trains in this process.
        ranks_loop_seconds = self.loop_seconds(plan)
        alone_loop_seconds = self.loop_seconds(Plan(accelerator=plan.accelerator))
        pred = predict(
            plan,
            probe,
            self.links[link_key],
            self.memory_bytes(),
            node_link=node_link,
            cpu_cores=self.sources.cpu_cores,
            loop_seconds=ranks_loop_seconds,
            alone_loop_seconds=alone_loop_seconds,
        )
        topology = self.sources.topology
        pred.mapping_refusal = topology.mapping_refusal(plan) if topology is not None else None
        self.plan_links[plan] = self.links[link_key]
        return pred


def price_absent_devices(
    requested: Plan,
    footprint_for: Callable[[Plan], Footprint],
    topology: Topology,
    why_unmeasured: str,
    scope: Scope = Scope(),
) -> Verdict:
    """Price a plan whose devices are not here from the model's sizes and a topology profile: links and memory only.

    `footprint_for(plan)` is called once per precision (`footprint.measure_footprint` counts the sizes on this CPU).
    The verdict is NO-GO when the requested plan cannot fit in the profile's device memory and UNDECIDED
    otherwise: compute of absent devices is not measured, so nothing is ranked by speed (docs/design.md, what-if).
    """
    footprints: dict[str, Footprint] = {}

    def price(plan: Plan) -> Any:
        if plan.precision not in footprints:
            footprints[plan.precision] = footprint_for(plan)
        node_link = topology.node_link_for(plan) if plan.chag_enabled or plan.hybrid_shard else None
        pred = predict_footprint(
            plan, footprints[plan.precision], topology.link_for(plan), topology.device_memory_bytes, node_link=node_link
        )
        pred.mapping_refusal = topology.mapping_refusal(plan)
        return pred

    most = scope.max_devices or topology.gpus_per_node
    predictions = _price_candidates(requested, price, scope, most, topology.per_layer_across_nodes)
    return decide_without_compute(requested, predictions, why_unmeasured)


def price_from_profile(
    requested: Plan,
    footprint_for: Callable[[Plan], Footprint],
    counts_for: Callable[[Plan], StepCounts],
    gather_seconds_for: Callable[[int], float],
    profile: DeviceProfile,
    topology: Topology,
    scope: Scope = Scope(),
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    loop_seconds_for: Callable[[Plan], float] | None = None,
) -> Verdict:
    """Price a plan whose GPUs are not here with compute from a device profile's roofline: a full GO / NO-GO.

    `footprint_for` and `counts_for` (the model's sizes, FLOPs and kernels, counted on this CPU) are called once per
    precision, `gather_seconds_for(b)` once per micro-batch; memory is the profile's, links the topology's. The
    verdict says where its compute came from (`compute_source`, `compute_profile` and a reason): not measured.
    """
    work: dict[str, tuple[Footprint, StepCounts]] = {}

    def probe_for(plan: Plan) -> ProbeResult:
        if plan.precision not in work:
            work[plan.precision] = (footprint_for(plan), counts_for(plan))
        return profile_probe(plan.batch_size, *work[plan.precision], profile, gather_seconds_for(plan.batch_size))

    sources = Sources(probe_for, device_memory_bytes=profile.memory_bytes, topology=topology,
                      loop_seconds_for=loop_seconds_for, probe_each_batch=True)  # fmt: skip
    verdict = run_preflight(requested, sources, scope, min_efficiency)
    _, counts = work[requested.precision]
    verdict.compute_measured = False
    verdict.compute_profile = roofline_summary(counts, profile, requested.batch_size)
    verdict.reasons[:0] = profile_reasons(verdict.compute_profile, requested.describe())
    verdict.reasons.append(
        f"device memory ({profile.memory_gib:g} GiB) from the {profile.name} profile, links from the topology "
        f"profile {topology.name!r}"
    )
    return verdict


def _price_candidates(
    requested: Plan, price: Callable[[Plan], Any], scope: Scope, max_devices: int, per_layer_across_nodes: bool
) -> dict[Plan, Any]:
    """Every candidate's price; FSDP joins the candidates when the requested plan does not fit (or asks for it)."""
    requested_prediction = price(requested)
    plans = candidate_plans(
        requested,
        max_devices,
        chag_supported=scope.chag_supported,
        band_groups=scope.band_groups,
        include_fsdp=not requested_prediction.fits_memory or requested.fsdp,
        per_layer_across_nodes=per_layer_across_nodes,
        amp=scope.amp,
        down_to_one=not requested_prediction.fits_memory,
    )
    predictions = {plan: price(plan) for plan in plans if plan != requested}
    predictions[requested] = requested_prediction
    return predictions
