"""Sections of benchmarks/gpu_smoke.py that train through Lightning: (b) fits through hslite and its strategies on
one device, (e) `hslite compare` rows measured on the device: the probe's and a device profile's predictions against
them. Lines as in _gpu_smoke_sections.py.
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
from _gpu_smoke_sections import Context, SmokeFailure, checking, report
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from hslite.cli import main as hslite
from hslite.compare.measure import run_compare
from hslite.compare.rows import DEFAULT_STEPS, CompareOptions, CompareRow, RowSpec
from hslite.recipe.config import load_config
from hslite.recipe.schema import Config
from hslite.run.checkpoints import load_weights
from hslite.run.training_state import TrainingState

ONE_DEVICE = "one device: Lightning's SingleDeviceStrategy (hslite starts DDP only for ≥ 2 ranks)"
# Deterministic kernels, flips and small batches: every epoch draws a shuffle and flips a resume must reproduce.
REPEATABLE = ("train.deterministic=true", "train.max_epochs=3", "data.augment=true", "data.patch_size=3",
              "data.batch_size=16", "preflight.enabled=false")  # fmt: skip
CALIBRATION_NOTE = (
    "×: measured / predicted. The e and launch_us 'to match' assume the step's device time is all FLOPs, or all "
    "kernel launches (docs/design.md, what-if). 32-true fits run with TF32 on (parallel.tf32), which the profile "
    "prices at plain FP32: their e to match overstates the FP32 efficiency."
)
CALIBRATED = {"fp32": "32-true", "bf16_mixed": "bf16-mixed", "16_mixed": "16-mixed"}  # (e)'s rows, as b's tags
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


def check_fits(ctx: Context) -> None:
    """(b) `hslite fit` on one device in every precision, bitwise repeatable, and resumed equal to uninterrupted."""
    runs: dict[str, str] = {}
    plans = {
        "fp32": (["parallel.precision=32-true", "output.save_map=true"], ONE_DEVICE),
        "bf16_mixed": (["parallel.precision=bf16-mixed"], "one device, as b.fp32; parallel.compression=int8 needs ≥ "
                       "2 DDP ranks, so a one-device fit never runs the hook (b.int8_ws1 and c.int8_hook do)"),
        "16_mixed": (["parallel.precision=16-mixed"], "one device, as b.fp32" + (", with a gradient scaler" if ctx.cuda
                     else "; on a CPU Lightning runs it as bf16")),
    }  # fmt: skip
    for tag, (overrides, note) in plans.items():
        with checking(f"b.{tag}"):
            run = _fit(ctx, tag, [*_quick(ctx), "train.max_epochs=2", "output.save_map=false", *overrides])
            m = _metrics(run)
            runs[tag] = str(run)
            report("PASS", f"b.{tag}", f"{m['plan_that_ran']}: {m['optimizer_steps']} steps, "
                   f"{m['train_samples_per_second']:,.0f} samples/s, test OA {m['OA']:.1%}; {note}")  # fmt: skip
    for figure in ("confusion.png", "map.png"):
        if "fp32" in runs and (Path(runs["fp32"]) / figure).is_file():
            shutil.copy(Path(runs["fp32"]) / figure, ctx.out / figure)

    repeatable = [*_quick(ctx), *REPEATABLE, "output.save_map=false"]
    first = None
    with checking("b.deterministic"):
        first = _scores(_fit(ctx, "deterministic_1", repeatable))
        if differences := _differences(first, _scores(_fit(ctx, "deterministic_2", repeatable))):
            raise SmokeFailure(f"two fits of one seed differ: {differences}")
        report("PASS", "b.deterministic", "train.deterministic=true, one seed, 3 epochs of flips and shuffles: two "
               "fits end with bitwise-identical test scores and weights")  # fmt: skip
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
    from hslite.parallel.trainer_args import trainer_kwargs
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
    """(b) hslite's DDP, int8-compressed DDP and FSDP2 strategies, built as fit builds them, at world size 1."""

    from hslite.parallel.fsdp import ShardedStrategy
    from hslite.parallel.strategies import CompressedDDPStrategy, FencedDDPStrategy
    from hslite.parallel.trainer_args import PROCESS_GROUP_TIMEOUT, process_group_backend

    backend = process_group_backend(ctx.accelerator)
    cfg = load_config("quickstart", [*_quick(ctx), "preflight.enabled=false"])
    # hslite spawns its DDP ranks; at one rank "popen" starts none and trains in this process, which keeps the
    # process group's lifetime here. ShardedStrategy spawns its rank, as in every FSDP fit.
    common = {"process_group_backend": backend, "timeout": PROCESS_GROUP_TIMEOUT, "start_method": "popen"}
    runs: dict[str, tuple[str, Callable[[], Any], str, str]] = {  # precision, strategy, evidence, what it shows
        "ddp_ws1": ("32-true", lambda: FencedDDPStrategy(**common), "smoke/ddp_wrapped",
                    "hslite's DDP strategy (fenced barriers, backend, timeout): the model trained wrapped in DDP"),
        "int8_ws1": ("bf16-mixed", lambda: CompressedDDPStrategy("int8", **common), "smoke/int8_calls",
                     "CompressedDDPStrategy('int8') in bf16-mixed: {value:.0f} int8 hook call(s) on one rank (its "
                     "all-to-all and all-gather move nothing between ranks; two ranks: c.int8_hook)"),
        "fsdp2_ws1": ("bf16-mixed", lambda: ShardedStrategy(1, "bf16-mixed", backend, PROCESS_GROUP_TIMEOUT),
                      "smoke/sharded_params", "ShardedStrategy (FSDP2 fully_shard, spawned) in bf16-mixed: {value:.0f} "
                      "of {params:.0f} parameters trained as DTensors; hslite's fit uses it for ≥ 2 ranks only"),
    }  # fmt: skip
    for tag, (precision, strategy, evidence, shows) in runs.items():
        with checking(f"b.{tag}"):
            metrics = _fit_with(ctx, cfg, precision, strategy())
            if metrics[evidence] <= 0:
                raise SmokeFailure(f"{evidence} is {metrics[evidence]}: the strategy did not act on the model")
            shown = shows.format(value=metrics[evidence], params=metrics["smoke/params"])
            report("PASS", f"b.{tag}", f"{shown}; {ctx.device} over {backend!r}, loss {metrics['train/loss']:.3f}")


