"""What a library call of hslite gives back to the caller's process: every process-wide setting a run changes.

A run sets what it trains and measures with: threads, deterministic kernels, TF32 and cuDNN's benchmark mode, the
global random generators (`seed_everything`), warning filters, Lightning's log level, signal handlers, and the
environment variables Lightning and torch.distributed read. The CLI and the ranks hslite spawns own their processes
and keep them. `hslite.fit()` and the other calls in `hslite.api` run inside a caller's notebook or script, so they
put every one back (`caller_state_kept`). glibc's allocator thresholds cannot be read back, so they are set only in
processes hslite owns (`allocator.keep_freed_memory`).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Loggers hslite sets a level on (`rank_setup.quiet_lightning`), kept even where they do not exist yet.
QUIETED_LOGGERS = ("lightning.pytorch.utilities.rank_zero",)
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
# torch's per-backend TF32 records, beside the legacy matmul precision.
_PRECISION_RECORDS = ("backends", "backends.cuda.matmul", "backends.cudnn", "backends.cudnn.conv",
                      "backends.cudnn.rnn", "backends.mkldnn", "backends.mkldnn.matmul", "backends.mkldnn.conv",
                      "backends.mkldnn.rnn")  # fmt: skip


@contextmanager
def caller_state_kept() -> Iterator[None]:
    """Run the body, then set back what it changed of the settings above, whether it returned or raised."""
    saved = _snapshot()
    try:
        with warnings.catch_warnings():  # the filters and showwarning, as they were
            yield
    finally:
        _restore(saved)


def _snapshot() -> dict[str, Any]:
    import numpy as np
    import torch

    loggers = [name for name in logging.root.manager.loggerDict if isinstance(logging.getLogger(name), logging.Logger)]
    state: dict[str, Any] = {
        "environ": dict(os.environ),
        "threads": torch.get_num_threads(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled),
        "tf32": _tf32_state(torch),
        "rng": (random.getstate(), np.random.get_state(), torch.random.get_rng_state()),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "loggers": {name: logging.getLogger(name).level for name in {*loggers, *QUIETED_LOGGERS}},
        "signals": {},
    }
    if threading.current_thread() is threading.main_thread():  # handlers can be read and set from there only
        state["signals"] = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    return state


def _restore(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    os.environ.clear()
    os.environ.update(state["environ"])
    torch.set_num_threads(state["threads"])
    deterministic, warn_only = state["deterministic"]
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled = state["cudnn"]
    _set_tf32_state(torch, state["tf32"])
    python_rng, numpy_rng, torch_rng = state["rng"]
    random.setstate(python_rng)
    np.random.set_state(numpy_rng)
    torch.random.set_rng_state(torch_rng)
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    for name, level in state["loggers"].items():
        logging.getLogger(name).setLevel(level)
    for sig, handler in state["signals"].items():
        if handler is not None:  # None: set outside Python, which Python cannot set back
            signal.signal(sig, handler)


def _tf32_state(torch: Any) -> dict[str, Any]:
    """The legacy matmul precision and each backend's fp32_precision record."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch ≥ 2.9 when the records disagree ("mix of the legacy and new APIs")
        legacy = None
    return {"legacy": legacy, "records": {path: _attribute(torch, path).fp32_precision for path in _PRECISION_RECORDS}}


def _set_tf32_state(torch: Any, state: dict[str, Any]) -> None:
    if state["legacy"] is not None:
        torch.set_float32_matmul_precision(state["legacy"])  # sets the records to match: those that differ follow
    for path, value in state["records"].items():
        holder = _attribute(torch, path)
        if holder.fp32_precision != value:
            holder.fp32_precision = value


def _attribute(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name)
    return root
