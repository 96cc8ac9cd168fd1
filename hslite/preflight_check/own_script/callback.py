"""`PreflightGate`: a Lightning callback that refuses a plan that does not pay, before the first training step.

    trainer = pl.Trainer(accelerator="gpu", devices=4, strategy=CompressedDDPStrategy("int8"),
                         callbacks=[hslite.PreflightGate()])
    trainer.fit(MyModule(), datamodule=MyData())   # NO-GO: hslite.PreflightRefused on every rank, nothing trained

In `setup("fit")`, once the launcher has started every rank and before the model is moved or wrapped: global rank 0
reads one training batch and the Trainer's plan; every rank measures the links of the launched job with all-reduces
on it (the whole job, and the first k ranks for each smaller device count the verdict compares with); rank 0 probes
the module's own step on its device and prices the plans; the verdict is broadcast, logged (hyper-parameters
`preflight/*` and `preflight.json` in the logger's folder) and, when NO-GO, raised on every rank. The training loop's
own cost is read from what `hslite.preflight(module=...)` measured on this host before (measuring it needs a Trainer
of its own, which cannot start inside this one); where nothing was measured, the reasons say it is not priced. CPU
ranks' contention is timed by spawned processes, so the script needs its `__main__` guard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.plan import Plan
from hslite.preflight_check.decide.verdict import PreflightRefused, Verdict
from hslite.preflight_check.hardware.links import measure_launched_link
from hslite.preflight_check.measurements import LinkModel
from hslite.preflight_check.own_script.check import plan_of_trainer, preflight_module
from hslite.preflight_check.own_script.lightning_step import batch_rows
from hslite.preflight_check.price.candidates import candidate_plans
from hslite.preflight_check.price.regime import DEFAULT_MIN_EFFICIENCY
from hslite.process.caller_state import caller_state_kept


class PreflightGate(pl.Callback):
    """Price the Trainer's plan on the launched job before it trains, and refuse it when it does not pay.

    `min_efficiency`: the E = ECD(N)/ECD(1) a multi-device plan must reach (docs/design.md). `enforce=False` logs the
    verdict and trains anyway. `sample_batch`: a batch to probe with, where the Trainer's training loader should not
    be read early. After `setup`, `gate.verdict` holds the verdict on every rank.
    """

    def __init__(self, min_efficiency: float = DEFAULT_MIN_EFFICIENCY, *, enforce: bool = True, probe_steps: int = 5,
                 sample_batch: Any = None) -> None:  # fmt: skip
        self.min_efficiency = min_efficiency
        self.enforce = enforce
        self.probe_steps = probe_steps
        self.sample_batch = sample_batch
        self.verdict: Verdict | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Price the plan on the launched ranks and refuse it on every rank when NO-GO (fit only)."""
        if stage != "fit":
            return
        strategy = trainer.strategy
        leader = trainer.global_rank == 0
        batch = leader_plan = None
        if leader:
            batch = self.sample_batch if self.sample_batch is not None else _training_batch(trainer)
            leader_plan = plan_of_trainer(trainer, batch_rows(batch))
        plan = cast(Plan, strategy.broadcast(leader_plan))  # rank 0's, on every rank
        links = _launched_links(plan, strategy.root_device) if dist.is_available() and dist.is_initialized() else {}
        alone = LinkModel.no_cost()
        outcome: tuple[str, Any] = ("error", "")
        if leader:
            try:
                with caller_state_kept():  # the probe seeds and sets threads: the user's run goes on with its own
                    verdict = preflight_module(pl_module, batch, plan,
                                               link_for=lambda p: links.get(p.world_size, alone),
                                               max_devices=plan.devices, min_efficiency=self.min_efficiency,
                                               probe_steps=self.probe_steps, measure_loop=False)  # fmt: skip
                outcome = ("verdict", verdict)
            except HSLiteError as err:  # said on every rank, not only here while the others wait for a verdict
                outcome = ("error", str(err))
        kind, value = strategy.broadcast(outcome)
        if kind == "error":
            raise ConfigError(f"PreflightGate could not price this run: {value}")
        self.verdict = value
        log_dir = trainer.log_dir  # a broadcast from rank 0: every rank asks
        if leader:
            _record(trainer, value, log_dir)
        if self.enforce and value.go is False:
            better = f" Better: {value.better_plan.describe()}." if value.better_plan is not None else ""
            raise PreflightRefused(
                f"NO-GO for {value.requested.describe()}: {'; '.join(value.reasons[:3])}.{better} "
                "PreflightGate(enforce=False) trains anyway."
            )


def _training_batch(trainer: pl.Trainer) -> Any:
    """One batch of the loader the Trainer will train on (its DataModule's, or the module's own)."""
    try:
        loader = trainer.fit_loop._data_source.dataloader()
        return next(iter(loader))
    except (StopIteration, TypeError, AttributeError) as err:
        raise ConfigError(
            f"PreflightGate could not read a training batch ({type(err).__name__}: {err}); give it one: "
            "PreflightGate(sample_batch=batch)."
        ) from err


def _launched_links(plan: Plan, device: torch.device) -> dict[int, LinkModel]:
    """Every rank: the links of the launched job, and of its first k ranks for each smaller world the verdict prices.

    Every rank calls `new_group` for every k (torch.distributed asks that of all ranks), and only members time.
    """
    worlds = sorted({p.world_size for p in candidate_plans(plan, plan.devices)} - {1})
    rank, links = dist.get_rank(), {}
    for world in worlds:
        group = dist.group.WORLD if world == dist.get_world_size() else dist.new_group(list(range(world)))
        if rank < world:
            links[world] = measure_launched_link(group, world, device)
    return links


def _record(trainer: pl.Trainer, verdict: Verdict, log_dir: str | None) -> None:
    """The verdict in the logger (hyper-parameters `preflight/*`) and as preflight.json in its folder."""
    summary = {"preflight/decision": verdict.decision, "preflight/requested": verdict.requested.describe(),
               "preflight/efficiency": verdict.efficiency,
               "preflight/better_plan": verdict.better_plan.describe() if verdict.better_plan else None}  # fmt: skip
    for logger in trainer.loggers:
        logger.log_hyperparams(summary)
    if log_dir is not None:
        path = Path(log_dir) / "preflight.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict.to_dict(), indent=2))
