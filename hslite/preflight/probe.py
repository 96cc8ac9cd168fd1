"""Measure one device: forward, backward, optimiser and data time, a linear compute model, and peak memory.

`probe_model` runs a few real training steps of the model on one device (CUDA events on GPU) at the requested
batch size and at half of it, counts the bytes autograd saves for backward, and caches the result as JSON under the
user cache dir. On CPU the "devices" are processes sharing the cores, so probe with the threads one rank would get:
`threads_per_process(plan)`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.parallel.plan import PRECISIONS, Plan, threads_per_process
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


def probe_for_plans(
    model_factory: Callable[[], nn.Module], make_batch: Callable[[int], tuple[Tensor, Tensor]], **probe_kwargs: Any
) -> Callable[[Plan], ProbeResult]:
    """A `probe_for` for `run_preflight`: probes at the plan's batch and precision.

    GPU plans are probed on cuda:0, CPU plans with the threads one rank gets. `probe_kwargs` go to `probe_model`
    (cache_key, fresh, steps, measure_compression, tokenizer_modules, band_groups, ...).
    """

    def probe_for(plan: Plan) -> ProbeResult:
        on_gpu = plan.accelerator == "gpu"
        return probe_model(model_factory, make_batch, batch_size=plan.batch_size, precision=plan.precision,
                           device="cuda:0" if on_gpu else "cpu", threads=None if on_gpu else threads_per_process(plan),
                           **probe_kwargs)  # fmt: skip

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
    tokenizer_modules: tuple[str, ...] = (),
    band_groups: int | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy,
    budget_seconds: float = 10.0,  # timed steps stop here; a normal 3D-CNN probe needs ~3 s on 2 cores
) -> ProbeResult:
    """Measure one training step of `model_factory()` on one device; cached when `cache_key` is given.

    Times are medians of `steps` after `warmup`, at `batch_size` and at half of it (for c0/c1); the timed loop stops
    early once `budget_seconds` is spent (AMP on an AVX2 CPU can take seconds per step). `tokenizer_modules` name
    the submodules (as in `named_modules()`) whose work channel groups split, e.g. ("tokenizer",
    "partial_aggregation") for channel_vit: their share of forward time and of activation bytes is measured, and the
    output of the last one, summed over its calls, is the group-token size per sample. `fresh=True` re-measures.
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
        "tokenizer_modules": list(tokenizer_modules),
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
        if tokenizer_modules:
            _measure_tokenizer(result, model_factory, make_batch, tuple(tokenizer_modules), precision, dev, loss_fn)
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

    def median_step(b: int, stop_at: float, warmup_steps: int) -> list[float]:
        x, y = batch_on_device(b)
        for _ in range(warmup_steps):
            step(x, y)
        timed = [step(x, y)]
        while len(timed) < steps and time.monotonic() < stop_at:
            timed.append(step(x, y))
        return [statistics.median(column) for column in zip(*timed, strict=True)]

    data_seconds = statistics.median(_wall_seconds(lambda: batch_on_device(batch_size), dev) for _ in range(3))
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

    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)  # grads take the params' dtype
    optimizer_bytes = _unique_bytes(
        t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    )
    x, y = batch_on_device(batch_size)
    counter = _SavedTensorCounter(model)
    with _autocast(precision, dev), counter:
        loss_fn(model(x), y)  # the graph keeps every saved storage alive, so pointers cannot be reused meanwhile
    activation_bytes = counter.total_bytes
    counted_bytes = param_bytes + grad_bytes + optimizer_bytes + activation_bytes
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
        grad_bytes=grad_bytes,
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


class _SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for backward during a forward, one count per storage, parameters excluded.

    Storages are attributed to the tokenizer when first saved while its forward runs (`inside` is set by hooks).
    """

    def __init__(self, model: nn.Module) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, tuple[int, bool]] = {}
        self.inside = False
        super().__init__(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: Tensor) -> Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self._param_storages and pointer not in self._seen:
            self._seen[pointer] = (tensor.untyped_storage().nbytes(), self.inside)
        return tensor

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
    names: tuple[str, ...],
    precision: str,
    dev: torch.device,
    loss_fn: Callable[..., Tensor],
) -> None:
    torch.manual_seed(0)
    model = model_factory().to(dev).train()
    modules = dict(model.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        raise ConfigError(
            f"tokenizer_modules {missing} are not submodules; some names: {', '.join(list(modules)[1:9])}."
        )
    x, y = (t.to(dev) for t in make_batch(result.batch_size))
    state: dict[str, Any] = {"depth": 0, "spans": [], "output_bytes": 0}  # spans: [start, end] of outermost calls

    def enter(*_: Any) -> None:
        state["depth"] += 1
        counter.inside = True
        if state["depth"] == 1:
            state["spans"].append([_mark(dev)])

    def leave(module: nn.Module, _: Any, output: Any) -> None:
        state["depth"] -= 1
        counter.inside = state["depth"] > 0
        if state["depth"] == 0:
            state["spans"][-1].append(_mark(dev))
        if module is modules[names[-1]]:  # the last named module produces the group tokens
            outputs = output if isinstance(output, (tuple, list)) else [output]
            state["output_bytes"] += sum(t.numel() * t.element_size() for t in outputs if torch.is_tensor(t))

    handles = [
        h for n in names for h in (modules[n].register_forward_pre_hook(enter), modules[n].register_forward_hook(leave))
    ]
    shares = []
    try:
        for _ in range(3):  # median of three forwards; the counter of the last one gives the activation share
            state.update(spans=[], output_bytes=0)
            counter = _SavedTensorCounter(model)
            with _autocast(precision, dev), counter:
                marks = [_mark(dev)]
                loss_fn(model(x), y)
                marks.append(_mark(dev))
            tokenizer_seconds = sum(_intervals_seconds(span, dev)[0] for span in state["spans"])
            shares.append(tokenizer_seconds / _intervals_seconds(marks, dev)[0])
    finally:
        for handle in handles:
            handle.remove()
    if not state["spans"]:
        raise ConfigError(f"tokenizer_modules {list(names)} never ran in the model's forward; name modules that do.")
    result.chag_fraction = statistics.median(shares)
    result.tokenizer_activation_fraction = counter.inside_bytes / max(counter.total_bytes, 1)
    result.group_token_bytes_per_sample = state["output_bytes"] // result.batch_size


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
