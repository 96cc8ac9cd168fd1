"""Measure one device: forward, backward, optimiser and data time, a linear compute model, and peak memory.

`probe_model` runs a few real training steps of the model on one device (CUDA events on GPU) at the requested
batch size and at half of it, counts the bytes autograd saves for backward, and caches the result as JSON under the
user cache dir. On CPU the "devices" are processes sharing the cores, so probe with the threads one rank would get:
`threads_per_process(plan)`. On GPU it times with the plan's CUDA math (TF32, cuDNN benchmark) and hands the memory
it cached back to the device when done, so the ranks that start after it find it free.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hslite.allocator import keep_freed_memory
from hslite.cache import read_cache, write_cache
from hslite.errors import ConfigError
from hslite.optim import adamw
from hslite.parallel.plan import PRECISIONS, Plan, process_group_backend, threads_per_process
from hslite.preflight.activations import SavedTensorCounter, measure_tokenizer
from hslite.preflight.formulas import fit_compute_model
from hslite.preflight.measurements import Footprint, ProbeResult
from hslite.preflight.timers import autocast, cuda_math, intervals_seconds, mark, wall_seconds

PROBE_FIELDS_VERSION = 4  # bump when ProbeResult gains a measured field, so cached probes are re-measured
COMPRESSION_PROBE_MAX_ELEMENTS = 1 << 24  # 64 MB of fp32 is enough to reach the per-byte rate; bigger only costs time
PROBE_DEVICE = "cuda:0"  # the one GPU a GPU plan is probed on; the launching process touches no other


def probe_for_plans(
    model_factory: Callable[[], nn.Module], make_batch: Callable[[int], tuple[Tensor, Tensor]], **probe_kwargs: Any
) -> Callable[[Plan], ProbeResult]:
    """A `probe_for` for `run_preflight`: probes at the plan's batch and precision.

    GPU plans are probed on PROBE_DEVICE with the plan's TF32 and cuDNN-benchmark settings, CPU plans with the
    threads one rank gets and with the plan's ranks stepping at once, for their contention (`measure_contention`).
    `probe_kwargs` go to `probe_model`
    (cache_key, fresh, steps, measure_compression, measure_fsdp, tokenizer_modules, band_group_sizes, ...).
    """

    def probe_for(plan: Plan) -> ProbeResult:
        on_gpu = plan.accelerator == "gpu"
        return probe_model(model_factory, make_batch, batch_size=plan.batch_size, precision=plan.precision,
                           device=PROBE_DEVICE if on_gpu else "cpu",
                           threads=None if on_gpu else threads_per_process(plan),
                           concurrent_ranks=1 if on_gpu else plan.devices, tf32=plan.tf32,
                           cudnn_benchmark=plan.cudnn_benchmark, **probe_kwargs)  # fmt: skip

    return probe_for


def probe_model(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    *,
    batch_size: int,
    precision: str,
    device: str = "cpu",
    threads: int | None = None,
    warmup: int = 2,
    steps: int = 5,
    cache_key: str | None = None,
    fresh: bool = False,
    measure_compression: bool = False,
    measure_fsdp: bool = False,
    tokenizer_modules: tuple[str, ...] = (),
    band_group_sizes: list[int] | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy,
    budget_seconds: float = 10.0,  # timed steps stop here; a normal 3D-CNN probe needs ~3 s on 2 cores
    concurrent_ranks: int = 1,
    tf32: bool = True,  # CUDA only, as Plan.tf32
    cudnn_benchmark: bool = True,  # CUDA only, as Plan.cudnn_benchmark
) -> ProbeResult:
    """Measure one training step of `model_factory()` on one device; cached when `cache_key` is given.

    Times are medians of `steps` after `warmup`, at `batch_size` and at half of it (for c0/c1); the timed loop stops
    early once `budget_seconds` is spent (AMP on an AVX2 CPU can take seconds per step). `tokenizer_modules` name
    the submodules (as in `named_modules()`) whose work channel groups split, e.g. ("tokenizer",
    "partial_aggregation") for channel_vit: their share of forward time and of activation bytes is measured, and the
    output of the last one, summed over its calls, is the group-token size per sample. `concurrent_ranks` > 1 on
    CPU also measures how much slower a step runs with that many ranks at once (`measure_contention`), the
    spawned processes needing the caller's `if __name__ == "__main__":` guard. On CUDA every step is timed with
    `tf32` and `cudnn_benchmark` set as training sets them (the process's own settings come back after), and the
    allocator's cache is emptied once measured (`_release_cuda_memory`). `fresh=True` re-measures.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ConfigError(f"probe needs batch_size ≥ 1, steps ≥ 1, warmup ≥ 0; got {batch_size}, {steps}, {warmup}.")
    dev = torch.device(device)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    key = {
        "cache_key": cache_key,
        "batch_size": batch_size,
        "precision": precision,
        "device": _device_label(dev),
        "threads": torch.get_num_threads(),
        "measure_compression": measure_compression,
        "measure_fsdp": measure_fsdp,
        "tokenizer_modules": list(tokenizer_modules),
        "band_group_sizes": band_group_sizes,
        "concurrent_ranks": concurrent_ranks if dev.type == "cpu" else 1,
        # The CPU reads neither switch, so a CPU probe is the same measurement whatever the plan says.
        "tf32": tf32 if dev.type == "cuda" else None,
        "cudnn_benchmark": cudnn_benchmark if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "allocator_keeps_memory": keep_freed_memory(),
        "fields": PROBE_FIELDS_VERSION,
    }
    try:
        cached = None if cache_key is None or fresh else read_cache("probe", key)
        if cached is not None:
            return ProbeResult.from_dict(cached)
        with _probing(dev, tf32, cudnn_benchmark):
            result = _measure(
                model_factory,
                make_batch,
                batch_size,
                precision,
                dev,
                warmup,
                steps,
                loss_fn,
                time.monotonic() + budget_seconds,
            )
            if measure_compression:
                result.compress_seconds_per_byte = _int8_seconds_per_byte(result.param_count, dev)
            overhead = measure_fsdp_overhead(model_factory, make_batch(batch_size), result, loss_fn, warmup, steps) \
                if measure_fsdp else None  # fmt: skip
            if overhead is not None:
                result.fsdp_micro_overhead_seconds, result.fsdp_optimizer_overhead_seconds = overhead
            if tokenizer_modules:
                names = tuple(tokenizer_modules)
                result.chag_fraction = measure_tokenizer(
                    result, model_factory, make_batch, names, precision, dev, loss_fn
                )
                result.band_group_sizes = band_group_sizes
            if dev.type == "cpu" and concurrent_ranks > 1:
                alone_seconds = result.forward_seconds + result.backward_seconds + result.optimizer_seconds
                result.contention = measure_contention(model_factory(), make_batch(batch_size), ranks=concurrent_ranks,
                                                       threads=torch.get_num_threads(), precision=precision,
                                                       alone_seconds=alone_seconds, loss_fn=loss_fn, warmup=warmup,
                                                       steps=steps)  # fmt: skip
                result.contention_ranks = concurrent_ranks
    finally:
        torch.set_num_threads(previous_threads)
    if cache_key is not None:
        write_cache("probe", key, result.to_dict())
    return result


@contextlib.contextmanager
def _probing(dev: torch.device, tf32: bool, cudnn_benchmark: bool) -> Iterator[None]:
    """The plan's CUDA math while the probe measures on `dev`; after it, what the probe cached handed back to CUDA."""
    with cuda_math(tf32, cudnn_benchmark, dev):
        try:
            yield
        finally:
            if dev.type == "cuda":
                _release_cuda_memory()


def _release_cuda_memory() -> None:
    """Hand what the probe's models, optimisers and batches left in torch's CUDA caches back to the device.

    Freed tensors stay reserved by this process's caching allocator, and the ranks start after the probe (in other
    processes, or this one with other tensors): without this they would find the probe's peak missing from their
    GPU, and `gate` prices the memory free after the probe. FSDP2's state and its module refer to each other, so a
    sharded model is freed by the cycle collector, not on return; cuBLAS keeps its workspaces outside what
    `empty_cache` releases (pytorch/pytorch#95668; Lightning's CUDA teardown clears those two the same way).
    """
    gc.collect()
    clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_cublas_workspaces is not None:  # absent from CPU builds of torch
        clear_cublas_workspaces()
    torch.cuda.empty_cache()


def _timed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    precision: str,
    dev: torch.device,
    loss_fn: Callable[..., Tensor],
) -> list[float]:
    """One training step: seconds of forward (with the loss), backward, and the optimiser step with zero_grad."""
    marks = [mark(dev)]
    with autocast(precision, dev):
        loss = loss_fn(model(x), y)
    marks.append(mark(dev))
    loss.backward()
    marks.append(mark(dev))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    marks.append(mark(dev))
    return intervals_seconds(marks, dev)


