"""Pre-flight fidelity: the step time and efficiency it predicts against a real short `hslite fit` of the same plan.

    python benchmarks/preflight_fidelity.py            # full matrix, ~5 min on 2 cores with a warm cache
    python benchmarks/preflight_fidelity.py --quick    # 3 plans of the 1-D CNN, ~1 min (what the test runs)
    python benchmarks/preflight_fidelity.py --fresh    # re-probe and re-measure everything, ~12 min

On a shared machine, quote `--fresh`: a probe cached an hour earlier saw another load than the fit it predicts.

Every plan runs on this machine: gloo processes sharing its cores, on the synthetic Indian-Pines-shaped scene of the
quickstart recipes (quickstart, quickstart_cpu2, quickstart_cpu4 by process count). For each plan:
  predicted  the real pre-flight (`preflight_check`) on the plan's Config: the requested plan's step seconds, its E,
             its verdict, and the best single-device plan E is measured against;
  measured   `fit` of the same Config for a few dozen micro-batches: metrics["measured_step_seconds"] (median
             batch, start to next start, × accumulation; first batch skipped), the prediction beside it;
  E          measured ECD(plan) / measured ECD(best single), ECD = global batch / step seconds / ranks; the best
             single plan the verdict names is fitted too (once; it is listed as a "ref" row when not in the matrix).
The verdict "matches" when GO ⇔ measured E ≥ min_efficiency (single-device plans are GO by rule: "—").
The last line is `median relative error: N%` over |predicted − measured| / measured of every row.

Spawned DDP ranks re-import this file, so it keeps lightning out of its top level and runs under the main guard.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hslite.parallel.plan import Plan
    from hslite.recipe.config import Config

TRAIN_MICRO_BATCHES = 24  # per rank and run: the median of 23 steady batches settles within a few percent
COMMON_OVERRIDES = [
    "data.train_fraction=0.8",  # ~8,200 training pixels: enough for every plan's micro-batches in one epoch
    "data.val_fraction=0.1",
    "train.max_epochs=1",
    "train.limit_val_batches=2",
    "train.limit_test_batches=2",
    "train.progress=false",
    "output.save_map=false",
    "output.save_checkpoint=false",
    "preflight.enforce=false",  # NO-GO plans are run too: that is how a wrong verdict shows
]
RECIPE_FOR_DEVICES = {1: "quickstart", 2: "quickstart_cpu2", 4: "quickstart_cpu4"}


@dataclass(frozen=True)
class Case:
    """One plan to predict and run: model, per-device batch and the layout."""

    model: str
    size: str
    devices: int
    batch_size: int
    accumulate: int = 1
    precision: str = "32-true"
    chag: int = 1  # channel groups: ranks that split one batch's band groups
    rotation: int = 0  # band groups active per step under channel-subset rotation
    fsdp: bool = False  # parameters, gradients and optimiser state sharded over the ranks
    patch_size: int = 1  # both models read the centre spectrum, so no neighbours are gathered

    def overrides(self) -> list[str]:
        """Recipe overrides that set this plan."""
        return [
            f"model.name={self.model}",
            f"model.size={self.size}",
            f"data.patch_size={self.patch_size}",
            f"data.batch_size={self.batch_size}",
            f"parallel.devices={self.devices}",
            f"parallel.accumulate={self.accumulate}",
            f"parallel.precision={self.precision}",
            f"parallel.chag={self.chag}",
            f"parallel.rotation_groups={self.rotation}",
            f"parallel.fsdp={str(self.fsdp).lower()}",
            f"train.limit_train_batches={TRAIN_MICRO_BATCHES * max(1, self.accumulate // 2)}",  # ≥ 6 optimiser steps
        ]


QUICK = [
    Case("cnn1d", "small", 1, 64),
    Case("cnn1d", "small", 1, 16, accumulate=4),
    Case("cnn1d", "small", 2, 32),
]
FULL = [
    # 1-D CNN, 72k parameters: a few ms of compute, so fixed costs and the all-reduce latency decide
    *QUICK,
    Case("cnn1d", "small", 1, 64, precision="bf16-mixed"),
    Case("cnn1d", "small", 2, 32, precision="bf16-mixed"),
    Case("cnn1d", "small", 2, 32, accumulate=4),
    Case("cnn1d", "small", 4, 16),
    Case("cnn1d", "small", 2, 32, fsdp=True),
    # channel ViT small, 215k parameters
    Case("channel_vit", "small", 1, 64),
    Case("channel_vit", "small", 2, 32),
    Case("channel_vit", "small", 4, 16, accumulate=4),
    Case("channel_vit", "small", 2, 32, fsdp=True),
    # channel groups and rotation of the small channel ViT's 4 band groups
    Case("channel_vit", "small", 2, 32, chag=2),
    Case("channel_vit", "small", 4, 16, chag=2),
    Case("channel_vit", "small", 1, 64, rotation=2),
    Case("channel_vit", "small", 2, 32, chag=2, rotation=2),
    # channel ViT large, 6.4M parameters (25 MB of fp32 gradients): compute and the all-reduce both matter
    Case("channel_vit", "large", 1, 32),
    Case("channel_vit", "large", 2, 16),
    Case("channel_vit", "large", 2, 16, accumulate=4),
    Case("channel_vit", "large", 4, 8),
    Case("channel_vit", "large", 2, 16, fsdp=True),
]


@dataclass
class Row:
    """One plan's prediction and measurement."""

    label: str
    world_size: int
    global_batch: int
    predicted_seconds: float
    measured_seconds: float
    predicted_efficiency: float | None = None  # None for reference rows, which were not requested
    go: bool | None = None
    min_efficiency: float = 0.5
    measured_efficiency: float | None = None

    @property
    def relative_error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_seconds - self.measured_seconds) / self.measured_seconds

    @property
    def measured_ecd(self) -> float:
        """Measured global samples per second per rank."""
        return self.global_batch / self.measured_seconds / self.world_size


