"""Pre-flight fidelity: the step time and efficiency it predicts against a real short `hslite fit` of the same plan.

    python benchmarks/preflight_fidelity.py            # the full matrix: 21 plans, and the references they lack
    python benchmarks/preflight_fidelity.py --quick    # 3 plans of the 1-D CNN (what the test runs)
    python benchmarks/preflight_fidelity.py --fresh    # every fit's pre-flight re-probes and re-measures its links
    python benchmarks/preflight_fidelity.py --only fsdp  # the rows whose label holds "fsdp"
    python benchmarks/preflight_fidelity.py --fresh --repeat 3  # 3 passes: error of each row's medians, and spread

Each plan is one fit of its own, so the full matrix takes a while on 2 cores; the run prints its rows' count and time.

On a shared machine, quote `--fresh`: a probe cached an hour earlier saw another load than the fit it predicts.

This file is the case matrix only: every plan is a row of `hslite compare` (hslite/comparison/), measured as compare
measures, each row one `hslite fit` in a process of its own on this machine (gloo processes sharing its cores, the
synthetic Indian-Pines-shaped scene of the quickstart recipes: quickstart, quickstart_cpu2, quickstart_cpu4 by
process count). A row's prediction is the pre-flight its fit ran; its measurement is that fit's median step. E is
measured against the best measured one-process row of the same model, and compare adds a "(reference)" row for each
plan's best single-device plan (the one its verdict priced E against) that the matrix lacks. `holds` says whether the
verdict agreed with the measured E (GO iff E ≥ its threshold; one-process plans are GO by rule: "—").
The last line is compare's summary: `median prediction error: N%; verdict held on H of C multi-device rows (...)`.

One pass's error mixes the prediction's error with the box's: a shared VM's step times drift by a third between runs
minutes apart, on the pre-flight's probe and on the fit alike. `--repeat K` runs the matrix K times, one pass after
another (so each row's runs are minutes apart), and prints per row the median and range of the predicted and of the
measured step, the error of the two medians, and `moved`: how far the row's own measurement ranged (max/min − 1).
An error inside `moved` is one the box, not the model, can account for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from hslite.comparison.measure import run_compare
from hslite.comparison.report import print_table, summary_line
from hslite.comparison.rows import CompareOptions, CompareRow, RowSpec
from hslite.parallel.plan import Plan

STEPS = 22  # timed optimiser steps per row: with compare's 2 of warm-up, the 24 batches a median settles on here
COMMON_OVERRIDES = [
    "data.train_fraction=0.8",  # ~8,200 training pixels: an epoch holds every plan's timed steps
    "data.val_fraction=0.1",
]
RECIPE_FOR_DEVICES = {1: "quickstart", 2: "quickstart_cpu2", 4: "quickstart_cpu4"}


@dataclass(frozen=True)
class Case:
    """One plan to predict and run: the model and the layout."""

    model: str
    size: str
    plan: Plan
    patch_size: int = 1  # both models read the centre spectrum, so no neighbours are gathered

    def overrides(self) -> list[str]:
        """Recipe overrides that set this plan."""
        model = [
            f"model.name={self.model}",
            f"model.size={self.size}",
            f"data.patch_size={self.patch_size}",
            "data.pca_components=0",
            "data.augment=false",
        ]  # the same work whichever recipe a row starts from
        return [*model, *self.plan.overrides().split()]

    def row(self) -> RowSpec:
        """This case as a row of `hslite compare`."""
        return RowSpec(f"{self.model}-{self.size} {self.plan.describe()}", RECIPE_FOR_DEVICES[self.plan.devices],
                       self.overrides())  # fmt: skip


QUICK = [
    Case("cnn1d", "small", Plan(devices=1, batch_size=64)),
    Case("cnn1d", "small", Plan(devices=1, batch_size=16, accumulate=4)),
    Case("cnn1d", "small", Plan(devices=2, batch_size=32)),
]
FULL = [
    # 1-D CNN, 72k parameters: a few ms of compute, so fixed costs and the all-reduce latency decide
    *QUICK,
    Case("cnn1d", "small", Plan(devices=1, batch_size=64, precision="bf16-mixed")),
    Case("cnn1d", "small", Plan(devices=2, batch_size=32, precision="bf16-mixed")),
    Case("cnn1d", "small", Plan(devices=2, batch_size=32, accumulate=4)),
    Case("cnn1d", "small", Plan(devices=4, batch_size=16)),
    Case("cnn1d", "small", Plan(devices=2, batch_size=32, fsdp=True)),
    # channel ViT small, 215k parameters
    Case("channel_vit", "small", Plan(devices=1, batch_size=64)),
    Case("channel_vit", "small", Plan(devices=2, batch_size=32)),
    Case("channel_vit", "small", Plan(devices=4, batch_size=16, accumulate=4)),
    Case("channel_vit", "small", Plan(devices=2, batch_size=32, fsdp=True)),
    # channel groups and rotation of the small channel ViT's 4 band groups
    Case("channel_vit", "small", Plan(devices=2, batch_size=32, chag=2)),
    Case("channel_vit", "small", Plan(devices=4, batch_size=16, chag=2)),
    Case("channel_vit", "small", Plan(devices=1, batch_size=64, rotation_groups=2)),
    Case("channel_vit", "small", Plan(devices=2, batch_size=32, chag=2, rotation_groups=2)),
    # channel ViT large, 6.4M parameters (25 MB of fp32 gradients): compute and the all-reduce both matter
    Case("channel_vit", "large", Plan(devices=1, batch_size=32)),
    Case("channel_vit", "large", Plan(devices=2, batch_size=16)),
    Case("channel_vit", "large", Plan(devices=2, batch_size=16, accumulate=4)),
    Case("channel_vit", "large", Plan(devices=4, batch_size=8)),
    Case("channel_vit", "large", Plan(devices=2, batch_size=16, fsdp=True)),
]


def main() -> int:
    """Run the matrix through `hslite compare`, print its table and summary; 1 when a plan failed to run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 plans of the 1-D CNN, for the tests")
    parser.add_argument("--fresh", action="store_true", help="re-probe and re-measure links instead of the cache")
    parser.add_argument("--keep", metavar="DIR", help="keep the compare folder (runs, logs) under DIR (default: temp)")
    parser.add_argument("--only", metavar="TEXT", help="the rows whose label holds TEXT (e.g. fsdp, chag2)")
    parser.add_argument(
        "--repeat", type=int, default=1, metavar="K", help="K passes: medians per row, and their spread"
    )
    args = parser.parse_args()

    started = time.perf_counter()
    cases = [
        case for case in (QUICK if args.quick else FULL) if args.only is None or args.only in str(case.row().label)
    ]
    if not cases:
        parser.error(f"--only {args.only!r} matches no row of the matrix")
    passes: list[list[CompareRow]] = []
    for index in range(args.repeat):
        prefix = f"[pass {index + 1}] " if args.repeat > 1 else ""
        with tempfile.TemporaryDirectory(prefix="hslite-fidelity-") as tmp:
            root = (f"{args.keep}/pass{index + 1}" if args.repeat > 1 else args.keep) if args.keep else tmp
            shared = [*COMMON_OVERRIDES, f"output.root={root}", f"preflight.fresh={str(args.fresh).lower()}"]
            options = CompareOptions([case.row() for case in cases], shared, measure=True, steps=STEPS)
            rows, _ = run_compare(options, progress=lambda line, prefix=prefix: print(prefix + line, flush=True))
        passes.append(rows)
        print()
        print_table(rows, measured=True)
        for row in rows:
            if row.failure:
                print(f"FAILED {row.label}: {row.failure}")
        if args.repeat > 1:
            print(f"pass {index + 1}: {summary_line(rows)}")
    print(
        f"{sum(map(len, passes))} rows in {time.perf_counter() - started:.0f} s"
        + (f"; kept in {args.keep}" if args.keep else "")
    )
    errors = _row_errors(passes)
    if errors:
        print("worst relative error: {:.0%} ({})".format(*max((abs(error), label) for label, error in errors.items())))
    if args.repeat == 1:
        print(summary_line(passes[0]))
    elif errors:
        held = [row.verdict_holds for rows in passes for row in rows if row.verdict_holds is not None]
        print(
            f"median prediction error: {statistics.median(abs(error) for error in errors.values()):.0%} (of the rows' "
            f"medians); verdict held on {sum(held)} of {len(held)} multi-device rows over {args.repeat} passes"
        )
    return 1 if any(row.failure for rows in passes for row in rows) else 0