def measure_contention(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    *,
    ranks: int,
    threads: int,
    precision: str,
    alone_seconds: float,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy,
    warmup: int = 2,
    steps: int = 5,
    window_seconds: float = 0.5,
) -> float:
    """How many times slower a CPU rank's training step runs while `ranks` processes run it at once: at least 1.

    CPU ranks share more than cores: the L3 cache and the memory bandwidth. For the small channel ViT on a 2-core
    EPYC this measured 1.2-1.9× with two 1-thread ranks (batch 64, runs an hour apart) and about 3× with four,
    where the core count alone says 1× and 2×; predictions from the rank alone were short by as much. So `ranks` spawned
    processes with `threads` threads each start the probe's step together (a barrier after warm-up) and time
    steps of it for `window_seconds` at least, so that they overlap even when a step takes a millisecond; the
    slowest rank's median, which DDP waits for, over `alone_seconds` (the same step in one process with the same
    threads) is the factor.
    """
    context = torch.multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.SimpleQueue()
    args = (model, batch, threads, precision, loss_fn, warmup, steps, window_seconds, barrier, results)
    torch.multiprocessing.start_processes(_contention_rank, args=args, nprocs=ranks, start_method="spawn")
    slowest = max(results.get() for _ in range(ranks))
    return max(1.0, slowest / alone_seconds)


