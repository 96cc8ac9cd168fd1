"""What-if prices of an RTX 3090 against what one was measured to do: timm's published training table.

    python benchmarks/whatif_vs_published.py                               # the table in ../shared/gpu_tables
    python benchmarks/whatif_vs_published.py --table my_rtx3090_rows.csv   # rows of the same columns

No GPU is needed: each model of the table (`published_models.py`, written at its published shapes) is counted on fake
tensors, as the pre-flight counts a recipe's model for a device that is not here (`count_step`: FLOPs of matmuls and
of convolutions, every other kernel's bytes, kernels; `measure_footprint`: the sizes), under "16-mixed" (timm's AMP:
fp16 autocast and a gradient scaler), with SGD and Nesterov momentum (timm's benchmark optimiser), and priced at the
table's batch and image size on the `rtx_3090` profile by the roofline every what-if price uses
(`roofline.profile_probe`): forward, backward and optimiser, each
    max(matmul FLOPs / (peak · e_matmul) + convolution FLOPs / (peak · e_conv) + bytes / (bandwidth · e_memory),
        kernels · launch)
The batch is on the GPU already in timm's benchmark, so no copy is priced. Each row: GFLOP per image (forward and
backward), the published and the predicted images/s, the error, and the share of the fp16 tensor peak the published
rate is (its model FLOP utilisation).

Where the efficiencies come from: e_matmul is held at 1 (the published ViT-L/32 rate is 68 % of the peak with its
other kernels in it: its matmuls ran at about the datasheet's rate); e_conv and e_memory are fitted on two rows
only, FIT_ROWS (one mostly convolutions, one mostly memory traffic), and the profiles hold those values for every
model. The script prints the fit from this table beside the profile's figures, then the error on the rows not
fitted, and last the line `what-if vs published: median N%, worst M%` over every row.
The table's columns: model, train_samples_per_sec, train_step_time_ms, train_batch_size, train_img_size.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hslite.preflight_check.hardware.device_profile import DeviceProfile, load_device
from hslite.preflight_check.measure.footprint import measure_footprint
from hslite.preflight_check.measure.step_counts import count_step
from hslite.preflight_check.measure.training_step import TrainingStep, classifier_loss
from hslite.preflight_check.measurements import StepCounts
from hslite.preflight_check.price.roofline import KINDS, profile_probe, roofline_summary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_models import MODELS  # noqa: E402 - the benchmark's own module beside it

TABLE = Path(__file__).resolve().parents[2] / "shared" / "gpu_tables" / "timm_train_amp_rtx3090.csv"
PRECISION = "16-mixed"
FIT_ROWS = ("resnet50", "densenet121")  # e_conv and e_memory come from these two rows only


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """timm's benchmark optimiser: SGD, Nesterov momentum 0.9."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)


SGD_STEP = TrainingStep(classifier_loss, sgd, "timm benchmark step (SGD)")


def image_batches(image: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Batches of `image` × `image` RGB images and their labels, at any batch size."""

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(b, 3, image, image), torch.zeros(b, dtype=torch.long)

    return make_batch


def counted(model: str, image: int) -> StepCounts:
    """The model's training step counted on fake tensors, as the pre-flight counts a model priced from a profile."""
    return count_step(MODELS[model], image_batches(image), precision=PRECISION, step=SGD_STEP)


def priced_seconds(model: str, counts: StepCounts, batch_size: int, image: int, profile: DeviceProfile) -> float:
    """Seconds of one training step at `batch_size` as the what-if roofline prices it on `profile`."""
    sizes = measure_footprint(MODELS[model], image_batches(image), batch_size=batch_size, precision=PRECISION,
                              step=SGD_STEP)  # fmt: skip
    probe = profile_probe(batch_size, sizes, counts, profile, gather_seconds=0.0)
    return probe.forward_seconds + probe.backward_seconds + probe.optimizer_seconds


def kind_seconds(counts: StepCounts, batch_size: int, profile: DeviceProfile) -> np.ndarray:
    """Seconds of each kind (matmuls, convolutions, memory traffic) over the step's phases at an efficiency of 1."""
    phases = roofline_summary(counts, profile.with_efficiency(1.0), batch_size)["phases"].values()
    return np.array([sum(phase[f"{kind}_seconds"] for phase in phases) for kind in KINDS])


def fit(terms: dict[str, np.ndarray], seconds: dict[str, float]) -> tuple[float, float]:
    """e_conv and e_memory that price FIT_ROWS exactly with e_matmul = 1."""
    a = np.array([terms[name][1:] for name in FIT_ROWS])
    b = np.array([seconds[name] - terms[name][0] for name in FIT_ROWS])
    inverse = np.linalg.solve(a, b)
    return 1 / inverse[0], 1 / inverse[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", type=Path, default=TABLE, help="published rows (timm's benchmark CSV columns)")
    args = parser.parse_args()
    if not args.table.is_file():
        sys.exit(f"--table {args.table}: no such file; give timm's RTX 3090 training rows (see this script's --help)")
    profile = load_device("rtx_3090")
    with open(args.table, newline="") as rows:
        table = list(csv.DictReader(rows))
    for row in table:
        if row["model"] not in MODELS:
            print(f"{row['model']:<24} not written here: skipped")
    table = [row for row in table if row["model"] in MODELS]
    e = profile.efficiencies
    print(
        f"rtx_3090 profile: {profile.bf16_tflops:g} TFLOP/s fp16 tensor peak, {profile.memory_gbps:g} GB/s, "
        f"{profile.launch_us:g} µs a kernel; e_matmul {e['matmul']:g}, e_conv {e['conv']:g}, e_memory "
        f"{e['memory']:g}; {PRECISION}, SGD"
    )
    print(f"{'model':<24}{'batch':>6}{'GFLOP/img':>10}{'published/s':>12}{'predicted/s':>12}{'error':>7}{'MFU':>6}")
    errors, terms, published = {}, {}, {}
    for row in table:
        name, batch, image = row["model"], int(row["train_batch_size"]), int(row["train_img_size"])
        counts = counted(name, image)
        rate = float(row["train_samples_per_sec"])
        predicted = batch / priced_seconds(name, counts, batch, image, profile)
        terms[name], published[name] = kind_seconds(counts, batch, profile), batch / rate
        errors[name] = predicted / rate - 1
        flops = counts.forward_flops_per_sample + counts.backward_flops_per_sample
        print(f"{name:<24}{batch:>6}{flops / 1e9:>10.1f}{rate:>12.0f}{predicted:>12.0f}{100 * errors[name]:>+6.0f}%"
              f"{100 * rate * flops / (profile.bf16_tflops * 1e12):>5.0f}%")  # fmt: skip
    if all(name in terms for name in FIT_ROWS):
        e_conv, e_memory = fit(terms, published)
        print(f"fitted on {' and '.join(FIT_ROWS)} of this table: e_conv {e_conv:.2f}, e_memory {e_memory:.2f} (the "
              f"profile's: {e['conv']:g}, {e['memory']:g})")  # fmt: skip
    held = [abs(error) for name, error in errors.items() if name not in FIT_ROWS]
    if held:
        median, worst = 100 * statistics.median(held), 100 * max(held)
        print(f"rows not fitted ({len(held)}): median {median:.0f}%, worst {worst:.0f}%")
    every = [abs(error) for error in errors.values()]
    print(f"what-if vs published: median {100 * statistics.median(every):.0f}%, worst {100 * max(every):.0f}%")


if __name__ == "__main__":
    main()
