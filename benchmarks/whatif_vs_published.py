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

The shipped rule is fitted to nothing: every row is priced with the profile's own efficiency and launch cost; its
summary is the last line. Beside it, a rule that prices each kind of kernel apart, the candidate to replace it:
    T = matmul FLOPs / (peak · e_matmul) + convolution FLOPs / (peak · e_conv) + other kernels' bytes / (BW · e_memory)
(at least kernels × launch), the bytes being every other kernel's inputs and outputs (normalisations, activations,
casts, the optimiser's), counted on the step at the table's batch. e_matmul is held at 1 (the published ViT-L/32 rate
is 68 % of the peak with its other kernels included: its matmuls ran near the datasheet's rate), and e_conv and
e_memory are fitted on two rows only, FIT_ROWS, one of each kind, then held for every row; its summary line says how
the rows it was not fitted on came out.
The table's columns: model, train_samples_per_sec, train_step_time_ms, train_batch_size, train_img_size.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hslite.preflight.device_profile import DeviceProfile, load_device
from hslite.preflight.fake_tensors import fake_mode
from hslite.preflight.footprint import measure_footprint
from hslite.preflight.roofline import profile_probe
from hslite.preflight.step_counts import count_step, launches_kernel
from hslite.preflight.timers import autocast
from hslite.preflight.training_step import TrainingStep, classifier_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_models import MODELS  # noqa: E402 - the benchmark's own module beside it

TABLE = Path(__file__).resolve().parents[2] / "shared" / "gpu_tables" / "timm_train_amp_rtx3090.csv"
PRECISION = "16-mixed"
FIT_ROWS = ("resnet50", "densenet121")  # the per-kind rule's e_conv and e_memory come from these two rows only
CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten._convolution, torch.ops.aten.convolution_backward}


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


class KindWork(TorchDispatchMode):
    """FLOPs of matmuls and of convolutions, bytes in and out of every other kernel, and kernels, of what runs in it."""

    def __init__(self) -> None:
        super().__init__()
        self.work = {"matmul_flops": 0.0, "conv_flops": 0.0, "other_bytes": 0.0, "kernels": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # _unsafe_view only relabels a tensor's shape: no kernel, no bytes
        if not launches_kernel(func) or func.overloadpacket is torch.ops.aten._unsafe_view:
            return out
        self.work["kernels"] += 1
        if func.overloadpacket in flop_registry:
            kind = "conv_flops" if func.overloadpacket in CONVOLUTIONS else "matmul_flops"
            self.work[kind] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        else:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.work["other_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def kind_work(model: str, batch_size: int, image: int) -> dict[str, float]:
    """One steady-state training step's work by kind at `batch_size`, counted on fake tensors (nothing allocated)."""
    with fake_mode():
        net = MODELS[model]().train()
        optimizer = sgd(net)
        batch = (torch.zeros(batch_size, 3, image, image), torch.zeros(batch_size, dtype=torch.long))
        counter = KindWork()
        for counted in (False, True):  # the first step makes the momentum buffers
            with counter if counted else contextlib.nullcontext():
                with autocast(PRECISION, torch.device("cpu")):
                    loss = classifier_loss(net, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return counter.work


def kind_terms(work: dict[str, float], profile: DeviceProfile) -> np.ndarray:
    """Seconds of each kind at an efficiency of 1: matmuls, convolutions, other kernels' bytes."""
    peak = profile.peak_flops(PRECISION)
    return np.array([work["matmul_flops"] / peak, work["conv_flops"] / peak,
                     work["other_bytes"] / (profile.memory_gbps * 1e9)])  # fmt: skip


def fit_kinds(terms: dict[str, np.ndarray], seconds: dict[str, float]) -> tuple[float, float]:
    """e_conv and e_memory that price FIT_ROWS exactly with e_matmul = 1."""
    a = np.array([terms[name][1:] for name in FIT_ROWS])
    b = np.array([seconds[name] - terms[name][0] for name in FIT_ROWS])
    inverse = np.linalg.solve(a, b)
    return 1 / inverse[0], 1 / inverse[1]


def kind_seconds(terms: np.ndarray, kernels: float, e_conv: float, e_memory: float, profile: DeviceProfile) -> float:
    return max(float(terms @ np.array([1.0, 1 / e_conv, 1 / e_memory])), kernels * profile.launch_us * 1e-6)


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
    shipped, work, published = {}, {}, {}
    for row in table:
        name, batch, image = row["model"], int(row["train_batch_size"]), int(row["train_img_size"])
        shipped[name] = priced_seconds(name, batch, image)
        work[name] = kind_work(name, batch, image)
        published[name] = batch / float(row["train_samples_per_sec"])
    terms = {name: kind_terms(w, profile) for name, w in work.items()}
    fitted = fit_kinds(terms, published) if all(name in published for name in FIT_ROWS) else None
    print(
        f"rtx_3090 profile: {profile.bf16_tflops:g} TFLOP/s fp16 tensor peak, {profile.memory_gbps:g} GB/s, "
        f"e = {profile.efficiency:g} (FLOPs and bytes), {profile.launch_us:g} µs a kernel; {PRECISION}, SGD"
    )
    print(f"{'':<24}{'':>6}{'':>10}{'published':>10} {'shipped roofline':>23} {'per kind':>14}")
    print(f"{'model':<24}{'batch':>6}{'GFLOP/img':>10}{'images/s':>10}{'images/s':>10}{'error':>7}{'e fits':>7}"
          f"{'images/s':>10}{'error':>7}{'MFU':>6}")  # fmt: skip
    errors: dict[str, list[float]] = {"shipped": [], "kind": [], "held": []}
    for row in table:
        name, batch = row["model"], int(row["train_batch_size"])
        (seconds, flops), rate = shipped[name], batch / published[name]
        predicted = batch / seconds
        errors["shipped"].append(abs(predicted / rate - 1))
        fits = profile.efficiency * rate / predicted  # launches bind none of these: a rate scales as e
        line = (f"{name:<24}{batch:>6}{flops / 1e9:>10.1f}{rate:>10.0f}{predicted:>10.0f}"
                f"{100 * (predicted / rate - 1):>+6.0f}%{fits:>7.2f}")  # fmt: skip
        if fitted is not None:
            kind_rate = batch / kind_seconds(terms[name], work[name]["kernels"], *fitted, profile)
            errors["kind"].append(abs(kind_rate / rate - 1))
            if name not in FIT_ROWS:
                errors["held"].append(abs(kind_rate / rate - 1))
            line += f"{kind_rate:>10.0f}{100 * (kind_rate / rate - 1):>+6.0f}%"
        print(line + f"{100 * rate * flops / (profile.bf16_tflops * 1e12):>5.0f}%")
    if fitted is not None and errors["held"]:
        print(
            f"per kind (e_matmul 1 held; e_conv {fitted[0]:.2f} and e_memory {fitted[1]:.2f} fitted on "
            f"{' and '.join(FIT_ROWS)}): median {100 * statistics.median(errors['kind']):.0f}%, worst "
            f"{100 * max(errors['kind']):.0f}%; on the {len(errors['held'])} rows not fitted: median "
            f"{100 * statistics.median(errors['held']):.0f}%, worst {100 * max(errors['held']):.0f}%"
        )
    else:
        print(f"per kind: not fitted (the table lacks {' or '.join(FIT_ROWS)}, or has no other row)")
    print(
        f"what-if vs published: median {100 * statistics.median(errors['shipped']):.0f}%, "
        f"worst {100 * max(errors['shipped']):.0f}%"
    )


if __name__ == "__main__":
    main()
