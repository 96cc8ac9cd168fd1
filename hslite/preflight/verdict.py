"""GO / NO-GO: price every candidate plan, compare each with the best single device, explain the decision in words.

`run_preflight` is the one call the CLI and `fit` make:

    probe_for = probe_for_plans(model_factory, make_batch, cache_key="cnn3d-indian_pines")
    verdict = run_preflight(plan, probe_for, measure_links_for, host_memory_bytes)  # or topology=load_topology(..)
    print(verdict.reasons); json.dump(verdict.to_dict(), f); sys.exit(verdict.exit_code)

E = ECD(N)/ECD(1) where ECD(1) is the best single-device plan at the same global batch (DESIGN §3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.preflight.costmodel import Prediction, predict
from hslite.preflight.links import PER_LAYER_CROSS_NODE_MAX_RATIO, LinkModel, Topology
from hslite.preflight.probe import ProbeResult

AMP_PRECISION = "bf16-mixed"  # the AMP a single device is also priced with; fp16 on CPU runs as bf16 anyway
NO_GO_EXIT_CODE = 3  # DESIGN §3
IMPLAUSIBLE_CPU_EFFICIENCY = 1.2  # processes sharing cores cannot beat one process on all of them by much
CLEARLY_FASTER = 1.1  # a GO verdict names a faster passing plan only from this throughput ratio up
BATCH_SCALES = (4, 2, 1, 1 / 2, 1 / 4)  # per-device batch × scale, accumulation ÷ scale: same global batch


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 / 10 else f"{n_bytes / 2**20:.2f} MiB"


def _same_global_batch(plan: Plan) -> list[Plan]:
    """The plan with larger or smaller micro-batches and accumulation adjusted to keep its global batch."""
    out = []
    for scale in BATCH_SCALES:
        batch, accumulate = plan.batch_size * scale, plan.accumulate / scale
        if batch >= 1 and accumulate >= 1 and batch == int(batch) and accumulate == int(accumulate):
            out.append(plan.with_(batch_size=int(batch), accumulate=int(accumulate)))
    return out


def candidate_plans(
    requested: Plan,
    max_devices: int,
    *,
    chag_supported: bool = False,
    include_fsdp: bool = False,
    bandwidth_ratio: float = math.inf,
) -> list[Plan]:
    """Every layout worth pricing against `requested`, all at its global batch (where the sizes divide).

    One device with and without AMP and with accumulation; the requested layout; DP at 2..max_devices devices per
    node; int8/bf16 compression; batch/accumulation trades; FSDP when `include_fsdp`; channel groups inside a node
    when `chag_supported`. Per-layer communication (FSDP) crosses nodes only while `bandwidth_ratio` is below
    PER_LAYER_CROSS_NODE_MAX_RATIO (DESIGN §3 mapping).
    """
    requested.validate()
    micro_batches = requested.dp * requested.accumulate  # micro-batches of `batch_size` per optimiser step
    plans: list[Plan] = [requested]
    for precision in dict.fromkeys(("32-true", AMP_PRECISION, requested.precision)):
        single = requested.with_(devices=1, num_nodes=1, chag=1, fsdp=False, compression="none")
        plans += _same_global_batch(single.with_(precision=precision, accumulate=micro_batches))
    for nodes in dict.fromkeys((1, requested.num_nodes)):
        for devices in range(1, max_devices + 1):
            world = devices * nodes
            if world < 2 or micro_batches % world:
                continue
            base = requested.with_(
                devices=devices,
                num_nodes=nodes,
                chag=1,
                fsdp=False,
                compression="none",
                accumulate=micro_batches // world,
            )
            layouts = [base] + [base.with_(compression=c) for c in ("int8", "bf16")]
            if include_fsdp and (nodes == 1 or bandwidth_ratio < PER_LAYER_CROSS_NODE_MAX_RATIO):
                layouts.append(base.with_(fsdp=True))
            if chag_supported:  # chag ranks share a batch, so each optimiser step needs chag× the accumulation
                layouts += [
                    base.with_(chag=c, accumulate=base.accumulate * c)
                    for c in range(2, devices + 1)
                    if devices % c == 0
                ]
            for layout in layouts:
                plans += _same_global_batch(layout)
    return list(dict.fromkeys(plans))


@dataclass
class Verdict:
    """The decision on one requested plan, with its reasons and every priced alternative."""

    go: bool
    requested: Plan
    efficiency: float  # E = ECD(requested) / ECD(best single device)
    min_efficiency: float
    reasons: list[str]
    best_single: Plan
    best_passing: Plan | None  # the fastest plan that passes (fits; E ≥ min_efficiency unless single-device)
    predictions: dict[Plan, Prediction] = field(repr=False)
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)  # ranked: passing by samples/s first

    @property
    def exit_code(self) -> int:
        """0 for GO, 3 for NO-GO (DESIGN §3)."""
        return 0 if self.go else NO_GO_EXIT_CODE

    def to_dict(self) -> dict[str, Any]:
        """Everything preflight.json records."""
        return {
            "go": self.go,
            "exit_code": self.exit_code,
            "requested": self.requested.describe(),
            "requested_plan": self.requested.to_dict(),
            "efficiency": self.efficiency,
            "min_efficiency": self.min_efficiency,
            "reasons": self.reasons,
            "best_single": self.best_single.describe(),
            "best_passing": self.best_passing.describe() if self.best_passing else None,
            "best_passing_plan": self.best_passing.to_dict() if self.best_passing else None,
            "requested_prediction": self.predictions[self.requested].to_dict(),
            "rows": self.rows,
        }

    def render_table(self, limit: int | None = 15) -> Table:
        """Ranked plans as a rich Table (the requested one and the best passing one are marked)."""
        table = Table(title=f"pre-flight: {'GO' if self.go else 'NO-GO'} for {self.requested.describe()}")
        for name in ("plan", "step s", "samples/s", "ECD", "E", "memory/device", "fits", "passes"):
            table.add_column(name, justify="left" if name == "plan" else "right")
        shown = self.rows[:limit] if limit else self.rows
        if not any(row["requested"] for row in shown):
            shown = shown + [row for row in self.rows if row["requested"]]
        for row in shown:
            mark = " ◀ requested" if row["requested"] else ""
            mark += " ★" if self.best_passing and row["plan"] == self.best_passing.describe() else ""
            table.add_row(
                row["plan"] + mark,
                f"{row['step_seconds']:.4g}",
                f"{row['samples_per_second']:.4g}",
                f"{row['ecd']:.4g}",
                f"{row['efficiency']:.2f}",
                _gib(row["per_device_peak_bytes"]),
                "yes" if row["fits"] else "no",
                "yes" if row["passes"] else "no",
            )
        return table


def _passes(plan: Plan, prediction: Prediction, efficiency: float, min_efficiency: float) -> bool:
    return prediction.fits_memory and (plan.world_size == 1 or efficiency >= min_efficiency)


def decide(requested: Plan, predictions: dict[Plan, Prediction], min_efficiency: float = 0.5) -> Verdict:
    """GO when `requested` fits and E ≥ min_efficiency (single-device plans only need to fit); reasons in words."""
    if requested not in predictions:
        raise ConfigError(f"no prediction for the requested plan {requested.describe()}; price it before deciding.")
    singles = {p: pred for p, pred in predictions.items() if p.world_size == 1}
    if not singles:
        raise ConfigError("decide needs at least one single-device plan to measure efficiency against.")
    fitting = {p: pred for p, pred in singles.items() if pred.fits_memory} or singles
    best_single = max(fitting, key=lambda p: fitting[p].ecd)
    reference_ecd = predictions[best_single].ecd
    efficiency = {p: pred.ecd / reference_ecd for p, pred in predictions.items()}
    passing = [p for p, pred in predictions.items() if _passes(p, pred, efficiency[p], min_efficiency)]
    best_passing = max(passing, key=lambda p: (predictions[p].samples_per_second, -p.world_size), default=None)

    rows: list[dict[str, Any]] = []
    for plan, pred in predictions.items():
        rows.append(
            {
                "plan": plan.describe(),
                "step_seconds": pred.step_seconds,
                "samples_per_second": pred.samples_per_second,
                "ecd": pred.ecd,
                "efficiency": efficiency[plan],
                "per_device_peak_bytes": pred.per_device_peak_bytes,
                "memory_budget_bytes": pred.memory_budget_bytes,
                "fits": pred.fits_memory,
                "passes": plan in passing,
                "requested": plan == requested,
                "notes": pred.notes,
            }
        )
    rows.sort(key=lambda row: (not row["passes"], -row["samples_per_second"]))

    go = requested in passing
    reasons = _reasons(requested, predictions[requested], efficiency[requested], min_efficiency, best_single)
    if (
        requested.accelerator == "cpu"
        and requested.world_size > 1
        and efficiency[requested] > IMPLAUSIBLE_CPU_EFFICIENCY
    ):
        reasons.append(
            f"E = {efficiency[requested]:.2f} for processes sharing one CPU is implausible: the single-device probe "
            "was probably slowed by other load on this machine; re-measure (fresh) when it is idle"
        )
    if not any(pred.fits_memory for pred in singles.values()):
        reasons.append("no single-device plan fits in memory: E is measured against an unconstrained single device")
    if best_passing is not None and best_passing != requested:
        better = predictions[best_passing]
        # on GO, only name an alternative that is clearly faster, not one within the model's noise
        if not go or better.samples_per_second >= CLEARLY_FASTER * predictions[requested].samples_per_second:
            reasons.append(
                f"better plan: {best_passing.describe()} at {better.samples_per_second:.4g} samples/s "
                f"(E = {efficiency[best_passing]:.2f}, {_gib(better.per_device_peak_bytes)} per device)"
            )
    elif best_passing is None:
        reasons.append("no candidate plan passes: lower the batch size or use a device with more memory")
    return Verdict(
        go, requested, efficiency[requested], min_efficiency, reasons, best_single, best_passing, predictions, rows
    )


def _reasons(plan: Plan, pred: Prediction, efficiency: float, min_efficiency: float, best_single: Plan) -> list[str]:
    reasons = []
    if not pred.fits_memory:
        terms = pred.memory_breakdown_bytes
        states = terms.get("params", 0) + terms.get("grads", 0) + terms.get("optimizer", 0)
        remedy = (
            "parameters, gradients and optimiser state dominate: shard them with FSDP"
            if states >= terms.get("activations", 0)
            else "activations dominate: use a smaller batch with gradient accumulation, channel groups or rotation"
        )
        reasons.append(
            f"{plan.describe()} needs {_gib(pred.per_device_peak_bytes)} per device but only "
            f"{_gib(pred.memory_budget_bytes)} is available ({remedy})"
        )
    if plan.world_size == 1:
        if pred.fits_memory:
            reasons.append(f"single-device plan fits ({_gib(pred.per_device_peak_bytes)}): always GO")
        return reasons
    ranks = f"{plan.world_size} {'gloo processes' if plan.accelerator == 'cpu' else 'NCCL ranks'}"
    causes = []
    if pred.oversubscription > 1:
        causes.append(
            f"{ranks} share {pred.cpu_cores} cores, so each computes {pred.oversubscription:.1f}× slower than alone"
        )
    if pred.comm_seconds > 0.25 * pred.compute_seconds:
        causes.append(
            f"communication exposes {pred.comm_seconds * 1e3:.3g} ms per step against "
            f"{pred.compute_seconds * 1e3:.3g} ms of compute (r = {pred.r:.2f})"
        )
    verdict = "≥" if efficiency >= min_efficiency else "<"
    summary = f"predicted efficiency {efficiency:.2f} {verdict} {min_efficiency:g} against {best_single.describe()}"
    reasons.append("; ".join(causes) + ", " + summary if causes and efficiency < min_efficiency else summary)
    return reasons


def run_preflight(
    requested: Plan,
    probe_for: Callable[[Plan], ProbeResult],
    link_for: Callable[[Plan], LinkModel] | None = None,
    device_memory_bytes: int | None = None,
    min_efficiency: float = 0.5,
    max_devices: int | None = None,
    *,
    topology: Topology | None = None,
    chag_link_for: Callable[[Plan], LinkModel] | None = None,
    chag_supported: bool = False,
    cpu_cores: int | None = None,
    loop_seconds_for: Callable[[Plan], float] | None = None,
) -> Verdict:
    """Probe, price every candidate and decide; the single entry point of the pre-flight check.

    `probe_for(plan)` is called once per distinct (precision, accelerator, CPU ranks per node) with a one-rank plan
    at the requested per-device batch; other batches come from the fitted c0 + c1·b. `probe_for_plans(factory,
    make_batch)` builds one (CPU ranks probed with the threads they will get). `link_for(plan)` gives the
    data-parallel link, once per distinct group: `measure_links_for` on this box, or a topology's `link_for`.
    `loop_seconds_for(plan)` is the training loop's cost per micro-step for the plan's ranks (once per distinct
    ranks and accelerator; `measure_step_overhead` on this box); without it the loop is not priced.
    `topology` fills in `link_for`, `chag_link_for`, `device_memory_bytes` (one device; host memory for CPU plans)
    and `max_devices` (devices per node) when they are not given; `max_devices` otherwise defaults to the request's.
    """
    requested.validate()
    if topology is not None:
        link_for = link_for or topology.link_for
        chag_link_for = chag_link_for or topology.chag_link_for
        device_memory_bytes = device_memory_bytes or topology.device_memory_bytes
        max_devices = max_devices or topology.gpus_per_node
    if link_for is None or device_memory_bytes is None:
        raise ConfigError("run_preflight needs link_for and device_memory_bytes, or a topology profile that has both.")
    probes: dict[tuple[Any, ...], ProbeResult] = {}
    links: dict[tuple[Any, ...], LinkModel] = {}
    loops: dict[tuple[Any, ...], float] = {}

    def loop_seconds(plan: Plan) -> float:
        key = (plan.devices, plan.num_nodes, plan.accelerator)
        if loop_seconds_for is not None and key not in loops:
            loops[key] = loop_seconds_for(plan)
        return loops.get(key, 0.0)

    def price(plan: Plan) -> Prediction:
        ranks_sharing_cores = plan.devices if plan.accelerator == "cpu" else 1  # sets the threads a CPU rank gets
        probe_key = (plan.precision, plan.accelerator, ranks_sharing_cores)
        if probe_key not in probes:
            probes[probe_key] = probe_for(
                Plan(
                    devices=ranks_sharing_cores,
                    accelerator=plan.accelerator,
                    batch_size=requested.batch_size,
                    precision=plan.precision,
                )
            )
        link_key = (plan.dp, plan.devices, plan.num_nodes, plan.accelerator)
        if link_key not in links:
            links[link_key] = link_for(plan)
        chag_link = None
        if plan.chag_enabled and chag_link_for is not None:
            chag_link = chag_link_for(plan)
        pred = predict(
            plan,
            probes[probe_key],
            links[link_key],
            device_memory_bytes,
            chag_link=chag_link,
            cpu_cores=cpu_cores,
            loop_seconds=loop_seconds(plan),
            alone_loop_seconds=loop_seconds(Plan(accelerator=plan.accelerator)),
        )
        pred.notes += topology.mapping_notes(plan) if topology is not None else []
        return pred

    requested_prediction = price(requested)
    plans = candidate_plans(
        requested,
        max_devices or requested.devices,
        chag_supported=chag_supported,
        include_fsdp=not requested_prediction.fits_memory or requested.fsdp,
        bandwidth_ratio=topology.bandwidth_ratio if topology is not None else math.inf,
    )
    predictions = {plan: price(plan) for plan in plans if plan != requested}
    predictions[requested] = requested_prediction
    return decide(requested, predictions, min_efficiency)
