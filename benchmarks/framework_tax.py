"""What hslite adds around a training step: its median step beside a hand-written torch loop's, model by model.

    python benchmarks/framework_tax.py                  # the quickstart and each model family on its data, ~3 min
    python benchmarks/framework_tax.py --quick          # two rows, fewer epochs: the path runs (tests use it)
    python benchmarks/framework_tax.py --profile cnn3d  # also cProfile one hslite epoch of that row: where time goes

Each row is the quickstart recipe (synthetic Indian-Pines-shaped scene, batch 64) with one model family. Both sides
train the model `recipe.build` builds, from the training loader `prepared_datamodule` makes (the same patch gather and
augmentation), with AdamW at the recipe's rate, on the same threads, in this one process, alternated over the
repeats so that a noisy machine slows both alike:
  hslite       `hslite fit`'s median step (metrics.json `median_batch_seconds`: from one batch's start to the next's,
               so the loader's fetch is in it), the recipe's settings as a user runs them, bar included
  hand loop    `for x, y in loader: zero_grad; loss(model(x), y).backward(); step`, timed the same way
The last line is the worst row's ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch

from hslite.optim import adamw
from hslite.parallel.box import threads_per_process
from hslite.recipe.build import build_task, plan_from_config, prepared_datamodule
from hslite.recipe.config import load_config
from hslite.run.fit import fit

MODELS = ("cnn3d", "cnn1d", "hybridsn", "ssftt", "spectralformer", "channel_vit")
# Rows off the quickstart's own settings: what each family needs to build on its 5x5 patches, and nothing else.
ROW_OVERRIDES = {"cnn1d": ["data.patch_size=1"], "hybridsn": ["data.patch_size=9"]}


def row_config(model: str, epochs: int, root: str):
    """The quickstart with `model`, training only (no refit, map or pre-flight: the step is what is compared)."""
    overrides = [f"model.name={model}", *ROW_OVERRIDES.get(model, []), f"train.max_epochs={epochs}",
                 "train.refit=false", "output.save_map=false", "preflight.enabled=false",
                 f"output.root={root}"]  # fmt: skip
    return load_config("quickstart", overrides)


def hslite_step(cfg) -> float:
    """`hslite fit`'s median step of this config, in seconds."""
    return float(fit(cfg).metrics["median_batch_seconds"])


def hand_loop_step(cfg, epochs: int) -> float:
    """The median step of a plain loop over the same model, loader, optimiser and threads."""
    plan = plan_from_config(cfg)
    torch.manual_seed(cfg.train.seed)
    datamodule = prepared_datamodule(cfg)
    model = build_task(cfg, plan, datamodule).model.train()
    optimiser = adamw(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)  # hslite's AdamW
    loss_fn = torch.nn.CrossEntropyLoss()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(plan))  # what hslite's ranks run with (RankSetup)
    steps: list[float] = []
    try:
        for _ in range(epochs):
            start = None
            for x, y in datamodule.train_dataloader():
                now = time.perf_counter()
                if start is not None:
                    steps.append(now - start)
                start = now
                optimiser.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimiser.step()
    finally:
        torch.set_num_threads(previous)
    return statistics.median(steps)


def profile_hslite(cfg, top: int = 25) -> None:
    """cProfile one short fit of `cfg`, by cumulative time: where hslite's step spends what the loop does not."""
    profiler = cProfile.Profile()
    profiler.runcall(fit, cfg)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two rows, two epochs, one repeat")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per measurement (the first is warm-up too)")
    parser.add_argument("--repeats", type=int, default=2, help="alternated measurements per side; the best is kept")
    parser.add_argument("--profile", choices=MODELS, help="also cProfile an hslite fit of this row")
    args = parser.parse_args()
    models = MODELS[:2] if args.quick else MODELS
    epochs, repeats = (2, 1) if args.quick else (args.epochs, args.repeats)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for model in models:
            cfg = row_config(model, epochs, root)
            ours, theirs = [], []
            for _ in range(repeats):
                theirs.append(hand_loop_step(cfg, epochs))
                ours.append(hslite_step(cfg))
            rows.append((model, min(ours), min(theirs)))
        if args.profile:
            profile_hslite(row_config(args.profile, epochs, root))
    print(f"\n{'model':<16}{'hslite step ms':>16}{'hand loop ms':>14}{'ratio':>8}")
    for model, ours, theirs in rows:
        print(f"{model:<16}{1e3 * ours:>16.2f}{1e3 * theirs:>14.2f}{ours / theirs:>7.2f}×")
    worst = max(rows, key=lambda row: row[1] / row[2])
    print(f"hslite step / hand-written loop: worst {worst[1] / worst[2]:.2f}× ({worst[0]})")


if __name__ == "__main__":
    main()
