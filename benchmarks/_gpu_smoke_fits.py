"""Sections of benchmarks/gpu_smoke.py that train through Lightning: (e) `hslite compare` rows measured on the device,
the probe's and a device profile's predictions against them; (b) the int8 hook's arithmetic on the device, and fits
through hslite and its strategies on one device. Lines as in _gpu_smoke_sections.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _gpu_smoke_sections import Context, SmokeFailure, check_environment, checking, report
from gpu_smoke import ONE_GPU
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from hslite.cli import main as hslite
from hslite.comparison.measure import run_compare
from hslite.comparison.rows import DEFAULT_STEPS, CompareOptions, CompareRow, RowSpec
from hslite.preflight_check.price.roofline import KINDS
from hslite.recipe.config import load_config
from hslite.recipe.schema import Config
from hslite.run.checkpoints import load_weights
from hslite.run.training_state import TrainingState

# b's fits check training, not the pre-flight (e's) nor the refit, which would train each a second time.
FIT_ONLY = ("preflight.enabled=false", "train.refit=false")
# Deterministic kernels, flips and small batches: every epoch draws a shuffle and flips a resume must reproduce.
REPEATABLE = ("train.deterministic=true", "train.max_epochs=3", "data.augment=true", "data.patch_size=3",
              "data.batch_size=16", *FIT_ONLY)  # fmt: skip
CALIBRATION_NOTE = (
    "×: measured / predicted. The e and launch_us 'to match' assume the step's device time is all FLOPs, or all "
    "kernel launches (docs/design.md, what-if), one e for every FLOP where the profile prices matmuls and convolutions "
    "apart. 32-true fits run with TF32 on (parallel.tf32), which the profile "
    "prices at plain FP32: their e to match overstates the FP32 efficiency."
)
SCORES = ("OA", "AA", "kappa", "per_class_accuracy", "confusion_matrix", "optimizer_steps", "train_samples")


def _quick(ctx: Context) -> list[str]:
    """Overrides of the quickstart recipe for this run's device and a scene of the right size for it."""
    scene = "synthetic_indian_pines" if ctx.cuda else "synthetic_tiny"
    return [f"data.scene={scene}", f"parallel.accelerator={ctx.accelerator}", "train.progress=false"]


def _fit(ctx: Context, tag: str, overrides: list[str], recipe: str = "quickstart") -> Path:
    """`hslite fit` in this process, into a folder of its own under the scratch folder; its run folder."""
    root = ctx.work / "runs" / tag
    code = hslite(["fit", f"recipe={recipe}", *overrides, f"output.root={root}"])
    if code:
        raise SmokeFailure(f"hslite fit exited {code} (its error is in smoke.log)")
    (run,) = sorted((root / recipe).iterdir())
    return run


def _metrics(run: Path) -> dict[str, Any]:
    return json.loads((run / "metrics.json").read_text())


def _scores(run: Path) -> dict[str, Any]:
    """A finished run's test scores and its last weights: equal means bitwise equal."""
    weights = load_weights(run / "checkpoints" / "last.ckpt")
    return {**{key: _metrics(run)[key] for key in SCORES}, **{f"weight {k}": v for k, v in weights.items()}}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
    """What differs between two `_scores`, in words; empty when they are bitwise equal."""
    differ = [k for k in a if (not torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] != b[k])]
    if not differ:
        return ""
    gaps = [float((a[k] - b[k]).abs().max()) for k in differ if isinstance(a[k], torch.Tensor)]
    return f"{len(differ)} of {len(a)} differ ({', '.join(differ[:4])}; largest weight gap {max(gaps, default=0):.3g})"