@contextlib.contextmanager
def _quiet(log_path: Path) -> Iterator[None]:
    """Send everything written to fds 1 and 2 (this process and the ranks it spawns) to a log file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _plan_overrides(plan: Plan) -> list[str]:
    return [
        f"data.batch_size={plan.batch_size}",
        f"parallel.devices={plan.devices}",
        f"parallel.accumulate={plan.accumulate}",
        f"parallel.precision={plan.precision}",
        f"parallel.compression={plan.compression}",
        f"parallel.chag={plan.chag}",
        f"parallel.rotation_groups={plan.rotation_groups}",
        f"parallel.fsdp={str(plan.fsdp).lower()}",
        f"train.limit_train_batches={TRAIN_MICRO_BATCHES * max(1, plan.accumulate // 2)}",
    ]


class Bench:
    """Runs the pre-flight and the fits, remembering measured plans so a shared best single plan runs once."""

    def __init__(self, root: Path, fresh: bool) -> None:
        self.root, self.fresh = root, fresh
        self.measured: dict[tuple[str, ...], float] = {}
        self.log_path = root / "fits.log"

    def config(self, recipe: str, overrides: list[str], fresh: bool = False) -> Config:
        from hslite.recipe.config import load_config

        extra = [f"output.root={self.root}", f"preflight.fresh={str(fresh).lower()}"]
        return load_config(recipe, COMMON_OVERRIDES + overrides + extra)

    def loop_milliseconds(self, ranks: list[int]) -> str:
        """The training loop's cost per synchronised micro-step the pre-flight measured (and cached) for each count."""
        from hslite.datasets.scenes import get_scene_spec
        from hslite.parallel.loop_cost import measure_step_overhead
        from hslite.parallel.plan import Plan

        classes = len(get_scene_spec(self.config(RECIPE_FOR_DEVICES[1], []).data.scene).class_names)
        return ", ".join(f"{n} rank(s) {1e3 * measure_step_overhead(Plan(devices=n), classes):.1f} ms" for n in ranks)

    def measure(self, recipe: str, overrides: list[str], key: tuple[str, ...]) -> tuple[float, float]:
        """(measured, fit's predicted) step seconds of one short fit; measured is remembered under `key`."""
        from hslite.run.fit import fit

        cfg = self.config(recipe, overrides)  # never fresh: the fit reads what the pre-flight just measured
        with _quiet(self.log_path):
            metrics = fit(cfg).metrics
        self.measured[key] = metrics["measured_step_seconds"]
        return metrics["measured_step_seconds"], metrics["predicted_step_seconds"]

    def run(self, case: Case) -> list[Row]:
        """The case's row, preceded by a reference row when its best single plan was not measured yet."""
        from hslite.recipe.gate import check_recipe

        recipe = RECIPE_FOR_DEVICES[case.devices]
        with _quiet(self.log_path):
            verdict = check_recipe(self.config(recipe, case.overrides(), fresh=self.fresh))
        model_key = (case.model, case.size, str(case.patch_size))
        rows = []
        best = verdict.best_single
        best_key = (*model_key, best.describe())
        if best_key not in self.measured and best != verdict.requested:
            measured, _ = self.measure(RECIPE_FOR_DEVICES[1], case.overrides() + _plan_overrides(best), best_key)
            label = f"{case.model}-{case.size} {best.describe()} (ref)"
            predicted = verdict.predictions[best].step_seconds
            rows.append(Row(label, 1, best.global_batch, predicted, measured))
        plan = verdict.requested
        measured, fit_predicted = self.measure(recipe, case.overrides(), (*model_key, plan.describe()))
        predicted = verdict.predictions[plan].step_seconds
        if not math.isclose(predicted, fit_predicted, rel_tol=1e-6):
            print(f"  note: fit's own pre-flight predicted {fit_predicted:.4g} s for {plan.describe()}")
        row = Row(
            f"{case.model}-{case.size} {plan.describe()}",
            plan.world_size,
            plan.global_batch,
            predicted,
            measured,
            verdict.efficiency,
            verdict.go,
            verdict.min_efficiency,
        )
        row.measured_efficiency = row.measured_ecd / (best.global_batch / self.measured[best_key])  # one rank
        rows.append(row)
        return rows


