"""What-if prices of an RTX 3090 against what one was measured to do: timm's published training table.

    python benchmarks/whatif_vs_published.py                               # the table in ../shared/gpu_tables
    python benchmarks/whatif_vs_published.py --table my_rtx3090_rows.csv   # rows of the same columns

No GPU is needed: each model of the table (`published_models.py`, written at its published shapes) is counted on fake
tensors, as the pre-flight counts a recipe's model for a device that is not here (`count_step`: FLOPs, kernels;
`measure_footprint`: the bytes the roofline moves), at the table's batch and image size, under "16-mixed" (timm's
AMP: fp16 autocast and a gradient scaler), with SGD and momentum (timm's benchmark optimiser), and priced on the
`rtx_3090` profile by the roofline every what-if price uses (`roofline.profile_probe`: forward, backward and optimiser,
each max(FLOPs / (peak · e), bytes / (bandwidth · e), kernels · launch)). The batch is on the GPU already in timm's
benchmark, so no copy is priced. Each row: GFLOP per image (forward and backward), the predicted and the published
images/s, the error, and the share of the fp16 tensor peak the published rate is (its model FLOP utilisation), then
the e that would have priced that row exactly. The last line: `what-if vs published: median N%, worst M%`.

Nothing is fitted here: every row is priced with the profile's own efficiency and launch cost.
The table's columns: model, train_samples_per_sec, train_step_time_ms, train_batch_size, train_img_size.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch

from hslite.preflight.device_profile import load_device
from hslite.preflight.footprint import measure_footprint
from hslite.preflight.roofline import profile_probe
from hslite.preflight.step_counts import count_step
from hslite.preflight.training_step import TrainingStep, classifier_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_models import MODELS  # noqa: E402 - the benchmark's own module beside it

TABLE = Path(__file__).resolve().parents[2] / "shared" / "gpu_tables" / "timm_train_amp_rtx3090.csv"
PRECISION = "16-mixed"


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """timm's benchmark optimiser: SGD, Nesterov momentum 0.9."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)


SGD_STEP = TrainingStep(classifier_loss, sgd, "timm benchmark step (SGD)")


def priced_seconds(model: str, batch_size: int, image: int, profile_name: str = "rtx_3090") -> tuple[float, float]:
    """(seconds of one training step as the what-if roofline prices it, FLOPs per image forward and backward)."""

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(b, 3, image, image), torch.zeros(b, dtype=torch.long)

    counts = count_step(MODELS[model], make_batch, precision=PRECISION, step=SGD_STEP)
    sizes = measure_footprint(MODELS[model], make_batch, batch_size=batch_size, precision=PRECISION, step=SGD_STEP)
    probe = profile_probe(batch_size, sizes, counts, load_device(profile_name), gather_seconds=0.0)
    flops = counts.forward_flops_per_sample + counts.backward_flops_per_sample
    return probe.forward_seconds + probe.backward_seconds + probe.optimizer_seconds, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=TABLE, help="published rows (timm's benchmark CSV columns)")
    args = parser.parse_args()
    if not args.table.is_file():
        sys.exit(f"--table {args.table}: no such file; give timm's RTX 3090 training rows (see this script's --help)")
    profile = load_device("rtx_3090")
    print(
        f"rtx_3090 profile: {profile.bf16_tflops:g} TFLOP/s fp16 tensor peak, {profile.memory_gbps:g} GB/s, "
        f"e = {profile.efficiency:g} (FLOPs and bytes), {profile.launch_us:g} µs a kernel; {PRECISION}, SGD"
    )
    print(f"{'model':<24}{'batch':>6}{'GFLOP/img':>10}{'predicted/s':>12}{'published/s':>12}{'error':>8}"
          f"{'MFU':>6}{'e fits':>8}")  # fmt: skip
    errors = []
    with open(args.table, newline="") as rows:
        for row in csv.DictReader(rows):
            name, batch = row["model"], int(row["train_batch_size"])
            if name not in MODELS:
                print(f"{name:<24} not written here: skipped")
                continue
            seconds, flops = priced_seconds(name, batch, int(row["train_img_size"]))
            published = float(row["train_samples_per_sec"])
            predicted = batch / seconds
            errors.append(abs(predicted / published - 1))
            mfu = published * flops / (profile.bf16_tflops * 1e12)
            fits = profile.efficiency * published / predicted  # launches bind none of these: a rate scales as e
            print(f"{name:<24}{batch:>6}{flops / 1e9:>10.1f}{predicted:>12.0f}{published:>12.0f}"
                  f"{100 * (predicted / published - 1):>+7.0f}%{100 * mfu:>5.0f}%{fits:>8.2f}")  # fmt: skip
    print(f"what-if vs published: median {100 * statistics.median(errors):.0f}%, worst {100 * max(errors):.0f}%")


if __name__ == "__main__":
    main()