def _contention_rank(
    rank: int,
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    threads: int,
    precision: str,
    loss_fn: Callable[..., Tensor],
    warmup: int,
    steps: int,
    window_seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    keep_freed_memory()
    dev = torch.device("cpu")
    optimizer = adamw(model.parameters())
    for _ in range(warmup):
        _timed_step(model, optimizer, *batch, precision, dev, loss_fn)
    barrier.wait()
    timed: list[float] = []
    end = time.monotonic() + window_seconds
    while len(timed) < steps or time.monotonic() < end:
        timed.append(sum(_timed_step(model, optimizer, *batch, precision, dev, loss_fn)))
    results.put(statistics.median(timed))


def _device_label(dev: torch.device) -> str:
    return f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else str(dev)


def _measure(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    batch_size: int,
    precision: str,
    dev: torch.device,
    warmup: int,
    steps: int,
    loss_fn: Callable[..., Tensor],
    deadline: float,
) -> ProbeResult:
    torch.manual_seed(0)
    model = model_factory().to(dev).train()
    optimizer = adamw(model.parameters())

    def batch_on_device(b: int) -> tuple[Tensor, Tensor]:
        x, y = make_batch(b)
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    def step(x: Tensor, y: Tensor) -> list[float]:
        return _timed_step(model, optimizer, x, y, precision, dev, loss_fn)

    def median_step(b: int, stop_at: float, warmup_steps: int) -> list[float]:
        x, y = batch_on_device(b)
        for _ in range(warmup_steps):
            step(x, y)
        timed = [step(x, y)]
        while len(timed) < steps and time.monotonic() < stop_at:
            timed.append(step(x, y))
        return [statistics.median(column) for column in zip(*timed, strict=True)]

    data_seconds = statistics.median(wall_seconds(lambda: batch_on_device(batch_size), dev) for _ in range(3))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    now = time.monotonic()
    forward_seconds, backward_seconds, optimizer_seconds = median_step(batch_size, now + 0.6 * (deadline - now), warmup)
    gpu_peak_bytes = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    half_batch = batch_size // 2 if batch_size > 1 else 2
    half_forward, half_backward, _ = median_step(half_batch, deadline, min(warmup, 1))  # kernels are warm by now
    c0, c1 = fit_compute_model(
        [batch_size, half_batch], [forward_seconds + backward_seconds, half_forward + half_backward]
    )

    sizes = _sizes(model, optimizer, *batch_on_device(batch_size), precision, dev, loss_fn)
    counted_bytes = sum(sizes[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
    return ProbeResult(
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        optimizer_seconds=optimizer_seconds,
        data_seconds=data_seconds,
        batch_size=batch_size,
        precision=precision,
        threads=torch.get_num_threads(),
        device=_device_label(dev),
        **sizes,
        peak_bytes=gpu_peak_bytes if gpu_peak_bytes is not None else counted_bytes,
        compute_c0_seconds=c0,
        compute_c1_seconds_per_sample=c1,
    )


def measure_footprint(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    *,
    batch_size: int,
    precision: str,
    tokenizer_modules: tuple[str, ...] = (),
    band_group_sizes: list[int] | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy,
) -> Footprint:
    """Bytes one rank holds at `batch_size` and `precision`, counted on this CPU with the model's own tensors.

    For devices that are not here: parameters, gradients and AdamW state after one optimiser step (at batch 2),
    and the bytes autograd saves in one forward at `batch_size`, with the tokenizer's share of them and the group
    tokens' size when `tokenizer_modules` are named (channel groups and rotation divide those). Nothing is timed
    for pricing; allocator and kernel workspace of the absent device are not known, so `peak_bytes` counts the
    four terms only.
    """
    dev = torch.device("cpu")
    torch.manual_seed(0)
    model = model_factory().train()
    optimizer = adamw(model.parameters())
    x, y = make_batch(2)
    with autocast(precision, dev):
        loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()  # AdamW makes its state on the first step
    sizes = _sizes(model, optimizer, *make_batch(batch_size), precision, dev, loss_fn)
    peak_bytes = sum(sizes[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"))
    footprint = Footprint(batch_size=batch_size, precision=precision, device="cpu (sizes only)",
                          peak_bytes=peak_bytes, band_group_sizes=band_group_sizes, **sizes)  # fmt: skip
    if tokenizer_modules:
        measure_tokenizer(footprint, model_factory, make_batch, tokenizer_modules, precision, dev, loss_fn)
    return footprint


def _sizes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: Tensor,
    y: Tensor,
    precision: str,
    dev: torch.device,
    loss_fn: Callable[..., Tensor],
) -> dict[str, Any]:  # ints, typed loosely to unpack into dataclasses with fields of other types too
    params = list(model.parameters())
    counter = SavedTensorCounter(model)
    with autocast(precision, dev), counter:
        loss_fn(model(x), y)  # the graph keeps every saved storage alive, so pointers cannot be reused meanwhile
    return {
        "param_count": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),  # the params' dtype
        "optimizer_bytes": _unique_bytes(
            t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
        ),
        "activation_bytes": counter.total_bytes,
        **_fsdp_sizes(model),
    }


def _fsdp_sizes(model: nn.Module) -> dict[str, int | None]:
    from hslite.parallel.fsdp_policy import gathered_param_bytes, unit_count

    try:
        return {"fsdp_gathered_bytes": gathered_param_bytes(model), "fsdp_units": unit_count(model)}
    except TypeError:  # no wrapping policy for this module: FSDP cannot shard it
        return {"fsdp_gathered_bytes": None, "fsdp_units": None}


def measure_fsdp_overhead(
    model_factory: Callable[[], nn.Module],
    batch: tuple[Tensor, Tensor],
    plain: ProbeResult,
    loss_fn: Callable[..., Tensor] = nn.functional.cross_entropy,
    warmup: int = 2,
    steps: int = 5,
) -> tuple[float, float] | None:
    """FSDP2's own seconds per micro-step and per optimiser step on one rank, beyond `plain`'s step.

    The model is sharded over a one-rank process group, so its collectives are copies and what is timed is what
    FSDP adds at any world size: unit hooks, gathering into and out of flat buffers, DTensor dispatch in AdamW
    (2-3× the plain step for the small channel ViT on CPU). None when a process group already exists here.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hslite.parallel.fsdp_policy import shard_model

    if dist.is_initialized():
        return None
    dev = torch.device(plain.device.split(" ")[0])
    # The ranks' own backend: FSDP2 is timed over the groups training uses, and a CPU tensor handed to a collective
    # finds gloo as it would in training, instead of failing on an NCCL-only group.
    backend = process_group_backend("gpu" if dev.type == "cuda" else "cpu")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = model_factory().to(dev).train()
        shard_model(model, init_device_mesh(dev.type, (1,)), plain.precision)
        optimizer = adamw(model.parameters())
        x, y = (t.to(dev) for t in batch)
        for _ in range(warmup):
            _timed_step(model, optimizer, x, y, plain.precision, dev, loss_fn)
        timed = [_timed_step(model, optimizer, x, y, plain.precision, dev, loss_fn) for _ in range(steps)]
    finally:
        dist.destroy_process_group()
    forward, backward, step = (statistics.median(column) for column in zip(*timed, strict=True))
    micro = forward + backward - plain.forward_seconds - plain.backward_seconds
    return max(0.0, micro), max(0.0, step - plain.optimizer_seconds)


def _unique_bytes(tensors: Iterator[Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _int8_seconds_per_byte(param_count: int, dev: torch.device) -> float:
    # Mirrors an error-feedback int8 hook: add the residual, scale by the max, round, cast, dequantise, keep the error.
    grad = torch.randn(max(1, min(param_count, COMPRESSION_PROBE_MAX_ELEMENTS)), device=dev)
    residual = torch.zeros_like(grad)

    def quantise_dequantise() -> None:
        corrected = grad + residual
        scale = corrected.abs().max().clamp_min(1e-12) / 127
        restored = (corrected / scale).round_().clamp_(-127, 127).to(torch.int8).to(torch.float32) * scale
        residual.copy_(corrected - restored)

    quantise_dequantise()
    seconds = statistics.median(wall_seconds(quantise_dequantise, dev) for _ in range(5))
    return seconds / (grad.numel() * grad.element_size())
