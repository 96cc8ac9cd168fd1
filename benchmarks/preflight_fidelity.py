"""Pre-flight fidelity: the step time and efficiency it predicts against a real short `hslite fit` of the same plan.

    python benchmarks/preflight_fidelity.py            # the full matrix: 21 plans, and the references they lack
    python benchmarks/preflight_fidelity.py --quick    # 3 plans of the 1-D CNN (what the test runs)
    python benchmarks/preflight_fidelity.py --fresh    # every fit's pre-flight re-probes and re-measures its links
    python benchmarks/preflight_fidelity.py --only fsdp  # the rows whose label holds "fsdp"

Each plan is one fit of its own, so the full matrix takes a while on 2 cores; the run prints its rows' count and time.

On a shared machine, quote `--fresh`: a probe cached an hour earlier saw another load than the fit it predicts.

This file is the case matrix only: every plan is a row of `hslite compare` (hslite/compare/), measured as compare
measures, each row one `hslite fit` in a process of its own on this machine (gloo processes sharing its cores, the
synthetic Indian-Pines-shaped scene of the quickstart recipes: quickstart, quickstart_cpu2, quickstart_cpu4 by
process count). A row's prediction is the pre-flight its fit ran; its measurement is that fit's median step. E is
measured against the best measured one-process row of the same model, and compare adds a "(reference)" row for each
plan's best single-device plan (the one its verdict priced E against) that the matrix lacks. `holds` says whether the
verdict agreed with the measured E (GO iff E ≥ its threshold; one-process plans are GO by rule: "—").
The last line is compare's summary: `median prediction error: N%; verdict held on H of C multi-device rows (...)`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass

from hslite.compare.measure import run_compare
from hslite.compare.report import print_table, summary_line
from hslite.compare.rows import CompareOptions, RowSpec
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
    args = parser.parse_args()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hslite-fidelity-") as tmp:
        shared = [*COMMON_OVERRIDES, f"output.root={args.keep or tmp}", f"preflight.fresh={str(args.fresh).lower()}"]
        matrix = QUICK if args.quick else FULL
        cases = [case for case in matrix if args.only is None or args.only in str(case.row().label)]
        if not cases:
            parser.error(f"--only {args.only!r} matches no row of the matrix")
        options = CompareOptions([case.row() for case in cases], shared, measure=True, steps=STEPS)
        rows, folder = run_compare(options, progress=lambda line: print(line, flush=True))
    print()
    print_table(rows, measured=True)
    for row in rows:
        if row.failure:
            print(f"FAILED {row.label}: {row.failure}")
    print(f"{len(rows)} rows in {time.perf_counter() - started:.0f} s" + (f"; kept in {folder}" if args.keep else ""))
    errors = [(abs(row.error), row.label) for row in rows if row.error is not None]
    if errors:
        print("worst relative error: {:.0%} ({})".format(*max(errors)))
    print(summary_line(rows))
    return 1 if any(row.failure for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
