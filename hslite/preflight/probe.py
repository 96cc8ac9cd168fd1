"""Measure one device: forward, backward, optimiser and data time, a linear compute model, and peak memory.

`probe_model` runs a few real training steps of the model on one device (CUDA events on GPU) at the requested
batch size and at half of it, counts the bytes autograd saves for backward, and caches the result as JSON under the
user cache dir. On CPU the "devices" are processes sharing the cores, so probe with the threads one rank would get:
`threads_per_process(plan)`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.parallel.plan import PRECISIONS, Plan
from hslite.preflight import read_cache, write_cache
from hslite.preflight.costmodel import fit_compute_model

COMPRESSION_PROBE_MAX_ELEMENTS = 1 << 24  # 64 MB of fp32 is enough to reach the per-byte rate; bigger only costs time


@dataclass
class ProbeResult:
    """One device's measured costs at `batch_size` (times are medians, bytes per rank)."""

    forward_seconds: float  # forward + loss
    backward_seconds: float
    optimizer_seconds: float  # AdamW step + zero_grad
    data_seconds: float  # make_batch + copy to the device, per micro-batch
    batch_size: int
    precision: str
    threads: int  # torch CPU threads during the probe
    device: str
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # saved for backward, deduplicated by storage, parameters excluded
    peak_bytes: int  # max_memory_allocated on GPU; params + grads + optimiser + activations on CPU
    compute_c0_seconds: float  # T_c(b) ≈ c0 + c1·b, forward + backward
    compute_c1_seconds_per_sample: float
    compress_seconds_per_byte: float | None = None  # int8 quantise + dequantise per fp32 gradient byte
    chag_fraction: float | None = None  # share of forward time in the tokenizer module
    tokenizer_activation_fraction: float | None = None  # share of activation bytes saved inside the tokenizer
    group_token_bytes_per_sample: int | None = None  # tokenizer output (G × D elements) per sample
    band_groups: int | None = None  # G, for channel-subset rotation

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        """Inverse of `to_dict` (unknown keys are ignored so older cache files still load)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def threads_per_process(plan: Plan, cores: int | None = None) -> int:
    """CPU threads one rank of `plan` gets on this node: cores ÷ processes, at least 1."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // plan.devices)


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
    tokenizer_module: str | None = None,
    band_groups: int | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy,
    budget_seconds: float = 20.0,
) -> ProbeResult:
    """Measure one training step of `model_factory()` on one device; cached when `cache_key` is given.

    Times are medians of `steps` after `warmup`, at `batch_size` and at half of it (for c0/c1); the timed loop stops
    early once `budget_seconds` is spent (AMP on an AVX2 CPU can take seconds per step). `tokenizer_module` names
    the submodule (as in `named_modules()`) that channel groups would split: its forward-time and activation
    shares and its output size per sample are measured. `fresh=True` re-measures even when a cache entry exists.
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
        "tokenizer_module": tokenizer_module,
        "band_groups": band_groups,
        "torch": torch.__version__,
    }
    try:
        cached = None if cache_key is None or fresh else read_cache("probe", key)
        if cached is not None:
            return ProbeResult.from_dict(cached)
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
        if tokenizer_module is not None:
            _measure_tokenizer(result, model_factory, make_batch, tokenizer_module, precision, dev, loss_fn)
            result.band_groups = band_groups
    finally:
        torch.set_num_threads(previous_threads)
    if cache_key is not None:
        write_cache("probe", key, result.to_dict())
    return result


def _device_label(dev: torch.device) -> str:
    return f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else str(dev)


def _autocast(precision: str, dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "32-true":
        return contextlib.nullcontext()
    # Lightning runs "16-mixed" on CPU as bf16, so the probe does the same.
    dtype = torch.float16 if precision == "16-mixed" and dev.type == "cuda" else torch.bfloat16
    return torch.autocast(dev.type, dtype=dtype)


def _mark(dev: torch.device) -> Any:
    if dev.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _intervals_seconds(marks: list[Any], dev: torch.device) -> list[float]:
    if dev.type != "cuda":
        return [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    torch.cuda.synchronize(dev)
    return [a.elapsed_time(b) / 1000 for a, b in zip(marks[:-1], marks[1:], strict=True)]


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
    optimizer = torch.optim.AdamW(model.parameters())

    def batch_on_device(b: int) -> tuple[Tensor, Tensor]:
        x, y = make_batch(b)
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    def step(x: Tensor, y: Tensor) -> list[float]:
        marks = [_mark(dev)]
        with _autocast(precision, dev):
            loss = loss_fn(model(x), y)
        marks.append(_mark(dev))
        loss.backward()
        marks.append(_mark(dev))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append(_mark(dev))
        return _intervals_seconds(marks, dev)

    def median_step(b: int, stop_at: float) -> list[float]:
        x, y = batch_on_device(b)
        for _ in range(warmup):
            step(x, y)
        timed = [step(x, y)]
        while len(timed) < steps and time.monotonic() < stop_at:
            timed.append(step(x, y))
        return [statistics.median(column) for column in zip(*timed, strict=True)]

    data_seconds = statistics.median(_wall_seconds(lambda: batch_on_device(batch_size), dev) for _ in range(3))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    now = time.monotonic()
    forward_seconds, backward_seconds, optimizer_seconds = median_step(batch_size, now + 0.6 * (deadline - now))
    gpu_peak_bytes = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    half_batch = batch_size // 2 if batch_size > 1 else 2
    half_forward, half_backward, _ = median_step(half_batch, deadline)
    c0, c1 = fit_compute_model(
        [batch_size, half_batch], [forward_seconds + backward_seconds, half_forward + half_backward]
    )

    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer_bytes = _unique_bytes(
        t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    )
    x, y = batch_on_device(batch_size)
    with _autocast(precision, dev), _SavedTensorCounter(model) as counter:
        loss_fn(model(x), y)
    activation_bytes = counter.total_bytes
    counted_bytes = 2 * param_bytes + optimizer_bytes + activation_bytes  # grads take the parameters' dtype
    return ProbeResult(
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        optimizer_seconds=optimizer_seconds,
        data_seconds=data_seconds,
        batch_size=batch_size,
        precision=precision,
        threads=torch.get_num_threads(),
        device=_device_label(dev),
        param_count=sum(p.numel() for p in params),
        param_bytes=param_bytes,
        grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        optimizer_bytes=optimizer_bytes,
        activation_bytes=activation_bytes,
        peak_bytes=gpu_peak_bytes if gpu_peak_bytes is not None else counted_bytes,
        compute_c0_seconds=c0,
        compute_c1_seconds_per_sample=c1,
    )


def _wall_seconds(fn: Callable[[], Any], dev: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def _unique_bytes(tensors: Iterator[Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class _SavedTensorCounter:
    """Bytes autograd saves for backward during a forward, one count per storage, parameters excluded.

    Storages are attributed to the tokenizer when first saved while its forward runs (`inside` is set by hooks).
    """

    def __init__(self, model: nn.Module) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, tuple[int, bool]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.inside = False

    def _pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._param_storages and storage.data_ptr() not in self._seen:
            self._seen[storage.data_ptr()] = (storage.nbytes(), self.inside)
        return tensor

    def __enter__(self) -> _SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total_bytes(self) -> int:
        return sum(n for n, _ in self._seen.values())

    @property
    def inside_bytes(self) -> int:
        return sum(n for n, inside in self._seen.values() if inside)


def _measure_tokenizer(
    result: ProbeResult,
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Tensor, Tensor]],
    name: str,
    precision: str,
    dev: torch.device,
    loss_fn: Callable[..., Tensor],
) -> None:
    torch.manual_seed(0)
    model = model_factory().to(dev).train()
    modules = dict(model.named_modules())
    if name not in modules:
        raise ConfigError(f"tokenizer_module {name!r} is not a submodule; some names: {', '.join(list(modules)[1:8])}.")
    x, y = (t.to(dev) for t in make_batch(result.batch_size))
    counter = _SavedTensorCounter(model)
    calls: list[list[Any]] = []  # [start, end] marks of each tokenizer call in one forward (it may run per group)
    output_bytes = [0]

    def enter(*_: Any) -> None:
        counter.inside = True
        calls.append([_mark(dev)])

    def leave(_: nn.Module, __: Any, output: Any) -> None:
        counter.inside = False
        calls[-1].append(_mark(dev))
        outputs = output if isinstance(output, (tuple, list)) else [output]
        output_bytes[0] += sum(t.numel() * t.element_size() for t in outputs if torch.is_tensor(t))

    handles = [modules[name].register_forward_pre_hook(enter), modules[name].register_forward_hook(leave)]
    shares = []
    try:
        for _ in range(3):  # median of three forwards; the counter of the last one gives the activation share
            calls.clear()
            output_bytes[0] = 0
            counter = _SavedTensorCounter(model)
            with _autocast(precision, dev), counter:
                marks = [_mark(dev)]
                loss_fn(model(x), y)
                marks.append(_mark(dev))
            tokenizer_seconds = sum(_intervals_seconds(call, dev)[0] for call in calls)
            shares.append(tokenizer_seconds / _intervals_seconds(marks, dev)[0])
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        raise ConfigError(f"tokenizer_module {name!r} never ran in the model's forward; name the module that does.")
    result.chag_fraction = statistics.median(shares)
    result.tokenizer_activation_fraction = counter.inside_bytes / max(counter.total_bytes, 1)
    result.group_token_bytes_per_sample = output_bytes[0] // result.batch_size


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
    seconds = statistics.median(_wall_seconds(quantise_dequantise, dev) for _ in range(5))
    return seconds / (grad.numel() * grad.element_size())
