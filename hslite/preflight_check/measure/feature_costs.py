"""What a plan's features add to the plain training step: FSDP2's own seconds and int8's kernel work per byte.

Both are timed on one device by the probe when the plan uses the feature (`ProbeOptions.measure_fsdp`,
`ProbeOptions.measure_compression`); the cost model adds them to the plain step's compute and communication.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hslite.parallel.trainer.trainer_args import process_group_backend
from hslite.preflight_check.measure.step_timing import timed_step
from hslite.preflight_check.measure.timers import wall_seconds
from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP, TrainingStep, batch_to
from hslite.preflight_check.measurements import ProbeResult

# Choices, not measured figures: the int8 probe quantises a buffer of the gradient's own size, capped at 64 MB of
# fp32 to bound the probe's time (a larger gradient is priced at this buffer's per-byte rate), and of 1 MB at least,
# so that the work of its half, whose time is taken off the whole's, still shows beside the pass's launches.
COMPRESSION_PROBE_MAX_ELEMENTS = 1 << 24
COMPRESSION_PROBE_MIN_ELEMENTS = 1 << 18


def measure_fsdp_overhead(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    plain: ProbeResult,
    step: TrainingStep = CLASSIFIER_STEP,
    warmup: int = 2,
    steps: int = 5,
) -> tuple[float, float] | None:
    """FSDP2's own seconds per micro-step and per optimiser step on one rank, beyond `plain`'s step.

    The model is sharded over a one-rank process group, so its collectives are copies and what is timed is what
    FSDP adds at any world size: unit hooks, gathering into and out of flat buffers, DTensor dispatch in AdamW.
    None when a process group already exists here.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hslite.parallel.strategies.fsdp_policy import shard_model

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
        optimizer = step.optimizer(model)
        on_device = batch_to(batch, dev)
        for _ in range(warmup):
            timed_step(model, optimizer, on_device, plain.precision, dev, step)
        timed = [timed_step(model, optimizer, on_device, plain.precision, dev, step) for _ in range(steps)]
    finally:
        dist.destroy_process_group()
    forward, backward, optimizer_step = (statistics.median(column) for column in zip(*timed, strict=True))
    micro = forward + backward - plain.forward_seconds - plain.backward_seconds
    return max(0.0, micro), max(0.0, optimizer_step - plain.optimizer_seconds)


def int8_seconds_per_byte(param_count: int, dev: torch.device) -> float:
    """Seconds of kernel work per fp32 gradient byte of the int8 hook's quantise and dequantise with error feedback.

    The slope between a pass over the buffer and a pass over its half, on `dev`: the pass's kernel launches, the same
    at both sizes, drop out, and the cost model prices the hook's own launches from its kernel count per bucket
    (`comm_cost.int8_hook_seconds`). A pass bound by its launches at both sizes shows no work: 0.
    """
    elements = max(COMPRESSION_PROBE_MIN_ELEMENTS, min(param_count, COMPRESSION_PROBE_MAX_ELEMENTS))
    whole, half = (_quantise_pass_seconds(n, dev) for n in (elements, elements // 2))
    return max(0.0, whole - half) / ((elements - elements // 2) * 4)  # fp32: 4 bytes an element


def _quantise_pass_seconds(elements: int, dev: torch.device) -> float:
    # Mirrors an error-feedback int8 hook: add the residual, scale by the max, round, cast, dequantise, keep the error.
    grad = torch.randn(elements, device=dev)
    residual = torch.zeros_like(grad)

    def quantise_dequantise() -> None:
        corrected = grad + residual
        scale = corrected.abs().max().clamp_min(1e-12) / 127
        restored = (corrected / scale).round_().clamp_(-127, 127).to(torch.int8).to(torch.float32) * scale
        residual.copy_(corrected - restored)

    quantise_dequantise()
    return statistics.median(wall_seconds(quantise_dequantise, dev) for _ in range(5))
