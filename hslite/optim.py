"""The optimiser hslite trains with, in one place, so that the pre-flight probes time the step that `fit` runs."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], lr: float = 1e-3, weight_decay: float = 1e-2) -> torch.optim.AdamW:
    """AdamW with foreach kernels: one call per operation over all parameters instead of one per parameter.

    torch uses them by default on CUDA only. On CPU they matter under FSDP, where every per-parameter call
    dispatches through DTensor, so one call per parameter costs a dispatch each.
    """
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
