"""Training parity of the int8 error-feedback all-reduce against plain fp32 DDP, same seed, same plan otherwise.

    python benchmarks/compression_parity.py                  # synthetic Indian Pines + real Salinas-A (../shared/data)
    python benchmarks/compression_parity.py --devices 4 --epochs 20

Each scene is trained twice through `hslite fit` with N gloo processes: compression=none, then compression=int8.
Prints final test OA side by side and ends with `max OA gap int8 vs fp32: N.NN points` (target ≤ 1 point).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

SCENES = {
    # recipe, extra overrides
    "synthetic_indian_pines": ("quickstart", ["model.name=cnn1d", "data.patch_size=1"]),
    "salinas_a": ("salinas_a_1gpu", [f"data.root={SHARED_DATA}"]),
}


def run(recipe: str, overrides: list[str], compression: str, devices: int, epochs: int, root: str) -> dict:
    from hslite.recipe.config import load_config
    from hslite.run.fit import fit

    cfg = load_config(
        recipe,
        [
            *overrides,
            "parallel.accelerator=cpu",
            f"parallel.devices={devices}",
            f"parallel.compression={compression}",
            f"train.max_epochs={epochs}",
            "train.progress=false",
            "preflight.enabled=false",  # parity, not profitability: the check would refuse N processes on 2 cores
            "output.save_map=false",
            f"output.root={root}",
        ],
    )
    cfg.data.batch_size = max(8, cfg.data.batch_size // devices)  # keep the recipe's global batch
    return fit(cfg).metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for scene, (recipe, overrides) in SCENES.items():
            if scene == "salinas_a" and not SHARED_DATA.is_dir():
                print(f"skipping {scene}: {SHARED_DATA} not found")
                continue
            fp32 = run(recipe, overrides, "none", args.devices, args.epochs, root)
            int8 = run(recipe, overrides, "int8", args.devices, args.epochs, root)
            rows.append(
                (scene, fp32["OA"], int8["OA"], fp32["train_samples_per_second"], int8["train_samples_per_second"])
            )

    print(f"\n{args.devices} gloo processes, {args.epochs} epochs, same seed")
    print(f"{'scene':<24} {'OA fp32':>8} {'OA int8':>8} {'gap pts':>8} {'fp32 samples/s':>15} {'int8 samples/s':>15}")
    for scene, oa_fp32, oa_int8, sps_fp32, sps_int8 in rows:
        gap = 100 * (oa_int8 - oa_fp32)
        print(f"{scene:<24} {100 * oa_fp32:8.2f} {100 * oa_int8:8.2f} {gap:+8.2f} {sps_fp32:15.0f} {sps_int8:15.0f}")
    print(f"max OA gap int8 vs fp32: {max(abs(100 * (r[2] - r[1])) for r in rows):.2f} points")


if __name__ == "__main__":
    main()
