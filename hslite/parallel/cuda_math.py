"""CUDA's math switches a plan sets in every rank and the probe times with: TF32 and cuDNN's benchmark mode.

Both are process-wide and torch leaves TF32 off for matmuls. torch ≥ 2.9 has a per-backend `fp32_precision` API and
refuses to read the legacy `allow_tf32` booleans once a caller has used it ("mix of the legacy and new APIs"), so the
new API is used where torch has it and the booleans only on older releases. Imports torch alone: the probe's spawned
CPU ranks import this without paying for Lightning.
"""

from __future__ import annotations

from typing import Any

import torch

_NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(torch.backends.cudnn, "conv")


def set_cuda_math(tf32: bool, cudnn_benchmark: bool) -> tuple[Any, ...]:
    """TF32 for fp32 matmuls and convolutions (or full fp32), and cuDNN's kernel timing; returns what was set before.

    Set either way, so a probe of one plan does not leak into the next. Harmless without CUDA: the CPU reads neither.
    """
    previous = current_cuda_math()
    precision: Any = ("tf32" if tf32 else "ieee") if _NEW_API else tf32
    restore_cuda_math((precision, precision, cudnn_benchmark))
    return previous


def current_cuda_math() -> tuple[Any, ...]:
    """The switches set_cuda_math sets, as they are now (for restore_cuda_math)."""
    if _NEW_API:
        matmul, conv = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    else:
        matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    return matmul, conv, torch.backends.cudnn.benchmark


def restore_cuda_math(switches: tuple[Any, ...]) -> None:
    """Set the switches as current_cuda_math (or set_cuda_math) returned them."""
    matmul, conv, benchmark = switches
    if _NEW_API:
        torch.backends.cuda.matmul.fp32_precision = matmul
        torch.backends.cudnn.conv.fp32_precision = conv
    else:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = conv
    torch.backends.cudnn.benchmark = benchmark
