"""What hslite adds around a training step: its median step beside a hand-written torch loop's, model by model.

    python benchmarks/framework_tax.py                  # the quickstart and each model family on its data, ~3 min
    python benchmarks/framework_tax.py --quick          # two rows, fewer epochs: the path runs (tests use it)
    python benchmarks/framework_tax.py --profile cnn3d  # also cProfile one hslite fit of that row: where time goes

Each row is the quickstart recipe (synthetic Indian-Pines-shaped scene, batch 64) with one model family. Both sides
train the model `recipe.build` builds, from the training loader `prepared_datamodule` makes (the same patch gather and
augmentation), with AdamW at the recipe's rate, on the same threads, in this one process, alternated over the
repeats so that a noisy machine slows both alike:
  hslite       `hslite fit`'s median step (metrics.json `median_batch_seconds`: from one batch's start to the next's,
               so the loader's fetch is in it), the recipe's settings as a user runs them, bar included
  hand loop    `for x, y in loader: zero_grad; loss(model(x), y).backward(); step`, timed the same way
  Lightning    the same model and optimiser in a bare LightningModule (training_step = the loss), a Trainer with no
               logger, bar or validation and hslite's step timer as its one callback: what Lightning's loop itself
               adds, the floor under hslite's
The ratio is hslite's step over the hand loop's. Then the whole quickstart command (`hslite fit`, as a newcomer runs
it) by phase: the imports it needs (in a fresh interpreter), and inside `fit` the data, the pre-flight, training,
refit, evaluation, and map and files (timed by wrapping the functions `hslite.run.fit` calls); what is not training
or refit is printed as `outside training: N.N s`. The last line is the worst row's step ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch

from hslite.optim import adamw
from hslite.parallel.box import threads_per_process
from hslite.parallel.timing import TrainThroughput
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


class BareModule(pl.LightningModule):
    """The loss of the model and hslite's AdamW, nothing else."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.model, self.lr, self.weight_decay = model, lr, weight_decay
        self.loss = torch.nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):  # noqa: D102
        x, y = batch
        return self.loss(self.model(x), y)

    def configure_optimizers(self):  # noqa: D102
        return adamw(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def bare_lightning_step(cfg, epochs: int) -> float:
    """The median step of a bare LightningModule over the same model, loader, optimiser and threads."""
    plan = plan_from_config(cfg)
    torch.manual_seed(cfg.train.seed)
    datamodule = prepared_datamodule(cfg)
    module = BareModule(build_task(cfg, plan, datamodule).model, cfg.train.lr, cfg.train.weight_decay)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(plan))
    timer = TrainThroughput()  # hslite's step timer, the one behind median_batch_seconds: the same span measured
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[timer])  # fmt: skip
    try:
        trainer.fit(module, train_dataloaders=datamodule.train_dataloader())
    finally:
        torch.set_num_threads(previous)
    return float(trainer.callback_metrics["perf/median_batch_seconds"])


IMPORTS = "import time; t = time.perf_counter(); import hslite.cli, lightning.pytorch; print(time.perf_counter() - t)"
# hslite.run.fit's names of each phase's functions: they are wrapped there, where fit looks them up
PHASES = {"data": ("prepared_datamodule", "build_task"), "pre-flight": ("_gate",), "refit": ("refit",),
          "evaluation": ("predictions",),
          "map and files": ("write_scene_outputs", "write_json", "print_summary")}  # fmt: skip


def command_phases(root: str, fresh: bool) -> dict[str, float]:
    """Seconds of each phase of the quickstart command: imports, then fit's phases, training and the rest.

    `fresh`: the pre-flight measures again, as on a box's first run (preflight.fresh=true); else it reads its cache.
    """
    import hslite.run.fit as fit_module

    imports = float(subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True).stdout)
    seconds = dict.fromkeys(["imports", *PHASES, "training", "other"], 0.0)
    seconds["imports"] = imports
    active: list[str] = []  # a phase's own calls (refit's Trainer.fit, its build_task) count as that phase

    def timed(phase: str, function):
        def wrapper(*args, **kwargs):
            if active:
                return function(*args, **kwargs)
            active.append(phase)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - start
                active.pop()

        return wrapper

    originals = {name: getattr(fit_module, name) for names in PHASES.values() for name in names}
    trainer_fit = pl.Trainer.fit
    for phase, names in PHASES.items():
        for name in names:
            setattr(fit_module, name, timed(phase, originals[name]))
    pl.Trainer.fit = timed("training", trainer_fit)
    try:
        start = time.perf_counter()
        fit(load_config("quickstart", [f"output.root={root}", f"preflight.fresh={str(fresh).lower()}"]))
        whole = time.perf_counter() - start
    finally:
        pl.Trainer.fit = trainer_fit
        for name, function in originals.items():
            setattr(fit_module, name, function)
    seconds["other"] = whole - sum(value for key, value in seconds.items() if key not in ("imports", "other"))
    return seconds


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
            ours, theirs, floor = [], [], []
            for _ in range(repeats):
                theirs.append(hand_loop_step(cfg, epochs))
                floor.append(bare_lightning_step(cfg, epochs))
                ours.append(hslite_step(cfg))
            rows.append((model, min(ours), min(theirs), min(floor)))
        first, again = command_phases(root, fresh=True), command_phases(root, fresh=False)
        if args.profile:
            profile_hslite(row_config(args.profile, epochs, root))
    print(f"\n{'model':<16}{'hslite step ms':>16}{'hand loop ms':>14}{'ratio':>8}{'Lightning ms':>14}{'ratio':>8}")
    for model, ours, theirs, floor in rows:
        print(f"{model:<16}{1e3 * ours:>16.2f}{1e3 * theirs:>14.2f}{ours / theirs:>7.2f}×{1e3 * floor:>14.2f}"
              f"{floor / theirs:>7.2f}×")  # fmt: skip
    print(f"\nthe quickstart command (`hslite fit`), by phase, s:{'first run':>14}{'cached':>9}")
    for phase in first:
        print(f"  {phase:<40}{first[phase]:>9.1f}{again[phase]:>9.1f}")
    outside = [sum(p.values()) - p["training"] - p["refit"] for p in (first, again)]
    print(f"outside training: {outside[0]:.1f} s (first run; {outside[1]:.1f} s with the pre-flight's cache)")
    worst = max(rows, key=lambda row: row[1] / row[2])
    print(f"hslite step / hand-written loop: worst {worst[1] / worst[2]:.2f}× ({worst[0]})")


if __name__ == "__main__":
    main()
