"""Sections of benchmarks/gpu_smoke.py that need torch but not Lightning's Trainer: the environment, (a) collectives
in one rank, (c) two ranks on one device, (d) the data path against the model. Each prints one line per check,
`PASS|FAIL|SKIP <section>.<check>: <detail>`; gpu_smoke.py runs each section in a process of its own.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import platform
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from time import perf_counter
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_smoke import ONE_GPU
from torch import Tensor, nn

MISSING_ON_THE_BOX = ("omegaconf", "platformdirs", "spectral", "rasterio")  # what the carried wheels bring


class SmokeFailure(Exception):
    """A check ran and its result was wrong."""


@dataclass(frozen=True)
class Context:
    """What every section knows of the run: dry run or CUDA, its scratch folder, its output folder."""

    dry_run: bool
    work: Path  # scratch shared by the sections of one run (fit runs, rank results), deleted at the end
    out: Path  # the run's output folder: figures are copied here

    @property
    def cuda(self) -> bool:
        """Whether the checks run on cuda:0 (every run but a dry run)."""
        return not self.dry_run

    @property
    def device(self) -> torch.device:
        """cuda:0, or the CPU in a dry run."""
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def accelerator(self) -> str:
        """hslite's parallel.accelerator for this run."""
        return "gpu" if self.cuda else "cpu"

    def save(self, name: str, data: Any) -> None:
        """Keep `data` for results.json under `name`."""
        folder = self.work / "results"
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def report(status: str, check: str, detail: str) -> None:
    """Print one check line, the only lines gpu_smoke.py counts."""
    print(f"{status} {check}: {detail}", flush=True)


def one_line(err: BaseException) -> str:
    """An exception as one short line: its type and its message's first line."""
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0][:300] if message else ''}"


@contextmanager
def checking(check: str) -> Iterator[None]:
    """Run one check; an exception becomes its FAIL line (the traceback goes to stderr, which smoke.log keeps)."""
    try:
        yield
    except Exception as err:
        traceback.print_exc()
        report("FAIL", check, one_line(err))


def exit_skipping_finalization(code: int) -> NoReturn:
    """End this process once its lines are flushed, without running the interpreter's finalization.

    Section a aborted once in CI after every check had passed and printed, and after its own
    `destroy_process_group` (which does join gloo's worker threads: 5 threads -> 2, measured): "terminate called
    without an active exception", SIGABRT, at interpreter finalization. A native thread that takes the GIL while the
    interpreter is torn down is ended by Python 3.11 with a forced unwind, which a noexcept C++ frame turns into
    `std::terminate` (pytorch/pytorch#179291); which thread did it here is not known. A check's verdict must not
    depend on it; a crash before the last line still fails the section.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so its errors and its time land in the check that caused them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def samples_per_second(step: Callable[[], object], samples: int, seconds: float, device: torch.device) -> float:
    """Run `step` (after one warm-up call) for about `seconds`; samples/s, the device's queue drained at the end."""
    step()
    synchronize(device)
    calls, start = 0, perf_counter()
    while perf_counter() - start < seconds:
        step()
        calls += 1
    synchronize(device)
    return calls * samples / (perf_counter() - start)


