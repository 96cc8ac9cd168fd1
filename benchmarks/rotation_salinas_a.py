"""Channel-subset rotation on real Salinas-A: accuracy, step time and activation memory against full-band training.

    python benchmarks/rotation_salinas_a.py --data-root ../shared/data        # ~2.5 min on 2 cores
    python benchmarks/rotation_salinas_a.py --data-root ../shared/data --seeds 0 1 2

The salinas_a_1gpu recipe (10 % stratified training pixels) with the small channel ViT at patch 5 and its 4 band
groups, one device. Rows: full band for E epochs; rotation with k = 2 of G = 4 groups for E epochs (the same
optimiser steps, so each group gets half the updates) and for 2E epochs (each group as many updates as full band).
Per row: test OA (mean over seeds), the median training step, train seconds, and the bytes one step saves for
backward (activations, counted as the pre-flight's probe counts them) on a training batch.
The last line is `rotation k/G=1/2 OA vs full band: ... points` for the equal-updates row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

EPOCHS = 40
ROWS = (("full band", 0, 1), ("rotation 2/4, same steps", 2, 1), ("rotation 2/4, same updates per group", 2, 2))


def _activation_bytes(cfg, rotation: int) -> int:
    import torch

    from hslite.preflight_check.measure.activations import SavedTensorCounter
    from hslite.recipe.build import build_task, plan_from_config, prepared_datamodule
    from hslite.recipe.recipe_parts import training_batches

    datamodule = prepared_datamodule(cfg)
    task = build_task(cfg, plan_from_config(cfg), datamodule)
    x, _ = training_batches(datamodule, 0)(cfg.data.batch_size)
    counter = SavedTensorCounter(task.model)
    with counter, torch.enable_grad():
        task.training_logits(x) if rotation else task(x)
    return counter.total_bytes


def main() -> int:
    """Train each row for every seed and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="folder holding salinas_a/ (e.g. ../shared/data)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()

    from hslite.recipe.config import load_config
    from hslite.run.fit import fit

    lines = []
    results = {}
    with tempfile.TemporaryDirectory(prefix="hslite-rotation-") as tmp:
        for label, rotation, epoch_factor in ROWS:
            runs = []
            for seed in args.seeds:
                cfg = load_config("salinas_a_1gpu", [
                    f"data.root={args.data_root}", "model.name=channel_vit", "data.patch_size=5",
                    f"parallel.rotation_groups={rotation}", f"train.max_epochs={EPOCHS * epoch_factor}",
                    f"train.seed={seed}", "train.progress=false", "output.save_map=false", f"output.root={tmp}",
                ])  # fmt: skip
                runs.append(fit(cfg).metrics)
            memory = _activation_bytes(cfg, rotation)
            oa = statistics.mean(m["OA"] for m in runs)
            step = statistics.median(m["median_batch_seconds"] for m in runs)
            seconds = statistics.mean(m["train_seconds"] for m in runs)
            results[label] = oa
            lines.append(f"{label:<38} {EPOCHS * epoch_factor:>6} {100 * oa:>7.2f} {1e3 * step:>8.1f} "
                         f"{seconds:>8.1f} {memory / 1e6:>8.2f}")  # fmt: skip
    print(f"Salinas-A, channel_vit small, patch 5, seeds {args.seeds}")
    print(f"{'row':<38} {'epochs':>6} {'OA %':>7} {'step ms':>8} {'train s':>8} {'act MB':>8}")
    print("\n".join(lines))
    gap = 100 * (results[ROWS[2][0]] - results[ROWS[0][0]])
    print(f"rotation k/G=1/2 OA vs full band: {gap:+.2f} points (same updates per group)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