def _format(rows: list[Row]) -> list[str]:
    width = max(len(r.label) for r in rows)
    header = (
        f"{'plan':<{width}}  {'pred s':>9}  {'meas s':>9}  {'rel err':>8}  {'pred E':>6}  {'meas E':>6}  "
        f"{'verdict':>7}  {'matches':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        pred_e = "" if r.predicted_efficiency is None else f"{r.predicted_efficiency:.2f}"
        meas_e = "" if r.measured_efficiency is None else f"{r.measured_efficiency:.2f}"
        verdict = "" if r.go is None else ("GO" if r.go else "NO-GO")
        if r.go is None or r.measured_efficiency is None:
            matches = ""
        elif r.world_size == 1:
            matches = "—"
        else:
            matches = "yes" if r.go == (r.measured_efficiency >= r.min_efficiency) else "NO"
        lines.append(
            f"{r.label:<{width}}  {r.predicted_seconds:>9.4g}  {r.measured_seconds:>9.4g}  "
            f"{r.relative_error:>+8.0%}  {pred_e:>6}  {meas_e:>6}  {verdict:>7}  {matches:>7}"
        )
    return lines


def main() -> int:
    """Run the matrix, print the table and the error summary; 1 when a plan failed to run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 plans of the 1-D CNN (~1 min), for the tests")
    parser.add_argument("--fresh", action="store_true", help="re-probe and re-measure links instead of the cache")
    parser.add_argument("--keep", metavar="DIR", help="keep run folders and fits.log under DIR (default: a temp dir)")
    args = parser.parse_args()

    cases = QUICK if args.quick else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hslite-fidelity-") as tmp:
        bench = Bench(Path(args.keep or tmp), args.fresh)
        bench.root.mkdir(parents=True, exist_ok=True)
        rows: list[Row] = []
        failed = []
        for case in cases:
            print(f"[{time.perf_counter() - started:5.0f} s] {case.model}-{case.size} {case.devices} proc "
                  f"b{case.batch_size} acc{case.accumulate} {case.precision} chag{case.chag} rot{case.rotation}"
                  f"{' fsdp' if case.fsdp else ''}", flush=True)  # fmt: skip
            try:
                rows += bench.run(case)
            except Exception as err:  # one broken plan should not hide the others' figures
                failed.append(case)
                print(f"  FAILED: {type(err).__name__}: {err} (log: {bench.log_path})", flush=True)
                if not args.keep:
                    print("".join(bench.log_path.read_text(errors="replace").splitlines(True)[-20:]))
        print()
        if not rows:
            print("no plan ran")
            return 1
        print("\n".join(_format(rows)))
        errors = [abs(r.relative_error) for r in rows]
        verdicts = [r for r in rows if r.go is not None and r.world_size > 1]
        agree = sum(r.go == (r.measured_efficiency >= r.min_efficiency) for r in verdicts)
        print(f"\n{len(rows)} plans in {time.perf_counter() - started:.0f} s; verdicts matching the measured "
              f"efficiency: {agree}/{len(verdicts)} multi-process plans")  # fmt: skip
        loops = bench.loop_milliseconds(sorted({case.devices for case in cases}))
        print(f"training loop per micro-step, priced by the pre-flight: {loops}")
        worst = max(rows, key=lambda r: abs(r.relative_error))
        print(f"worst relative error: {abs(worst.relative_error):.0%} ({worst.label})")
        print(f"median relative error: {statistics.median(errors):.0%}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