# ------------------------------------------------------------------------------------------------------ environment
def check_environment(ctx: Context) -> None:
    """Versions, the GPU, the packages the wheels bring and whether the C patch gather was built."""
    cores = len(os.sched_getaffinity(0))
    report("PASS", "env.python", f"python {platform.python_version()}, torch {torch.__version__} (CUDA "
           f"{torch.version.cuda}), {cores} CPU cores")  # fmt: skip
    if ctx.dry_run:
        report("SKIP", "env.gpu", "--dry-run: everything runs on the CPU (gloo instead of NCCL)")
    elif not torch.cuda.is_available():
        report("FAIL", "env.gpu", "torch sees no CUDA device (torch.cuda.is_available() is False)")
    else:
        props = torch.cuda.get_device_properties(0)
        report("PASS", "env.gpu", f"{torch.cuda.device_count()} × {props.name}, {props.total_memory / 2**30:.1f} GiB, "
               f"compute capability {props.major}.{props.minor}, NCCL {torch.cuda.nccl.version()}")  # fmt: skip
    missing = [name for name in MISSING_ON_THE_BOX if importlib.util.find_spec(name) is None]
    with checking("env.hslite"):
        import hslite.datasets.batches.patches as patches

        if missing:
            raise SmokeFailure(f"{', '.join(missing)} not importable: the wheels were not installed")
        where = Path(patches.__file__).parents[2]
        report("PASS", "env.hslite", f"hslite and {', '.join(MISSING_ON_THE_BOX)} import (hslite from {where})")
        if patches._patchgather is None:
            report("SKIP", "env.c_kernel", "hslite's C patch gather was not built (no C compiler at install?): CPU "
                   "batches are gathered with torch ops")  # fmt: skip
        else:
            report("PASS", "env.c_kernel", f"C patch gather built: {Path(patches._patchgather.__file__).name}")


# ---------------------------------------------------------------------------------------------- (a) fences, collectives
def _served_by(device: torch.device) -> str:
    """The backend the default group hands a tensor of this device type to (ProcessGroupNCCL, ProcessGroupGloo)."""
    return type(dist.group.WORLD._get_backend(device)).__name__


def check_fences(ctx: Context) -> None:
    """(a) hslite's fence on a group bound to the device as Lightning binds it: over its own gloo group, not NCCL."""
    from hslite.parallel.deadlines import fence_group

    bound = dist.distributed_c10d._get_default_group().bound_device_id
    with checking("a.bound_group"):
        if not ctx.cuda:
            report("SKIP", "a.bound_group", "--dry-run: torch binds a group to an accelerator only, so a barrier has "
                   "no GPU to go over here; on the box the group is bound to cuda:0")  # fmt: skip
        elif bound != ctx.device:
            raise SmokeFailure(f"the group is bound to {bound}, not {ctx.device}: the fence checks below do not see "
                               "what a Lightning rank's group does")  # fmt: skip
        else:
            report("PASS", "a.bound_group", f"bound to {bound}, as Lightning binds a rank's group: "
                   f"a plain dist.barrier() takes the bound device first and goes over {_served_by(ctx.device)}, "
                   "whose barrier ignores a deadline of its own")  # fmt: skip
    with checking("a.fence_group"):
        group = fence_group()  # what deadlines.fence waits on at ≥ 2 ranks (at one it returns before)
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise SmokeFailure(f"hslite's fence group has backend {backend!r}: its barrier would not be gloo's")
        seconds = 10
        start = perf_counter()
        # monitored_barrier refuses any backend but gloo: this raises where the fence would go over NCCL
        dist.monitored_barrier(group, timeout=timedelta(seconds=seconds), wait_all_ranks=True)
        report("PASS", "a.fence_group", f"deadlines.fence_group() is a gloo group beside the default one (bound to "
               f"{bound}); the fence's monitored_barrier on it took {(perf_counter() - start) * 1e3:.1f} ms under a "
               f"{seconds} s deadline of its own")  # fmt: skip


