"""Channel groups: step time, activation memory and exchanged bytes for chag = 1/2/4 beside the predictions.

    python benchmarks/channel_groups.py             # ~3 min on 2 cores
    python benchmarks/channel_groups.py --batch 64 --patch 9 --groups 4
    python benchmarks/channel_groups.py --batch 8 --patch 3 --chags 2   # the path, quickly (the test runs it)

Model: channel_vit small on the synthetic Indian-Pines-shaped scene (200 bands after water-band removal; 8 band
groups aligned to VIS/NIR/SWIR-1/SWIR-2, as recipe indian_pines_8gpu_chag), one batch shared by the chag ranks
(dp = 1). For each chag:
  predicted  the real pre-flight (`check_recipe`) of that plan: step seconds, activation bytes per rank (its
             memory breakdown) and the channel-group bytes per step (Prediction.chag_bytes_per_step);
  measured   step seconds of a short `hslite fit` of the same plan (median batch; an `hslite compare` row),
             and in chag spawned gloo ranks the same model on one training batch: the most bytes a rank saves
             for backward (what the probe counts as activations; ranks own regions of different sizes) and the
             bytes a rank's group-token exchange (all-to-all, forward and backward) writes per step.
The last line is `chag=4 activation memory: N% of chag=1` (measured; the largest chag asked for). Spawned ranks
re-import this file, so the work runs under the main guard.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # preflight_fidelity, its neighbour


def _rank(rank: int, world: int, init_file: str, model_kwargs: dict, batch: tuple, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hslite.models import get_model
    from hslite.parallel.channels.channel_groups import ChannelGroups
    from hslite.preflight_check.measure.activations import SavedTensorCounter

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "chag"))
    torch.manual_seed(0)
    model = get_model("channel_vit", **model_kwargs)
    sizes = [stop - start for start, stop in model.band_groups]
    groups = ChannelGroups(sizes, world, rank, mesh.get_group("chag"))
    x, y = batch
    counter = SavedTensorCounter(model)
    with counter:
        logits = groups(model, x) if world > 1 else model(x)
    torch.nn.functional.cross_entropy(logits, groups.own_samples(y) if world > 1 else y).backward()
    Path(f"{out}.{rank}").write_text(json.dumps({"saved": counter.total_bytes, "received": groups.bytes_received}))
    dist.destroy_process_group()


def measure_ranks(chag: int, model_kwargs: dict, batch: tuple, root: Path) -> dict:
    """For one training step with `chag` ranks: the most bytes a rank saves, and rank 0's (largest slice) exchange.

    The band groups follow the spectral regions, so ranks own different numbers of bands: the largest is the peak.
    """
    import torch.multiprocessing as mp

    out = root / f"ranks{chag}.json"
    mp.spawn(_rank, args=(chag, str(root / f"init{chag}"), model_kwargs, batch, str(out)), nprocs=chag, join=True)
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(chag)]
    return {"saved": max(r["saved"] for r in ranks), "received": ranks[0]["received"]}


def main() -> int:
    """Print the table and the memory line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="samples per step, shared by the chag ranks")
    parser.add_argument("--patch", type=int, default=9, help="patch size (9: 9 spatial tokens per band)")
    parser.add_argument("--groups", type=int, default=8, help="band groups (model.band_groups)")
    parser.add_argument("--chags", type=int, nargs="+", default=[1, 2, 4], choices=(1, 2, 4), help="chag of each row")
    args = parser.parse_args()

    from preflight_fidelity import COMMON_OVERRIDES, RECIPE_FOR_DEVICES, STEPS, Case

    from hslite.comparison.measure import run_compare
    from hslite.comparison.rows import CompareOptions, RowSpec
    from hslite.parallel.plan import Plan
    from hslite.recipe.build import prepared_datamodule
    from hslite.recipe.config import load_config
    from hslite.recipe.gate import check_recipe
    from hslite.recipe.recipe_parts import training_batches

    rows, fits = [], []
    with tempfile.TemporaryDirectory(prefix="hslite-chag-") as tmp:
        root = Path(tmp)
        shared = [*COMMON_OVERRIDES, f"output.root={root}"]
        for chag in sorted(set(args.chags) | {1}):  # chag=1 is what the memory line compares with
            case = Case(
                "channel_vit", "small", Plan(devices=chag, batch_size=args.batch, chag=chag), patch_size=args.patch
            )
            overrides = [*case.overrides(), f"model.band_groups={args.groups}"]
            cfg = load_config(RECIPE_FOR_DEVICES[chag], [*shared, *overrides])
            verdict = check_recipe(cfg)
            predicted = verdict.predictions[verdict.requested]
            datamodule = prepared_datamodule(cfg)
            model_kwargs = {
                "in_bands": datamodule.num_bands,
                "num_classes": datamodule.num_classes,
                "patch_size": args.patch,
                "wavelengths_nm": datamodule.input_wavelengths_nm,
                "num_groups": args.groups,
            }
            ranks = measure_ranks(chag, model_kwargs, training_batches(datamodule, 0)(args.batch), root)
            fits.append(RowSpec(f"chag={chag}", RECIPE_FOR_DEVICES[chag], overrides))
            rows.append((chag, predicted, ranks))
        # each plan's step time: a short `hslite fit` of it, measured as `hslite compare` measures
        measured, _ = run_compare(CompareOptions(fits, shared, measure=True, steps=STEPS, reference=False))
    failed = [f"{row.label}: {row.failure}" for row in measured if row.measured_step_seconds is None]
    if failed:
        print("fit failed: " + "; ".join(failed))
        return 1

    print(f"channel_vit small, {model_kwargs['in_bands']} bands in {args.groups} groups, patch {args.patch}, "
          f"batch {args.batch} per step, dp 1, gloo ranks on this machine")  # fmt: skip
    header = (f"{'chag':>4}  {'pred step s':>11}  {'meas step s':>11}  {'err':>5}  {'pred act MB':>11}  "
              f"{'meas act MB':>11}  {'pred exch MB':>12}  {'meas exch MB':>12}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for (chag, predicted, ranks), fit in zip(rows, measured, strict=True):
        measured_seconds = fit.measured_step_seconds
        error = (predicted.step_seconds - measured_seconds) / measured_seconds
        print(f"{chag:>4}  {predicted.step_seconds:>11.4f}  {measured_seconds:>11.4f}  {error:>+5.0%}  "
              f"{predicted.memory_breakdown_bytes['activations'] / 1e6:>11.2f}  {ranks['saved'] / 1e6:>11.2f}  "
              f"{predicted.chag_bytes_per_step / 1e6:>12.3f}  {ranks['received'] / 1e6:>12.3f}")  # fmt: skip
    saved = {chag: ranks["saved"] for chag, _, ranks in rows}
    most = max(saved)
    print(f"chag={most} activation memory: {saved[most] / saved[1]:.0%} of chag=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
