"""GO / NO-GO: compare every priced plan with the best single device and explain the decision in words.

E = ECD(N)/ECD(1) where ECD(1) is the best single-device plan at the same global batch (docs/design.md). A verdict on
devices that are not here (`whatif.py`) has no E: it is UNDECIDED unless memory alone rules the plan out, or unless
a device profile prices their compute (`roofline.py`), labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.plan import Plan
from hslite.preflight_check.price.chag_benefit import CHAG_ADOPT_GAIN, against_plain_dp
from hslite.preflight_check.price.costmodel import Prediction
from hslite.preflight_check.price.regime import DEFAULT_MIN_EFFICIENCY, LEVERS

NO_GO_EXIT_CODE = 3  # docs/design.md
UNDECIDED_EXIT_CODE = 4  # the plan's devices are not here: compute not measured, so neither GO nor NO-GO
IMPLAUSIBLE_CPU_EFFICIENCY = 1.2  # processes sharing cores cannot beat one process on all of them by much
CLEARLY_FASTER = 1.1  # a GO verdict names a faster passing plan only from this throughput ratio up


class PreflightRefused(HSLiteError):
    """The plan cannot be shown to pay (NO-GO)."""

    exit_code = NO_GO_EXIT_CODE


class PreflightUndecided(HSLiteError):
    """The plan's devices are not here and no profile says what they are: nothing can be priced."""

    exit_code = UNDECIDED_EXIT_CODE