@contextmanager
def _crash_at_epoch(epoch: int) -> Iterator[None]:
    """Make every fit started inside raise at the start of `epoch` (1-based), after the previous one's checkpoint."""

    def crash(self: TrainingState, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 == epoch:
            raise RuntimeError("smoke: simulated crash")

    TrainingState.on_train_epoch_start = crash  # type: ignore[method-assign]
    try:
        yield
    finally:
        del TrainingState.on_train_epoch_start  # Callback's own (empty) hook again


def check_int8(ctx: Context) -> None:
    """(b) The int8 hook's quantise, pack and dequantise on the device against the CPU's: what one rank can check."""
    from hslite.parallel.compression.hook import _pack, _quantise, _scales

    chunks, chunk = 64, 2048
    generator = torch.Generator().manual_seed(0)
    # chunks of 1e-6 to 1e2, as a bucket's layers differ, and one all-zero chunk, whose scale is 0
    x = torch.randn(chunks, chunk, generator=generator) * torch.logspace(-6, 2, chunks).unsqueeze(-1)
    x[5] = 0
    with checking("b.int8_round_trip"):
        sent, received = {}, {}
        for device in dict.fromkeys([torch.device("cpu"), ctx.device]):
            codes, scales = _quantise(x.to(device))
            message = _pack(codes.view(1, -1), scales.view(1, -1))  # one destination's row of the all-to-all
            back = torch.mul(message[:, : x.numel()].view(chunks, chunk), _scales(message, x.numel()).view(chunks, 1))
            sent[device.type], received[device.type] = message.cpu(), back.cpu()
        step = x.abs().amax(dim=-1, keepdim=True) / 127
        worst = float(((x - received[ctx.device.type]).abs() / step.clamp_min(1e-30)).max())
        if worst > 0.5 + 1e-4:  # rounding to the nearest code: half a step at most
            raise SmokeFailure(f"{ctx.device.type} dequantised {worst:.3g} steps from the input (at most 0.5)")
        differ = {what: int((got[ctx.device.type] != got["cpu"]).sum()) for what, got in (("message bytes", sent),
                  ("dequantised values", received))}  # fmt: skip
        if any(differ.values()):
            raise SmokeFailure(f"{ctx.device.type} and the CPU differ in " + ", ".join(f"{n} {w}" for w, n in
                               differ.items() if n))  # fmt: skip
        against = "bitwise the CPU's" if ctx.cuda else "on the CPU alone (--dry-run)"
        report("PASS", "b.int8_round_trip", f"{x.numel():,} values in {chunks} chunks of 1e-6 to 1e2 and a zero "
               f"one, quantised, packed and dequantised on {ctx.device}: within {worst:.2f} of a step, "
               f"{against}")  # fmt: skip
    one_gpu = ctx.cuda and torch.cuda.device_count() == 1
    why = ONE_GPU if one_gpu else "--dry-run: no NCCL here" if ctx.dry_run else "this smoke runs one NCCL rank"
    report("SKIP", "b.int8_nccl", f"{why}, and at world size 1 the hook returns the bucket without a collective: its "
           "int8 all-to-all and all-gather are not checked over NCCL (c.int8_hook runs them over gloo on two "
           "processes)")  # fmt: skip


def check_fits(ctx: Context) -> None:
    """(b) `hslite fit` on one device in 16-mixed, bitwise repeatable, and resumed equal to uninterrupted."""
    with checking("b.16_mixed"):  # 32-true and bf16-mixed fits are e's rows
        run = _fit(ctx, "16_mixed", [*_quick(ctx), "train.max_epochs=2", "output.save_map=false",
                                     "parallel.precision=16-mixed", *FIT_ONLY])  # fmt: skip
        m = _metrics(run)
        scaler = "with a gradient scaler" if ctx.cuda else "on a CPU Lightning runs it as bf16"
        report("PASS", "b.16_mixed", f"{m['plan_that_ran']}: {m['optimizer_steps']} steps, "
               f"{m['train_samples_per_second']:,.0f} samples/s, test OA {m['OA']:.1%}; one device, "
               f"{scaler}")  # fmt: skip

    repeatable = [*_quick(ctx), *REPEATABLE, "output.save_map=true"]
    first = None
    with checking("b.deterministic"):
        run = _fit(ctx, "deterministic_1", repeatable)
        for figure in ("confusion.png", "map.png"):
            if (run / figure).is_file():
                shutil.copy(run / figure, ctx.out / figure)
        first = _scores(run)
        if differences := _differences(first, _scores(_fit(ctx, "deterministic_2", repeatable))):
            raise SmokeFailure(f"two fits of one seed differ: {differences}")
        report("PASS", "b.deterministic", "train.deterministic=true, one seed, 3 epochs of flips and shuffles in "
               "32-true: two fits end with bitwise-identical test scores and weights")  # fmt: skip
    with checking("b.resume"):
        if first is None:
            raise SmokeFailure("no uninterrupted run to compare with (b.deterministic failed)")
        with _crash_at_epoch(2):
            try:
                _fit(ctx, "resume", repeatable)
            except RuntimeError as err:
                if "simulated crash" not in str(err):
                    raise
        if differences := _differences(first, _scores(_fit(ctx, "resume", ["resume=last", *repeatable]))):
            raise SmokeFailure(f"the resumed run differs from the uninterrupted one: {differences}")
        report("PASS", "b.resume", "stopped at the start of epoch 2, `resume=last` ran to the end: bitwise the "
               "uninterrupted run's test scores and weights")  # fmt: skip


class StrategyProbe(pl.Callback):
    """Log what the strategy did to the model, so it comes back from a spawned rank with the callback metrics."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:  # noqa: D102
        state = getattr(trainer.strategy, "compression_state", None)
        params = list(pl_module.parameters())
        pl_module.log_dict({
            "smoke/ddp_wrapped": float(isinstance(trainer.strategy.model, DistributedDataParallel)),
            "smoke/sharded_params": float(sum(isinstance(p, DTensor) for p in params)),
            "smoke/int8_calls": float(state.calls["int8"] if state is not None else 0),
            "smoke/params": float(len(params)),
            "smoke/params_on_cuda": float(all(p.device.type == "cuda" for p in params)),
        }, sync_dist=True)  # fmt: skip


def _fit_with(ctx: Context, cfg: Config, precision: str, strategy: Any) -> dict[str, float]:
    """A short Lightning fit of the recipe's task with `strategy` on one device; the callback metrics."""
    from hslite.parallel.trainer.trainer_args import trainer_kwargs
    from hslite.recipe.build import build_task, plan_from_config, prepared_datamodule

    plan = plan_from_config(cfg)
    kwargs = trainer_kwargs(plan.with_(precision=precision), progress=False)
    kwargs["callbacks"].append(StrategyProbe())
    trainer = pl.Trainer(**{**kwargs, "strategy": strategy}, max_epochs=1, limit_train_batches=6, limit_val_batches=2,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         default_root_dir=ctx.work / "strategies")  # fmt: skip
    datamodule = prepared_datamodule(cfg)  # a fresh one: a fitted one keeps its trainer, which a spawn would pickle
    try:
        trainer.fit(build_task(cfg, plan, datamodule), datamodule=datamodule)
    finally:  # an in-process rank leaves its group and its rendezvous variables behind: clear them for the next
        if dist.is_initialized():
            dist.destroy_process_group()
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK"):
            os.environ.pop(name, None)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if not math.isfinite(metrics.get("train/loss", math.nan)):
        raise SmokeFailure(f"training loss {metrics.get('train/loss')}")
    if ctx.cuda and metrics["smoke/params_on_cuda"] != 1:
        raise SmokeFailure("the model's parameters were not all on cuda")
    return metrics


def check_strategies(ctx: Context) -> None:
    """(b) hslite's int8-compressed DDP and FSDP2 strategies, built as fit builds them, at world size 1."""

    from hslite.parallel.strategies.ddp import CompressedDDPStrategy
    from hslite.parallel.strategies.fsdp import ShardedStrategy
    from hslite.parallel.trainer.trainer_args import process_group_backend

    backend = process_group_backend(ctx.accelerator)
    cfg = load_config("quickstart", [*_quick(ctx), "preflight.enabled=false"])
    # hslite spawns its DDP ranks; at one rank "popen" starts none and trains in this process, which keeps the
    # process group's lifetime here. ShardedStrategy spawns its rank, as in every FSDP fit.
    ddp = {"process_group_backend": backend, "start_method": "popen"}
    runs: dict[str, tuple[Callable[[], Any], tuple[str, ...], str]] = {  # strategy, evidence, what it shows
        "ddp_int8_ws1": (lambda: CompressedDDPStrategy("int8", **ddp), ("smoke/ddp_wrapped", "smoke/int8_calls"),
                         "CompressedDDPStrategy('int8'), hslite's DDP with its hook registered on every device: the "
                         "model trained wrapped in DDP, {int8_calls:.0f} hook call(s), each returning its bucket "
                         "unsent at one rank"),
        "fsdp2_ws1": (lambda: ShardedStrategy(1, "bf16-mixed", backend), ("smoke/sharded_params",),
                      "ShardedStrategy (FSDP2 fully_shard, spawned): {sharded_params:.0f} of {params:.0f} "
                      "parameters trained as DTensors; hslite's fit uses it for ≥ 2 ranks only"),
    }  # fmt: skip
    for tag, (strategy, evidence, shows) in runs.items():
        with checking(f"b.{tag}"):
            metrics = _fit_with(ctx, cfg, "bf16-mixed", strategy())
            if idle := [key for key in evidence if metrics[key] <= 0]:
                raise SmokeFailure(f"{', '.join(idle)} is 0: the strategy did not act on the model")
            shown = shows.format(**{key.removeprefix("smoke/"): value for key, value in metrics.items()})
            report("PASS", f"b.{tag}", f"{shown}; bf16-mixed on {ctx.device} over {backend!r}, loss "
                   f"{metrics['train/loss']:.3f}")  # fmt: skip


# ------------------------------------------------------------------------------------------------ (e) calibration
def _roofline(summary: dict[str, Any]) -> dict[str, float]:
    """The profile's device time of one step (each phase's binding roof) and the totals that calibrate it."""
    phases = summary["phases"].values()
    roofs = {roof: sum(phase[f"{roof}_seconds"] for phase in phases) for roof in (*KINDS, "launch")}
    return {
        "device_seconds": sum(
            max(sum(phase[f"{kind}_seconds"] for kind in KINDS), phase["launch_seconds"]) for phase in phases
        ),  # fmt: skip
        "flops": sum(phase["matmul_flops"] + phase["conv_flops"] for phase in phases),
        "kernels": sum(phase["kernels"] for phase in phases),
        **{f"{roof}_roof_seconds": seconds for roof, seconds in roofs.items()},
    }


def _calibrate(run: Path, measured: CompareRow, profile: str) -> dict[str, Any]:
    """A measured compare row's step beside the probe's prediction (the row's) and the profile's roofline, and the
    e and launch cost that would have made the profile right."""
    from hslite.recipe.gate import check_recipe

    cfg = load_config(str(run / "config.yaml"), [f"preflight.device={profile}", "preflight.topology=nvlink_8",
                                                  "parallel.accelerator=gpu"])  # fmt: skip
    verdict = check_recipe(cfg, from_profile=True)
    summary = verdict.compute_profile
    assert summary is not None and measured.measured_step_seconds is not None
    roof = _roofline(summary)
    predicted = verdict.predictions[verdict.requested].step_seconds
    # host parts (gather, loop) as the profile priced them
    device = measured.measured_step_seconds - (predicted - roof["device_seconds"])
    row = {"plan": verdict.requested.describe(), "measured_step_seconds": measured.measured_step_seconds,
           "probe_step_seconds": measured.predicted_step_seconds, "profile_step_seconds": predicted,
           "profile": profile, "efficiencies": summary["efficiencies"], "launch_us": summary["launch_us"],
           "peak_flops": summary["peak_flops"], **roof, "measured_device_seconds": device}  # fmt: skip
    if device > 0:
        row["efficiency_to_match"] = roof["flops"] / (summary["peak_flops"] * device)  # were it FLOP-bound
        row["launch_us_to_match"] = device / max(roof["kernels"], 1) * 1e6  # were it launch-bound
    return row


def check_calibration(ctx: Context) -> None:
    """(e) `hslite compare` rows on the device, each measured step against the probe's prediction and the profile's
    roofline: the quickstart (small, launch-bound) in fp32, HybridSN (compute-heavy: its step calibrates e) and the
    quickstart in bf16-mixed, in that order of value, each row's line printed as it is measured."""
    quick = [*_quick(ctx), "parallel.precision=32-true"]
    rows = [RowSpec("fp32", "quickstart", quick)]
    if ctx.cuda:
        rows += [RowSpec("hybridsn_bf16", "indian_pines_1gpu", ["data.scene=synthetic_indian_pines",
                         "model.name=hybridsn", "data.pca_components=30", "data.patch_size=25",  # the paper's input
                         "parallel.accelerator=gpu", "parallel.precision=bf16-mixed"]),
                 RowSpec("bf16_mixed", "quickstart", [*_quick(ctx), "parallel.precision=bf16-mixed"])]  # fmt: skip
    else:  # a dry run's CPU step calibrates nothing: one row shows the path
        report("SKIP", "e.hybridsn_fit", "--dry-run: HybridSN at patch 25 (the compute-heavy model that calibrates "
               "e) takes minutes per epoch on a CPU; e.fp32 alone shows the path")  # fmt: skip
    profile = "h200"
    if ctx.cuda:
        from hslite.preflight_check.hardware.device_profile import device_for_gpu

        profile = device_for_gpu(torch.cuda.get_device_name(0)) or profile
    calibrations: list[dict[str, Any]] = []
    for spec in rows:
        with checking(f"e.{spec.label}"):
            options = CompareOptions([spec], [f"output.root={ctx.work / 'compare'}"], measure=True,
                                     steps=DEFAULT_STEPS if ctx.cuda else 5, reference=False)  # fmt: skip
            (fit,), folder = run_compare(options, progress=print)  # progress goes to smoke.log
            if fit.measured_step_seconds is None:
                raise SmokeFailure(f"the compare row was not measured: {fit.failure}")
            row = _calibrate(folder / str(fit.run_dir), fit, profile)
            calibrations.append({"fit": fit.label, **row})
            ctx.save("calibration", {"profile": profile, "rows": calibrations, "note": CALIBRATION_NOTE})
            dry = " [dry run: a CPU step against a GPU profile means nothing; the path runs]"
            report("PASS", f"e.{fit.label}", _calibration_line(row) + ("" if ctx.cuda else dry))


def _calibration_line(row: dict[str, Any]) -> str:
    """One calibration row in words: measured beside the probe's and the profile's step, and what would match."""

    def ms(seconds: float | None) -> str:
        return f"{seconds * 1e3:.3g} ms" if seconds else "n/a"

    def times(predicted: float | None) -> str:
        return f"×{row['measured_step_seconds'] / predicted:.2f}" if predicted else "×n/a"

    line = (f"{row['plan']}: measured {ms(row['measured_step_seconds'])}/step; probe predicted "
            f"{ms(row['probe_step_seconds'])} ({times(row['probe_step_seconds'])}); {row['profile']} roofline "
            f"{ms(row['profile_step_seconds'])} ({times(row['profile_step_seconds'])}), its device part "
            f"{ms(row['device_seconds'])} against {ms(row['measured_device_seconds'])} measured")  # fmt: skip
    if "efficiency_to_match" not in row:
        return line + "; the host parts alone were priced above the measured step"
    now = ", ".join(f"{kind} {e:g}" for kind, e in row["efficiencies"].items())
    return (line + f"; to match: e = {row['efficiency_to_match']:.3g} for every FLOP if FLOP-bound (now {now}), "
            f"launch {row['launch_us_to_match']:.3g} µs/kernel if launch-bound (now {row['launch_us']:g})")  # fmt: skip


PARTS: dict[str, tuple[Callable[[Context], None], ...]] = {
    "e": (check_environment, check_calibration),  # the first section: the versions and the GPU open the log
    "b": (check_int8, check_fits, check_strategies),
}
