"""The optimiser and schedule hslite trains with, in one place, so that the pre-flight probes time what `fit` runs."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], lr: float = 1e-3, weight_decay: float = 1e-2) -> torch.optim.AdamW:
    """AdamW with foreach kernels: one call per operation over all parameters instead of one per parameter.

    torch uses them by default on CUDA only. On CPU they matter under FSDP, where every per-parameter call
    dispatches through DTensor, so one call per parameter costs a dispatch each.
    """
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate factor: linear warm-up to 1, then cosine decay to 0 at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