def gib(n_bytes: float) -> str:
    """Bytes as GiB, or MiB below a tenth of one."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 / 10 else f"{n_bytes / 2**20:.2f} MiB"


@dataclass
class Verdict:
    """The decision on one requested plan, with its reasons and every priced alternative.

    Without `compute_measured` (devices that are not here) `efficiency`, `best_single` and `best_passing` are None,
    the rows carry link time and memory only, and `go` is None (undecided) unless memory alone says NO-GO; unless
    `compute_profile` is set, when a device profile's roofline priced the compute and the verdict is a full one.
    """

    go: bool | None
    requested: Plan
    efficiency: float | None  # E = ECD(requested) / ECD(best_single)
    min_efficiency: float
    reasons: list[str]
    best_single: Plan | None  # E's reference: the best single device that fits, else the best of the fewest that fit
    best_passing: Plan | None  # the fastest plan that passes (fits; E ≥ min_efficiency unless single-device)
    predictions: dict[Plan, Any] = field(repr=False)  # Prediction, or FootprintPrediction without compute
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)  # ranked: passing by samples/s first
    compute_measured: bool = True  # step times measured on the plan's own kind of device
    compute_profile: dict[str, Any] | None = None  # what a device profile priced compute with (roofline_summary)
    critical_params: dict[str, Any] | None = None  # P* per link (`critical.critical_params_report`)

    @property
    def compute_source(self) -> str:
        """Where step times come from: "measured", "profile:NAME" (a device profile's roofline) or "none"."""
        if self.compute_measured:
            return "measured"
        return f"profile:{self.compute_profile['profile']}" if self.compute_profile else "none"

    @property
    def decision(self) -> str:
        """GO, NO-GO or UNDECIDED."""
        return "UNDECIDED" if self.go is None else ("GO" if self.go else "NO-GO")

    @property
    def better_plan(self) -> Plan | None:
        """The plan to run instead: the fastest passing one when the requested plan is NO-GO, else None."""
        if self.go is False and self.best_passing is not None and self.best_passing != self.requested:
            return self.best_passing
        return None

    @property
    def exit_code(self) -> int:
        """0 for GO, 3 for NO-GO (docs/design.md), 4 when it cannot be decided on this box."""
        return {"GO": 0, "NO-GO": NO_GO_EXIT_CODE, "UNDECIDED": UNDECIDED_EXIT_CODE}[self.decision]

    def to_dict(self) -> dict[str, Any]:
        """Everything preflight.json records."""
        return {
            "decision": self.decision,
            "go": self.go,
            "exit_code": self.exit_code,
            "compute_measured": self.compute_measured,
            "compute_source": self.compute_source,
            "compute_profile": self.compute_profile,
            "requested": self.requested.describe(),
            "requested_plan": self.requested.to_dict(),
            "efficiency": self.efficiency,
            "min_efficiency": self.min_efficiency,
            "reasons": self.reasons,
            "best_single": self.best_single.describe() if self.best_single else None,
            "best_passing": self.best_passing.describe() if self.best_passing else None,
            "best_passing_plan": self.best_passing.to_dict() if self.best_passing else None,
            "better_plan": self.better_plan.describe() if self.better_plan else None,
            "critical_params": self.critical_params,
            "requested_prediction": self.predictions[self.requested].to_dict(),
            "rows": self.rows,
        }

    def render_table(self, limit: int | None = 15) -> Table:
        """Ranked plans as a rich Table (the requested one and the best passing one are marked)."""
        title = f"pre-flight: {self.decision} for {self.requested.describe()}"
        if self.compute_profile:
            title += f" (step times from the {self.compute_profile['profile']} profile's roofline, not measured)"
        table = Table(title=title)
        priced = self.compute_measured or self.compute_profile is not None  # the rows carry step times
        columns: tuple[str, ...]
        if priced:
            columns = ("plan", "step s", "samples/s", "ECD", "E", "regime", "memory/device", "fits", "passes")
        else:
            columns = ("plan", "link s/step", "grad MiB/rank/step", "memory/device", "fits")
        for name in columns:
            table.add_column(name, justify="left" if name == "plan" else "right")
        shown = self.rows[:limit] if limit else self.rows
        if not any(row["requested"] for row in shown):
            shown = shown + [row for row in self.rows if row["requested"]]
        for row in shown:
            mark = " ◀ requested" if row["requested"] else ""
            mark += " ★" if self.best_passing and row["plan"] == self.best_passing.describe() else ""
            memory = (gib(row["per_device_peak_bytes"]), "yes" if row["fits"] else "no")
            figures: tuple[str, ...]
            if priced:
                figures = (f"{row['step_seconds']:.4g}", f"{row['samples_per_second']:.4g}", f"{row['ecd']:.4g}",
                           f"{row['efficiency']:.2f}", row["regime"], *memory,
                           "yes" if row["passes"] else "no")  # fmt: skip
            else:
                figures = (f"{row['comm_seconds']:.3g}", f"{row['grad_bytes_per_step'] / 2**20:.3g}", *memory)
            table.add_row(row["plan"] + mark, *figures)
        return table


def _passes(plan: Plan, prediction: Prediction, efficiency: float, min_efficiency: float) -> bool:
    fits = prediction.fits_memory and prediction.mapping_refusal is None
    return fits and (plan.world_size == 1 or efficiency >= min_efficiency)


def decide(
    requested: Plan, predictions: dict[Plan, Prediction], min_efficiency: float = DEFAULT_MIN_EFFICIENCY
) -> Verdict:
    """GO when `requested` fits and E ≥ min_efficiency (single-device plans only need to fit); reasons in words."""
    if requested not in predictions:
        raise ConfigError(f"no prediction for the requested plan {requested.describe()}; price it before deciding.")
    singles = {p: pred for p, pred in predictions.items() if p.world_size == 1}
    if not singles:
        raise ConfigError("decide needs at least one single-device plan to measure efficiency against.")
    best_single = _reference(predictions, singles)
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
                "regime": pred.regime,
                **against_plain_dp(plan, predictions),
                "per_device_peak_bytes": pred.per_device_peak_bytes,
                "memory_budget_bytes": pred.memory_budget_bytes,
                "fits": pred.fits_memory,
                "mapping_refusal": pred.mapping_refusal,
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
    chag = against_plain_dp(requested, predictions)
    if chag["benefit_ratio"] is not None:
        verdict_word = "clears" if chag["clears_chag_rule"] else "misses"
        gain = chag["step_gain"]
        faster = f"{gain:.0%} faster" if gain >= 0 else f"{-gain:.0%} slower"
        reasons.append(
            f"channel groups against plain DP at the same global batch ({chag['plain_dp']}): R_agg = "
            f"{chag['benefit_ratio']:.2f}, the step {faster}: {verdict_word} the design's {CHAG_ADOPT_GAIN:.0%} rule "
            "(accuracy: `hslite compare measure=true` trains both)"
        )
    if best_single.world_size > 1:
        reasons.append(
            f"no single device fits this step: E is measured against {best_single.describe()}, the fastest of the "
            "fewest devices that fit it (ECD(N) of a plan that can train, not of one device that cannot)"
        )
    elif not predictions[best_single].fits_memory:
        reasons.append("no plan fits in memory: E is measured against an unconstrained single device")
    if best_passing is not None and best_passing != requested:
        better = predictions[best_passing]
        # on GO, only name an alternative that is clearly faster, not one within the model's noise
        if not go or better.samples_per_second >= CLEARLY_FASTER * predictions[requested].samples_per_second:
            reasons.append(
                f"better plan: {best_passing.describe()} at {better.samples_per_second:.4g} samples/s "
                f"(E = {efficiency[best_passing]:.2f}, {gib(better.per_device_peak_bytes)} per device)"
            )
    elif best_passing is None:
        reasons.append("no candidate plan passes: lower the batch size or use a device with more memory")
    return Verdict(
        go, requested, efficiency[requested], min_efficiency, reasons, best_single, best_passing, predictions, rows
    )


def _reference(predictions: dict[Plan, Prediction], singles: dict[Plan, Prediction]) -> Plan:
    """What E is measured against: the fastest single device that fits, else the fastest of the fewest that fit.

    When one device cannot hold the model (parameters, gradients and optimiser state beyond its memory), ECD(1)
    is that of a device that does not exist, and every plan that can train would fail against it; ECD(N)
    comparison is then made from the smallest layout that trains. With nothing fitting at all, the unconstrained
    single device remains (and nothing passes).
    """
    fitting = [p for p, pred in predictions.items() if pred.fits_memory]
    fewest = min((p.world_size for p in fitting), default=1)
    pool = [p for p in fitting if p.world_size == fewest] or list(singles)
    return max(pool, key=lambda p: predictions[p].ecd)


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
            f"{plan.describe()} needs {gib(pred.per_device_peak_bytes)} per device but only "
            f"{gib(pred.memory_budget_bytes)} is available ({remedy})"
        )
    if pred.mapping_refusal:
        reasons.append(pred.mapping_refusal)
    if plan.world_size == 1:
        if pred.fits_memory:
            reasons.append(f"single-device plan fits ({gib(pred.per_device_peak_bytes)}): always GO")
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
    reasons.append(f"{plan.describe()} is {pred.regime}: {LEVERS[pred.regime]}")
    return reasons
