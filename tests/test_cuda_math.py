"""set_cuda_math leaves `torch.get_float32_matmul_precision()` readable: Lightning reads it whenever a run sets up a
CUDA device, and torch ≥ 2.9 raises there once its legacy and per-backend precision records disagree.

The records live in torch's C++ context, which a CPU build has too; each test puts them back as they were.
"""

from __future__ import annotations

import pytest
import torch

from hslite.parallel.cuda_math import current_cuda_math, restore_cuda_math, set_cuda_math

cuda_matmul, cpu_matmul, cudnn = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul, torch.backends.cudnn


@pytest.fixture(autouse=True)
def process_precision():
    """The precision records before the test, put back exactly after it (monkeypatch cannot: they are not Python's)."""
    legacy, cudnn_tf32 = torch.get_float32_matmul_precision(), cudnn.allow_tf32
    per_backend = [(cuda_matmul, cuda_matmul.fp32_precision), (cpu_matmul, cpu_matmul.fp32_precision)]
    per_backend += [(cudnn.conv, cudnn.conv.fp32_precision), (cudnn.rnn, cudnn.rnn.fp32_precision)]
    benchmark = cudnn.benchmark
    yield
    torch.set_float32_matmul_precision(legacy)
    cudnn.allow_tf32, cudnn.benchmark = cudnn_tf32, benchmark
    for backend, precision in per_backend:
        backend.fp32_precision = precision


@pytest.mark.parametrize("tf32", [True, False])
def test_lightnings_precision_reads_what_set_cuda_math_set_and_then_what_was_there(tf32):
    torch.set_float32_matmul_precision("highest")  # torch's default: no CPU precision that pins the legacy record
    before = torch.get_float32_matmul_precision()
    previous = set_cuda_math(tf32, cudnn_benchmark=False)
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    assert cuda_matmul.allow_tf32 is tf32 and cudnn.allow_tf32 is tf32  # the legacy getters agree too
    assert current_cuda_math() == (tf32, tf32, False)
    restore_cuda_math(previous)
    assert torch.get_float32_matmul_precision() == before and current_cuda_math() == previous


@pytest.mark.parametrize("tf32", [True, False])
@pytest.mark.parametrize("caller", ["high", "medium"])
def test_a_callers_float32_matmul_precision_stays_readable_and_the_cpus_math_unchanged(caller, tf32):
    torch.set_float32_matmul_precision(caller)  # what Lightning advises; it sets the CPU's (oneDNN) matmuls too
    cpu = cpu_matmul.fp32_precision
    previous = set_cuda_math(tf32, cudnn_benchmark=True)
    assert torch.get_float32_matmul_precision() == caller and cpu_matmul.fp32_precision == cpu
    assert current_cuda_math() == (tf32, tf32, True)
    restore_cuda_math(previous)
    assert torch.get_float32_matmul_precision() == caller and current_cuda_math()[0] is True


def test_a_caller_that_set_the_per_backend_precision_alone_gets_the_same_math_back_readable():
    torch.set_float32_matmul_precision("highest")  # torch's default, whatever an earlier test in this process left
    cuda_matmul.fp32_precision = "tf32"  # torch's advice; it leaves the legacy record at "highest"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    previous = set_cuda_math(False, cudnn_benchmark=False)
    assert previous[0] is True and torch.get_float32_matmul_precision() == "highest"
    restore_cuda_math(previous)
    assert cuda_matmul.fp32_precision == "tf32" and torch.get_float32_matmul_precision() == "high"