# ------------------------------------------------------------------------------------------------ (e) calibration
def _roofline(summary: dict[str, Any]) -> dict[str, float]:
    """The profile's device time of one step (each phase's binding roof) and the totals that calibrate it."""
    phases = summary["phases"].values()
    roofs = {roof: sum(phase[f"{roof}_seconds"] for phase in phases) for roof in ("flops", "memory", "launch")}
    return {
        "device_seconds": sum(max(phase[f"{r}_seconds"] for r in roofs) for phase in phases),
        "flops": sum(phase["flops"] for phase in phases),
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
           "profile": profile, "efficiency": summary["efficiency"], "launch_us": summary["launch_us"],
           "peak_flops": summary["peak_flops"], **roof, "measured_device_seconds": device}  # fmt: skip
    if device > 0:
        row["efficiency_to_match"] = roof["flops"] / (summary["peak_flops"] * device)  # were it FLOP-bound
        row["launch_us_to_match"] = device / max(roof["kernels"], 1) * 1e6  # were it launch-bound
    return row


def check_calibration(ctx: Context) -> None:
    """(e) `hslite compare` rows on the device, the quickstart in each precision b fits and HybridSN, the compute-heavy
    model whose step calibrates e: each measured step against the probe's prediction and the profile's roofline."""
    tags = CALIBRATED if ctx.cuda else ("fp32",)  # a dry run's CPU step calibrates nothing: one row shows the path
    rows = [RowSpec(tag, "quickstart", [*_quick(ctx), f"parallel.precision={CALIBRATED[tag]}"]) for tag in tags]
    if ctx.cuda:
        rows.append(RowSpec("hybridsn_bf16", "indian_pines_1gpu", ["data.scene=synthetic_indian_pines",
                            "model.name=hybridsn", "data.pca_components=30", "data.patch_size=25",  # the paper's input
                            "parallel.accelerator=gpu", "parallel.precision=bf16-mixed"]))  # fmt: skip
    else:
        report("SKIP", "e.hybridsn_fit", "--dry-run: HybridSN at patch 25 (the compute-heavy model that calibrates "
               "e) takes minutes per epoch on a CPU; e.fp32 alone shows the path")  # fmt: skip
    options = CompareOptions(rows, [f"output.root={ctx.work / 'compare'}"], measure=True,
                             steps=DEFAULT_STEPS if ctx.cuda else 5, reference=False)  # fmt: skip
    measured, folder = run_compare(options, progress=print)  # progress goes to smoke.log
    profile = "h200"
    if ctx.cuda:
        from hslite.preflight.device_profile import device_for_gpu

        profile = device_for_gpu(torch.cuda.get_device_name(0)) or profile
    calibrations = []
    for fit in measured:
        with checking(f"e.{fit.label}"):
            if fit.measured_step_seconds is None:
                raise SmokeFailure(f"the compare row was not measured: {fit.failure}")
            row = _calibrate(folder / str(fit.run_dir), fit, profile)
            calibrations.append({"fit": fit.label, **row})
            dry = " [dry run: a CPU step against a GPU profile means nothing; the path runs]"
            report("PASS", f"e.{fit.label}", _calibration_line(row) + ("" if ctx.cuda else dry))
    ctx.save("calibration", {"profile": profile, "rows": calibrations, "note": CALIBRATION_NOTE})


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
    return (line + f"; to match: e = {row['efficiency_to_match']:.3g} if FLOP-bound (now {row['efficiency']:g}), "
            f"launch {row['launch_us_to_match']:.3g} µs/kernel if launch-bound (now {row['launch_us']:g})")  # fmt: skip


PARTS: dict[str, tuple[Callable[[Context], None], ...]] = {
    "b": (check_fits, check_strategies),
    "e": (check_calibration,),
}