def check_collectives(ctx: Context) -> None:
    """(a) Every collective hslite issues, in the bound one-rank group with hslite's own backend, on device tensors."""
    backend = dist.get_backend()
    device = ctx.device
    x = torch.arange(1.0, 9.0, device=device)

    def reduced(op: dist.ReduceOp) -> Tensor:
        y = x.clone()
        dist.all_reduce(y, op)
        return y

    def into(collective: Callable[..., object]) -> Tensor:
        out = torch.empty_like(x)
        collective(out, x)
        return out

    def broadcast() -> Tensor:
        y = x.clone()
        dist.broadcast(y, src=0)
        return y

    tensor_checks: dict[str, Callable[[], Tensor]] = {
        "all_reduce_sum": lambda: reduced(dist.ReduceOp.SUM),
        "all_reduce_max": lambda: reduced(dist.ReduceOp.MAX),
        "all_reduce_avg": lambda: reduced(dist.ReduceOp.AVG),
        "all_gather_into_tensor": lambda: into(dist.all_gather_into_tensor),
        "all_to_all_single": lambda: into(dist.all_to_all_single),
        "reduce_scatter_tensor": lambda: into(dist.reduce_scatter_tensor),
        "broadcast": broadcast,
    }
    for name, collective in tensor_checks.items():
        with checking(f"a.{name}"):
            got = collective()
            synchronize(device)
            if got.device != device or not torch.equal(got, x):
                raise SmokeFailure(f"one rank's result should be its input {x.tolist()}, got {got.tolist()}")
            report("PASS", f"a.{name}", f"{device.type} tensor, backend {backend!r}, served by {_served_by(device)}")
    with checking("a.all_gather_object"):
        gathered: list[Any] = [None]
        dist.all_gather_object(gathered, {"rank": 0, "step": 3})
        if gathered != [{"rank": 0, "step": 3}]:
            raise SmokeFailure(f"gathered {gathered}")
        report("PASS", "a.all_gather_object", f"a dict, backend {backend!r}")
    with checking("a.cpu_all_reduce_max"):
        host = torch.tensor([1.0, 5.0, 3.0])  # a host figure (timings, usage), as hslite reduces once an epoch
        dist.all_reduce(host, dist.ReduceOp.MAX)
        served = _served_by(host.device)
        if served != "ProcessGroupGloo" or host.tolist() != [1.0, 5.0, 3.0]:
            raise SmokeFailure(f"a CPU tensor went to {served} and came back {host.tolist()}; it should go over gloo")
        report("PASS", "a.cpu_all_reduce_max", f"CPU tensor on the same group, served by {served}")


def check_bound_group(ctx: Context) -> None:
    """(a) One rank's group as Lightning makes it on a GPU, bound to cuda:0: its fences, then its collectives."""
    from hslite.parallel.trainer.trainer_args import process_group_backend

    bound = {}
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)  # object collectives over NCCL use the current device
        bound["device_id"] = ctx.device  # Lightning's _init_dist_connection passes the rank's GPU
    init = f"file://{ctx.work / 'a.init'}"
    dist.init_process_group(process_group_backend(ctx.accelerator), init_method=init, rank=0, world_size=1,
                            timeout=timedelta(seconds=60), **bound)  # fmt: skip
    try:
        check_fences(ctx)
        check_collectives(ctx)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- (c) two ranks, one device
_UNSUPPORTED = re.compile(r"not supported|unsupported|not implemented|no backend type", re.IGNORECASE)


def _relative_error(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _gloo_all_reduce(rank: int, device: torch.device) -> str:
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    synchronize(device)
    if not torch.equal(x, torch.full_like(x, 3.0)):
        raise SmokeFailure(f"the sum of 1 and 2 came back {x[:4].tolist()}")
    return f"{device.type} tensor summed over 2 gloo ranks"


def _int8_hook(rank: int, device: torch.device) -> str:
    from torch.nn.parallel import DistributedDataParallel

    from hslite.parallel.compression.hook import dispatch_hook
    from hslite.parallel.compression.state import CompressionState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = CompressionState("int8")  # registered as CompressedDDPStrategy.configure_ddp registers it
    state.bind(model)
    ddp.register_comm_hook(state, dispatch_hook)
    generator = torch.Generator().manual_seed(rank + 1)  # each rank its own batch
    x, y = torch.randn(32, 64, generator=generator).to(device), torch.randint(0, 10, (32,), generator=generator)
    nn.functional.cross_entropy(ddp(x), y.to(device)).backward()
    nn.functional.cross_entropy(reference(x), y.to(device)).backward()
    hooked = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    mean = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])  # type: ignore[union-attr]
    largest = mean.abs().max().reshape(1)
    dist.all_reduce(mean)
    mean /= 2
    dist.all_reduce(largest, dist.ReduceOp.MAX)
    # Two int8 roundings (each rank's gradients, then their mean), each at most half a step of 1/127 of a chunk's
    # largest value, and a chunk may span parameters: 2/127 of the largest gradient bounds one call's error.
    worst = float((hooked - mean).abs().max() / (2 / 127 * largest))
    if state.calls["int8"] == 0 or worst > 1.0:
        raise SmokeFailure(f"{state.calls['int8']} int8 hook calls, error {worst:.2f}× the int8 bound")
    return (f"DDP over gloo on {device.type} tensors with hslite's int8 hook: {state.calls['int8']} call(s), "
            f"gradients within {worst:.0%} of the int8 bound, {state.bytes_sent} bytes sent per rank")  # fmt: skip


