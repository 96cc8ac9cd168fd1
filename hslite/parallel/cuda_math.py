"""CUDA's math switches a plan sets in every rank and the probe times with: TF32 and cuDNN's benchmark mode.

Both are process-wide and torch leaves TF32 off for matmuls. torch keeps two records of the matmul precision:
the legacy one, which `torch.get_float32_matmul_precision()` returns (Lightning reads it whenever a run sets up a
CUDA device), and one `fp32_precision` per backend. That getter raises ("mix of the legacy and new APIs") once the
records disagree, as they do after `torch.backends.cuda.matmul.fp32_precision = "tf32"` alone. So the switches are
set through the legacy setters, which keep both records in step (`at::Context::setAllowTF32CuBLAS`), and read
through `fp32_precision`, whose getters answer in any state. The CPU's own (oneDNN) matmul
precision is never set here. Imports torch alone: the probe's spawned CPU ranks import this without paying for
Lightning.
"""

from __future__ import annotations

import torch

# oneDNN matmul precisions that `torch.set_float32_matmul_precision("high" | "medium")` sets, and that hold the legacy
# record at that value: a legacy cuBLAS setter, which writes "high" or "highest" there, would contradict them.
_CPU_PINS_LEGACY = ("tf32", "bf16")


def set_cuda_math(tf32: bool, cudnn_benchmark: bool) -> tuple[bool, bool, bool]:
    """TF32 for fp32 matmuls and convolutions (or full fp32), and cuDNN's kernel timing; returns what was set before.

    Set either way, so a probe of one plan does not leak into the next. Harmless without CUDA: the CPU reads neither.
    """
    previous = current_cuda_math()
    restore_cuda_math((tf32, tf32, cudnn_benchmark))
    return previous


def current_cuda_math() -> tuple[bool, bool, bool]:
    """The switches set_cuda_math sets, as they are now: TF32 matmuls, TF32 convolutions, cuDNN's benchmark."""
    matmul = torch.backends.cuda.matmul.fp32_precision == "tf32"
    conv = torch.backends.cudnn.conv.fp32_precision == "tf32"  # type: ignore[attr-defined]  # not in torch's stubs
    return matmul, conv, torch.backends.cudnn.benchmark


def restore_cuda_math(switches: tuple[bool, bool, bool]) -> None:
    """Set the switches as current_cuda_math (or set_cuda_math) returned them."""
    matmul, conv, benchmark = switches
    _set_cublas_tf32(matmul)
    torch.backends.cudnn.allow_tf32 = conv
    torch.backends.cudnn.benchmark = benchmark


def _set_cublas_tf32(on: bool) -> None:
    """Set TF32 for cuBLAS on or off, `torch.get_float32_matmul_precision()` left readable.

    Where the caller's `set_float32_matmul_precision("high" | "medium")` also set the CPU's matmul precision, the
    legacy record must keep that value, so only cuBLAS's own precision is set; changing the CPU's would change its
    math. (The legacy `torch.backends.cuda.matmul.allow_tf32` getter then raises while TF32 is off: Lightning reads
    only the precision.)
    """
    if torch.backends.mkldnn.matmul.fp32_precision in _CPU_PINS_LEGACY:  # type: ignore[attr-defined]
        torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = on
