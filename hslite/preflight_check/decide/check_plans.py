"""The pre-flight in one call: probe, measure or read the links, price every candidate plan, decide (docs/design.md).

    probe_for = probe_for_plans(model_factory, make_batch, ProbeOptions(cache_key="cnn3d-indian_pines"))
    verdict = run_preflight(plan, probe_for, measure_links_for, host_memory_bytes)  # or topology=load_topology(..)
    print(verdict.reasons); json.dump(verdict.to_dict(), f); sys.exit(verdict.exit_code)

Plans whose devices are not here go to `price_from_profile` when a GPU profile says what they are (compute from
its roofline), and to `price_absent_devices` otherwise: links and memory, no compute.
Everything arrives as a Plan and plain callables; the Config is read by `hslite.recipe.gate`.
"""

from __future__ import annotations

from collections.abc import Callable
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


def run_preflight(
    requested: Plan,
    probe_for: Callable[[Plan], ProbeResult],
    link_for: Callable[[Plan], LinkModel] | None = None,
    device_memory_bytes: int | Callable[[], int] | None = None,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    max_devices: int | None = None,
    *,
    topology: Topology | None = None,
    node_link_for: Callable[[Plan], LinkModel] | None = None,
    chag_supported: bool = False,
    band_groups: int = 0,
    cpu_cores: int | None = None,
    loop_seconds_for: Callable[[Plan], float] | None = None,
    amp: bool = True,
    probe_each_batch: bool = False,
) -> Verdict:
    """Probe, price every candidate and decide; the single entry point of the pre-flight check.

    `probe_for(plan)` is called once per distinct (precision, accelerator, CPU ranks per node, CUDA math, rotation)
    with a one-rank plan at the requested per-device batch and the plan's tf32, cudnn_benchmark and rotation; other
    batches come from the fitted c0 + c1·b. `probe_for_plans(factory, make_batch)` builds one (CPU ranks probed with
    the threads they will get). `device_memory_bytes` is one device's budget (host memory for CPU plans), or a
    callable read once, when the first plan is priced, after its probe and loop measurement: a GPU's free memory
    depends on what they left on it (`launcher_cuda.device_memory_bytes`). `link_for(plan)` gives the data-parallel
    link, once per distinct group: `measure_links_for` on this box, or a topology's `link_for`.
    `loop_seconds_for(plan)` is the training loop's cost per micro-step for the plan's ranks (once per distinct
    ranks and accelerator; `measure_step_overhead` on this box); without it the loop is not priced.
    `topology` fills in `link_for`, `node_link_for`, `device_memory_bytes` (one device; host memory for CPU plans)
    and `max_devices` (devices per node) when they are not given; `max_devices` otherwise defaults to the request's.
    `amp=False` leaves AMP single-device plans out (a one-device fit on CPU need not pay for a bf16 probe).
    `probe_each_batch` asks `probe_for` at each plan's own micro-batch: a profile prices any batch by formula,
    where a measured probe is timed at one and extrapolated.
    """
    if topology is not None:
        link_for = link_for or topology.link_for
        node_link_for = node_link_for or topology.node_link_for
        device_memory_bytes = device_memory_bytes or topology.device_memory_bytes
        max_devices = max_devices or topology.gpus_per_node
    if link_for is None or device_memory_bytes is None:
        raise ConfigError("run_preflight needs link_for and device_memory_bytes, or a topology profile that has both.")
    memory_source = device_memory_bytes
    memory: list[int] = []
    probes: dict[tuple[Any, ...], ProbeResult] = {}
    links: dict[tuple[Any, ...], LinkModel] = {}
    loops: dict[tuple[Any, ...], float] = {}

    def loop_seconds(plan: Plan) -> float:
        key = (plan.devices, plan.num_nodes, plan.accelerator)
        if loop_seconds_for is not None and key not in loops:
            loops[key] = loop_seconds_for(plan)
        return loops.get(key, 0.0)

    def memory_bytes() -> int:
        # Read once, when the first plan is priced: what a GPU has free depends on what its probe left there.
        if not memory:
            memory.append(memory_source() if callable(memory_source) else memory_source)
        return memory[0]

    def price(plan: Plan) -> Prediction:
        ranks_sharing_cores = plan.devices if plan.accelerator == "cpu" else 1  # sets the threads a CPU rank gets
        probe_batch = plan.batch_size if probe_each_batch else requested.batch_size
        if not probe_each_batch and plan.accelerator == "cpu" and plan.world_size == 1 < requested.world_size:
            # A lone CPU rank prices only one-device candidates, up to BATCH_SCALES' 4× the requested micro-batch;
            # probed at (b, b/2) it would extrapolate the biggest of them (usually the best) fourfold.
            probe_batch = largest_one_device_batch(requested)
        cuda_math = (plan.tf32, plan.cudnn_benchmark)
        rotation = plan.rotation_groups  # CPU ranks time their channel-group meshes with it (ranks_together.py)
        probe_key = (plan.precision, plan.accelerator, ranks_sharing_cores, probe_batch, *cuda_math, rotation)
        if probe_key not in probes:
            probes[probe_key] = probe_for(
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
        link_key = (plan.devices, plan.num_nodes, plan.accelerator)
        if link_key not in links:
            links[link_key] = link_for(plan)
        node_link = None
        if (plan.chag_enabled or plan.hybrid_shard) and node_link_for is not None:
            node_link = node_link_for(plan)
        # Measured before memory is read: a one-rank loop on a GPU trains in this process.
        ranks_loop_seconds = loop_seconds(plan)
        alone_loop_seconds = loop_seconds(Plan(accelerator=plan.accelerator))
        pred = predict(
            plan,
            probes[probe_key],
            links[link_key],
            memory_bytes(),
            node_link=node_link,
            cpu_cores=cpu_cores,
            loop_seconds=ranks_loop_seconds,
            alone_loop_seconds=alone_loop_seconds,
        )
        pred.mapping_refusal = topology.mapping_refusal(plan) if topology is not None else None
        if plan == requested:
            priced_request.update(probe=probes[probe_key])
        plan_links[plan] = links[link_key]
        return pred

    priced_request: dict[str, Any] = {}  # the requested plan's probe, for P*
    plan_links: dict[Plan, LinkModel] = {}  # each priced plan's data-parallel link, for P*
    across_nodes = topology is not None and topology.per_layer_across_nodes
    predictions = _price_candidates(
        requested,
        price,
        max_devices or requested.devices,
        chag_supported,
        across_nodes,
        amp=amp,
        band_groups=band_groups,
    )
    verdict = decide(requested, predictions, min_efficiency)
    verdict.critical_params = critical_params_of_verdict(requested, predictions, plan_links, priced_request["probe"],
                                                         topology, min_efficiency, loop_seconds)  # fmt: skip
    return verdict


def price_absent_devices(
    requested: Plan,
    footprint_for: Callable[[Plan], Footprint],
    topology: Topology,
    why_unmeasured: str,
    *,
    chag_supported: bool = False,
    band_groups: int = 0,
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

    predictions = _price_candidates(requested, price, topology.gpus_per_node, chag_supported,
                                    topology.per_layer_across_nodes, band_groups=band_groups)  # fmt: skip
    return decide_without_compute(requested, predictions, why_unmeasured)


def price_from_profile(
    requested: Plan,
    footprint_for: Callable[[Plan], Footprint],
    counts_for: Callable[[Plan], StepCounts],
    gather_seconds_for: Callable[[int], float],
    profile: DeviceProfile,
    topology: Topology,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    *,
    chag_supported: bool = False,
    band_groups: int = 0,
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

    verdict = run_preflight(
        requested,
        probe_for,
        device_memory_bytes=profile.memory_bytes,
        min_efficiency=min_efficiency,
        topology=topology,
        chag_supported=chag_supported,
        band_groups=band_groups,
        loop_seconds_for=loop_seconds_for,
        probe_each_batch=True,
    )
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
    requested: Plan,
    price: Callable[[Plan], Any],
    max_devices: int,
    chag_supported: bool,
    per_layer_across_nodes: bool,
    amp: bool = True,
    band_groups: int = 0,
) -> dict[Plan, Any]:
    """Every candidate's price; FSDP joins the candidates when the requested plan does not fit (or asks for it)."""
    requested_prediction = price(requested)
    plans = candidate_plans(
        requested,
        max_devices,
        chag_supported=chag_supported,
        band_groups=band_groups,
        include_fsdp=not requested_prediction.fits_memory or requested.fsdp,
        per_layer_across_nodes=per_layer_across_nodes,
        amp=amp,
        down_to_one=not requested_prediction.fits_memory,
    )
    predictions = {plan: price(plan) for plan in plans if plan != requested}
    predictions[requested] = requested_prediction
    return predictions
