"""parallel.plan=auto: train the fastest plan the pre-flight predicts on the devices present, and say why.

    cfg = load_config("compare_cpu_ddp2", ["parallel.plan=auto"])
    choice = choose_plan(cfg)   # prices every plan this box can start at the recipe's global batch
    print(choice.paragraph)     # `fit` does this itself when parallel.plan=auto, then trains choice.cfg

The candidates are the pre-flight's (one device with accumulation and AMP, data parallelism, compressed all-reduce,
channel groups for band-group models, FSDP when memory calls for it), on every device count `fit` can start here:
CPU processes up to CPU_PROCESSES_PER_CORE per core, where a manual pre-flight prices one per core. Plans the
model cannot split (chag not dividing its band groups) are left out. The chosen plan is decided once more as the
requested one, so preflight.json prices exactly the plan that trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from hslite.errors import ConfigError
from hslite.parallel.box import check_visible, startable_devices
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.rank_setup import quiet_lightning
from hslite.preflight_check.decide.verdict import CLEARLY_FASTER, PreflightRefused, Verdict, decide, gib
from hslite.recipe.build import (
    band_groups_for,
    build_task,
    check_model_for_plan,
    config_for_plan,
    plan_from_config,
    prepared_datamodule,
)
from hslite.recipe.gate import preflight_check
from hslite.recipe.schema import Config


@dataclass
class PlanChoice:
    """The plan auto chose, the search it came from and the config that trains it."""

    cfg: Config  # the recipe with the chosen layout written in (parallel.plan=manual): what trains
    search: Verdict  # the pre-flight of the recipe's own plan over every candidate; best_passing is the choice
    verdict: Verdict  # the same prices decided for the chosen plan: what preflight.json records
    paragraph: str

    @property
    def plan(self) -> Plan:
        """The chosen plan."""
        return self.verdict.requested

    def to_dict(self) -> dict[str, Any]:
        """What plan_choice.json records."""
        return {
            "paragraph": self.paragraph,
            "requested": self.search.requested.describe(),
            "chosen": self.plan.describe(),
            "chosen_plan": self.plan.to_dict(),
            "overrides": self.plan.overrides(),
            "search": self.search.to_dict(),
        }


def choose_plan(cfg: Config) -> PlanChoice:
    """Price every plan this box can train at the recipe's global batch; choose the fastest that fits and passes."""
    if not cfg.preflight.enabled:
        raise ConfigError(
            "parallel.plan=auto chooses the plan with the pre-flight check: drop preflight.enabled=false, "
            "or set parallel.plan=manual."
        )
    if cfg.preflight.topology:
        raise ConfigError(
            f"parallel.plan=auto chooses among the plans this box can train, and preflight.topology="
            f"{cfg.preflight.topology} prices another machine's links: drop one of them (`hslite preflight` prices "
            "other machines)."
        )
    requested = check_visible(plan_from_config(cfg))
    quiet_lightning()
    datamodule = prepared_datamodule(cfg)
    model = build_task(cfg, requested, datamodule).model  # the recipe's own plan and model are refused before any probe
    most = startable_devices(requested.accelerator)
    priced = preflight_check(cfg, requested, datamodule, max_devices=most)
    groups = band_groups_for(cfg, datamodule, model)
    trainable = {p: pred for p, pred in priced.predictions.items() if _splits(p, model, groups)}
    search = decide(requested, trainable, priced.min_efficiency)
    if search.best_passing is None:
        raise PreflightRefused(f"parallel.plan=auto found no plan that fits and passes: {'; '.join(search.reasons)}.")
    chosen = fewest_devices_near_best(search)
    verdict = decide(chosen, trainable, priced.min_efficiency)
    return PlanChoice(config_for_plan(cfg, chosen), search, verdict, explain(search, chosen, most))