def _token_exchange(rank: int, device: torch.device) -> str:
    from hslite.models import get_model
    from hslite.parallel.channels.channel_groups import ChannelGroups

    torch.manual_seed(0)
    bands = 32
    model = get_model("channel_vit", in_bands=bands, num_classes=5, patch_size=5, num_groups=4,
                      wavelengths_nm=np.linspace(400.0, 2500.0, bands)).to(device)  # fmt: skip
    reference = copy.deepcopy(model)
    groups = ChannelGroups([stop - start for start, stop in model.band_groups], chag=2, chag_rank=rank)
    generator = torch.Generator().manual_seed(1)  # both ranks read the same batch, as a chag group does
    x = torch.randn(7, bands, 5, 5, generator=generator).to(device)  # 7: the two ranks' slices differ
    y = torch.randint(0, 5, (7,), generator=generator).to(device)
    loss = nn.CrossEntropyLoss()
    logits = groups(model, x)
    groups.loss_share(loss, logits, y).backward()
    expected = reference(x)
    loss(expected, y).backward()
    errors = {"logits": _relative_error(logits.detach(), groups.own_samples(expected.detach()))}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)  # a group this rank does not own
        dist.all_reduce(grad)  # DDP's average over the two chag ranks
        assert q.grad is not None
        errors[f"grad {name}"] = _relative_error(grad / 2, q.grad)
    worst = max(errors, key=lambda key: errors[key])
    if errors[worst] > 1e-4:
        raise SmokeFailure(f"{worst} differs from one process's by {errors[worst]:.2g} (relative)")
    return (f"channel_vit's 4 band groups split over 2 ranks on {device.type}: logits and all {len(errors) - 1} "
            f"gradients equal one process's (worst {errors[worst]:.1g}, {worst}); {groups.bytes_received} bytes "
            "received")  # fmt: skip