def _row_errors(passes: list[list[CompareRow]]) -> dict[str, float]:
    """Each measured row's error of its median prediction against its median measurement (one pass: its error).

    With several passes, prints them as a table: predicted and measured medians with their ranges, and `moved`.
    """
    timed: dict[str, list[tuple[float, float]]] = {}
    for rows in passes:
        for row in rows:
            if row.predicted_step_seconds is not None and row.measured_step_seconds is not None:
                timed.setdefault(row.label, []).append((row.predicted_step_seconds, row.measured_step_seconds))
    errors, width = {}, max(map(len, timed), default=3)
    if len(passes) > 1:
        print(f"\n{'row':<{width}} {'predicted ms':>22} {'measured ms':>22} {'error':>6} {'moved':>6}")
    for label, pairs in timed.items():
        predicted, measured = ([pair[i] * 1e3 for pair in pairs] for i in (0, 1))
        errors[label] = statistics.median(predicted) / statistics.median(measured) - 1
        if len(passes) > 1:
            print(f"{label:<{width}} {_spread(predicted):>22} {_spread(measured):>22} {errors[label]:>+6.0%} "
                  f"{max(measured) / min(measured) - 1:>6.0%}")  # fmt: skip
    return errors


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]"


if __name__ == "__main__":
    sys.exit(main())