def fewest_devices_near_best(search: Verdict) -> Plan:
    """The passing plan on the fewest devices whose predicted throughput is within CLEARLY_FASTER of the best's.

    A gain smaller than the pre-flight's own error (its median against real fits: benchmarks/preflight_fidelity.py) is
    no reason to take more devices: they are the ones that wait on each other when the prediction was optimistic.
    """
    assert search.best_passing is not None
    plans = {plan.describe(): plan for plan in search.predictions}
    passing = [plans[str(row["plan"])] for row in search.rows if row["passes"]]
    fastest = search.predictions[search.best_passing].samples_per_second
    near = [p for p in passing if CLEARLY_FASTER * search.predictions[p].samples_per_second >= fastest]
    return min(near, key=lambda p: (p.world_size, -search.predictions[p].samples_per_second))


def _splits(plan: Plan, model: nn.Module, groups: list[tuple[int, int]]) -> bool:
    try:
        check_model_for_plan(plan, model, groups)
    except ConfigError:
        return False
    return True


_KINDS = {  # what a candidate set holds, in words
    "one device": lambda p: p.world_size == 1,
    "accumulation": lambda p: p.accumulate > 1,
    "bf16 AMP": lambda p: p.precision != "32-true",
    "data parallelism": lambda p: p.dp > 1 and not p.fsdp,
    "compressed all-reduce": lambda p: p.compression_enabled,
    "channel groups": lambda p: p.chag_enabled,
    "FSDP": lambda p: p.fsdp,
}


def explain(search: Verdict, chosen: Plan, most_devices: int) -> str:
    """One paragraph: what was priced, why `chosen` (the search's best passing plan), the recipe's plan, the next."""
    requested, predictions = search.requested, search.predictions
    pred = predictions[chosen]
    passing = [row for row in search.rows if row["passes"]]
    kinds = ", ".join(kind for kind, holds in _KINDS.items() if any(holds(p) for p in predictions))
    devices = "CPU processes" if chosen.accelerator == "cpu" else "GPUs"
    efficiency = next(row["efficiency"] for row in search.rows if row["plan"] == chosen.describe())
    text = [
        f"parallel.plan=auto priced {len(predictions)} plans for the recipe's global batch of {requested.global_batch} "
        f"on 1 to {most_devices} {devices} ({kinds}); {len(passing)} fit in memory and pass the gate. It trains "
        f"{chosen.describe()}, {_why(search, chosen)}: predicted {pred.step_seconds * 1e3:.3g} ms per optimiser step, "
        f"{pred.samples_per_second:.4g} samples/s ({pred.ecd:.4g} per device, E = {efficiency:.2f}), "
        f"{gib(pred.per_device_peak_bytes)} per device of {gib(pred.memory_budget_bytes)}."
    ]
    if chosen == requested:
        text.append("It is the layout the recipe asks for.")
    else:
        slower = predictions[requested].step_seconds / pred.step_seconds
        text.append(
            f"The recipe's own {requested.describe()} is predicted {slower:.2f}× slower per step "
            f"(its pre-flight: {search.decision}, {search.reasons[0]})."
        )
    best = search.best_passing
    if best is not None and best != chosen:
        text.append(
            f"The fastest, {best.describe()}, is predicted only "
            f"{predictions[best].samples_per_second / pred.samples_per_second - 1:.0%} faster on {best.world_size} "
            f"devices: less than the {CLEARLY_FASTER - 1:.0%} a prediction must clear to be worth more devices."
        )
        return " ".join(text)
    runner_up = next((row for row in passing if row["plan"] != chosen.describe()), None)
    if runner_up is not None:
        slower = pred.samples_per_second / runner_up["samples_per_second"] - 1
        text.append(f"The next best, {runner_up['plan']}, is predicted {slower:.0%} slower.")
    return " ".join(text)


def _why(search: Verdict, chosen: Plan) -> str:
    if chosen == search.best_passing:
        return "the fastest of them"
    return f"the plan on the fewest devices within {CLEARLY_FASTER - 1:.0%} of the fastest"