def _two_rank_worker(rank: int, ctx: Context) -> None:
    init = f"file://{ctx.work / 'c.init'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    from hslite.parallel.cuda_math import set_cuda_math

    set_cuda_math(tf32=False, cudnn_benchmark=False)  # exact comparisons
    results = {}
    for name, check in (("gloo_all_reduce", _gloo_all_reduce), ("int8_hook", _int8_hook),
                        ("token_exchange", _token_exchange)):  # fmt: skip
        try:
            results[name] = ("PASS", check(rank, ctx.device))
        except Exception as err:
            traceback.print_exc()
            if _UNSUPPORTED.search(str(err)):
                why = f"gloo cannot run it on {ctx.device.type} tensors in torch {torch.__version__}: "
                results[name] = ("SKIP", why + one_line(err))
            else:
                results[name] = ("FAIL", one_line(err))
    (ctx.work / f"c.rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    exit_skipping_finalization(0)  # a clean end for mp.spawn, whose child would otherwise finalize (see there)


def check_two_ranks(ctx: Context) -> None:
    """(c) Two gloo ranks on one device: the int8 hook's and the token exchange's collectives across processes."""
    if ctx.cuda and torch.cuda.device_count() == 1:
        report("SKIP", "c.nccl_two_ranks", f"{ONE_GPU} (NCCL refuses two ranks on one GPU, 'duplicate GPU'): the "
               "int8 hook's and the token exchange's collectives are not run over NCCL; the two ranks below share "
               "cuda:0 over gloo, which stages CUDA tensors through host memory")  # fmt: skip
    mp.spawn(_two_rank_worker, args=(ctx,), nprocs=2, join=True)
    ranks = [json.loads((ctx.work / f"c.rank{rank}.json").read_text()) for rank in range(2)]
    for name in ranks[0]:
        outcomes = [tuple(outcome[name]) for outcome in ranks]
        status = next((s for s in ("FAIL", "SKIP") if any(o[0] == s for o in outcomes)), "PASS")
        detail = next(o[1] for o in outcomes if o[0] == status)
        report(status, f"c.{name}", detail)


# ------------------------------------------------------------------------------------------------- (d) data path
DRY_RUN_RECIPES = ("salinas_a_1gpu",)  # a small model: its step takes milliseconds on a CPU at batch 8


def _recipes_by_shape(ctx: Context) -> dict[tuple[Any, ...], list[str]]:
    """The shipped GPU recipes, grouped by what the data path and one device's step depend on."""
    from hslite.recipe.config import list_recipes, load_config

    names = DRY_RUN_RECIPES if ctx.dry_run else [name for name in list_recipes() if "gpu" in name]
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in names:
        d, m = (cfg := load_config(name)).data, cfg.model
        key = (d.scene, d.pca_components, d.drop_water_bands, d.patch_size, d.batch_size, m.name, m.size,
               m.band_groups, cfg.parallel.precision, cfg.parallel.tf32, cfg.parallel.cudnn_benchmark)  # fmt: skip
        groups.setdefault(key, []).append(name)
    return groups


def _model_samples_per_second(ctx: Context, recipe: str, bands: int, classes: int, batch: int, seconds: float) -> float:
    """One device's training step (forward, backward, AdamW) at the recipe's batch and precision, in samples/s."""
    from hslite.optim import adamw
    from hslite.parallel.cuda_math import set_cuda_math
    from hslite.recipe.build import model_for
    from hslite.recipe.config import load_config

    cfg = load_config(recipe)
    set_cuda_math(cfg.parallel.tf32, cfg.parallel.cudnn_benchmark)  # as RankSetup sets them for training
    model = model_for(cfg, bands, classes, None).to(ctx.device)
    optimizer = adamw(model.parameters())
    p = cfg.data.patch_size
    x = torch.randn(batch, bands, p, p, device=ctx.device)
    y = torch.randint(0, classes, (batch,), device=ctx.device)
    amp = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(cfg.parallel.precision)

    def step() -> None:
        with torch.autocast(ctx.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # cuDNN's benchmark mode times its kernels on the first steps
        step()
    return samples_per_second(step, batch, seconds, ctx.device)


def _data_rates(ctx: Context, recipe: str) -> dict[str, Any]:
    """Samples/s of every gather and copy of a batch of this recipe, and of the model consuming them."""
    from hslite.datasets.batches.patches import PatchGatherer
    from hslite.datasets.scenes.registry import get_scene_spec
    from hslite.recipe.config import load_config

    cfg = load_config(recipe)
    spec = get_scene_spec(cfg.data.scene)
    rows, cols, raw_bands = (24, 24, spec.shape[2]) if ctx.dry_run else spec.shape
    bands = cfg.data.pca_components or raw_bands - (len(spec.water_bands) if cfg.data.drop_water_bands else 0)
    p, batch = cfg.data.patch_size, 8 if ctx.dry_run else cfg.data.batch_size
    seconds = 0.05 if ctx.dry_run else 0.2  # per rate: 6 rates of 14 recipe shapes fit in d's limit
    rng = np.random.default_rng(0)
    padded = rng.random((rows + p - 1, cols + p - 1, bands), dtype=np.float32)  # the real scene is not on the box
    batches = [torch.from_numpy(np.stack([rng.integers(0, rows, batch), rng.integers(0, cols, batch)], 1))
               for _ in range(64)]  # fmt: skip

    def gather_rate(gatherer: PatchGatherer) -> float:
        on_device = [coords.to(gatherer.device) for coords in batches]
        turn = iter(range(10**9))
        return samples_per_second(lambda: gatherer.gather(on_device[next(turn) % 64]), batch, seconds, gatherer.device)

    native = PatchGatherer(padded, p)
    rates: dict[str, Any] = {"shape": f"{rows}×{cols}×{bands}", "patch": p, "batch": batch, "model": cfg.model.name,
                             "precision": cfg.parallel.precision}  # fmt: skip
    rates["C gather"] = gather_rate(native) if native.native else None
    rates["torch gather"] = gather_rate(PatchGatherer(padded, p, use_kernel=False))
    if ctx.cuda:
        rates["GPU gather"] = gather_rate(PatchGatherer(padded, p, device=ctx.device))
        host = native.gather(batches[0])
        pinned = host.pin_memory()
        rates["pageable copy"] = samples_per_second(lambda: host.to(ctx.device), batch, seconds, ctx.device)
        rates["pinned copy"] = samples_per_second(lambda: pinned.to(ctx.device, non_blocking=True), batch, seconds,
                                                  ctx.device)  # fmt: skip
    rates["model step"] = _model_samples_per_second(ctx, recipe, bands, len(spec.class_names), batch, seconds)
    return rates


def _data_line(rates: dict[str, Any], also: list[str]) -> str:
    """One recipe's rates in words, and whether the host path (gather, then copy) keeps up with the model."""
    model, gather = rates["model step"], rates["C gather"] or rates["torch gather"]
    copy_rate = rates.get("pinned copy")  # none in a dry run: the batch stays on the host
    host = 1 / (1 / gather + 1 / copy_rate) if copy_rate else gather  # one after the other, per batch
    path = ("C" if rates["C gather"] else "torch") + " gather" + (" + pinned copy" if copy_rate else "")
    shown = {name: rate for name, rate in rates.items() if name.endswith(("gather", "copy")) and rate}
    rated = ", ".join(f"{name} {rate:,.0f}" for name, rate in shown.items())
    verdict = "keeps up" if host >= model else "data-bound"
    return (f"{rates['model']} {rates['shape']} p{rates['patch']} b{rates['batch']} {rates['precision']}"
            + (f" (also {', '.join(also)})" if also else "") + f": model step {model:,.0f} samples/s; {rated}"
            + ("; C gather not built" if rates["C gather"] is None else "")
            + f"; {path} {host:,.0f}/s = {host / model:.1f}× the model: {verdict}")  # fmt: skip


def check_data_path(ctx: Context) -> None:
    """(d) Each shipped GPU recipe's batch: C, torch and GPU gathers, pageable and pinned copies, against its step."""
    table = {}
    for first, *also in _recipes_by_shape(ctx).values():
        with checking(f"d.{first}"):
            table[first] = _data_rates(ctx, first)
            report("PASS", f"d.{first}", _data_line(table[first], also))
    if not ctx.cuda:
        report("SKIP", "d.gpu_paths", "--dry-run: the GPU gather (the cube kept on the device) and the pageable and "
               "pinned host-to-device copies need a CUDA device")  # fmt: skip
    ctx.save("data_path", {"samples_per_second": table, "shapes": "random cubes of each scene's shape, which is "
                           "all the gathers' speed depends on (the real scenes are not on the box)"})  # fmt: skip


PARTS: dict[str, tuple[Callable[[Context], None], ...]] = {
    "a": (check_bound_group,),
    "c": (check_two_ranks,),
    "d": (check_data_path,),
}
