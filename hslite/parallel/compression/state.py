"""Per-rank state of the compressed all-reduce hook: hyper-parameters, error residuals kept per parameter, statistics.

No `from __future__ import annotations` here, as in `compression.py`: DDP inspects its hooks' annotations.
"""

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.parallel.wire_format import DEFAULT_CHUNK_ELEMS, KINDS, check_kind

# CUDA event pairs kept unread at most; beyond it the oldest is read into the total. A step records three pairs per
# bucket (tens to hundreds), so the oldest is steps back and long finished: reading it does not wait for the GPU, and
# a run that no checkpoint reads holds this many, not two events per phase of the whole run.
PENDING_EVENT_PAIRS = 4096


class CompressionState:
    """Per-rank state of the compressed all-reduce hook: hyper-parameters, error residuals, statistics.

    Residuals are stored per parameter, not per bucket: DDP's first step puts every parameter in one bucket and
    rebuilds buckets after it (and again in a resumed run), and a bucket's index and size alone can stay equal while
    its parameters move. A bucket seen again with the same (index, size, parameters) reuses its flat residual
    directly; any other layout breaks the stored residuals it overlaps into per-parameter pieces and reassembles them,
    so no quantisation error is lost or added to the wrong gradient when buckets change.
    """

    def __init__(
        self,
        kind: str = "int8",
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        process_group: dist.ProcessGroup | None = None,
        error_feedback: bool = True,
    ) -> None:
        if chunk_elems < 1:
            raise ConfigError(f"chunk_elems must be ≥ 1 (elements per int8 scale), got {chunk_elems}.")
        # Hyper-parameters.
        self.kind = check_kind(kind)  # read at every hook call; change it with set_kind, not by re-registering
        self.chunk_elems = chunk_elems  # int8 values per fp32 scale; smaller = tighter error, more scale bytes
        self.process_group = process_group  # None means the default (world) group
        self.error_feedback = error_feedback  # False only for ablations: quantisation error is then thrown away
        # Internal state.
        self.step = 0  # gradient syncs seen (calls on a step's last bucket; accumulation steps never call)
        self._buckets: dict[tuple[int, int], tuple[tuple[str | int, ...], list[int], Tensor]] = {}
        self._loose: dict[str | int, Tensor] = {}  # per-parameter residuals from a superseded layout or a checkpoint
        self._names: dict[int, str] = {}  # id(parameter) -> name, set by bind(); names make checkpoints portable
        # Statistics.
        self.bytes_sent = 0  # int8: counted from the tensors handed to collectives; others: ring formula
        self.bytes_received = 0
        self.calls = dict.fromkeys(KINDS, 0)  # hook calls per kind
        self._quantise_seconds = 0.0  # int8 quantise/dequantise/residual time, communication excluded
        self._quantise_events: deque[tuple[Any, Any]] = deque()  # CUDA (start, end) events not yet in the total

    @property
    def quantise_seconds(self) -> float:
        """Time spent quantising, dequantising and keeping residuals, collectives excluded (on a GPU: waits for it)."""
        while self._quantise_events:
            self._read_oldest_events()
        return self._quantise_seconds

    def add_quantise_time(self, start: Any, end: Any) -> None:
        """One phase of the int8 hook: perf_counter readings on CPU, CUDA events on a GPU (read lazily)."""
        if isinstance(start, float):
            self._quantise_seconds += end - start
            return
        self._quantise_events.append((start, end))
        if len(self._quantise_events) > PENDING_EVENT_PAIRS:
            self._read_oldest_events()

    def _read_oldest_events(self) -> None:
        start, end = self._quantise_events.popleft()
        end.synchronize()
        self._quantise_seconds += start.elapsed_time(end) / 1000  # CUDA events measure milliseconds

    def set_kind(self, kind: str) -> None:
        """Switch compression for the next buckets; int8 residuals left over are added to the next gradients."""
        self.kind = check_kind(kind)

    def bind(self, module: nn.Module) -> None:
        """Name the parameters of the (unwrapped) module so residuals can be saved and restored by name."""
        self._names = {id(p): name for name, p in module.named_parameters()}

    def residuals(self) -> dict[str | int, Tensor]:
        """Error residuals of this rank per parameter (views, not copies)."""
        pieces = dict(self._loose)
        for keys, sizes, flat in self._buckets.values():
            pieces.update(zip(keys, flat.split(sizes), strict=True))
        return pieces

    def state_dict(self) -> dict:
        """Kind, step, statistics and this rank's residuals (on CPU, keyed by parameter name)."""
        residuals = self.residuals()
        unnamed = [key for key in residuals if not isinstance(key, str)]
        if unnamed:
            raise RuntimeError(
                f"{len(unnamed)} residuals belong to parameters without names; call CompressionState.bind(module) "
                "before training so the residuals can be checkpointed."
            )
        return {
            "kind": self.kind,
            "step": self.step,
            "residuals": {name: r.detach().to("cpu", copy=True) for name, r in residuals.items()},
            "stats": {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "calls": dict(self.calls),
                "quantise_seconds": self.quantise_seconds,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved; hyper-parameters (chunk size, group, error feedback) stay as constructed."""
        self.kind = check_kind(state["kind"])
        self.step = state["step"]
        self._buckets = {}
        self._loose = dict(state["residuals"])  # moved to the gradients' device when first used
        stats = state["stats"]
        self.bytes_sent, self.bytes_received = stats["bytes_sent"], stats["bytes_received"]
        self.calls = dict.fromkeys(KINDS, 0) | stats["calls"]
        self._quantise_seconds, self._quantise_events = stats["quantise_seconds"], deque()

    def _layout(self, bucket: dist.GradBucket) -> tuple[tuple[int, int], tuple[str | int, ...], list[int]]:
        params = bucket.parameters()
        keys = tuple(self._names.get(id(p), id(p)) for p in params)
        sizes = [p.numel() for p in params]
        if sum(sizes) != bucket.buffer().numel():
            raise RuntimeError(
                f"bucket {bucket.index()} holds {bucket.buffer().numel()} elements but its parameters {sum(sizes)}; "
                "the per-parameter residual layout assumes dense, unpadded DDP buckets (no sparse gradients)."
            )
        return (bucket.index(), bucket.buffer().numel()), keys, sizes

    def _take_residual(self, bucket: dist.GradBucket) -> Tensor | None:
        """Remove and return this bucket's residual as one flat fp32 tensor, or None when there is none."""
        if not self._buckets and not self._loose:
            return None
        bucket_key, keys, sizes = self._layout(bucket)
        stored = self._buckets.pop(bucket_key, None)
        if stored is not None and stored[0] == keys:
            return stored[2]
        # The layout changed: a parameter lives in exactly one current bucket, so every stored bucket sharing a
        # parameter with this one is stale; break it (and a same-key bucket with other parameters) into pieces.
        if stored is not None:
            self._loose.update(zip(stored[0], stored[2].split(stored[1]), strict=True))
        wanted = set(keys)
        for other_key, (other_keys, other_sizes, flat) in list(self._buckets.items()):
            if wanted.intersection(other_keys):
                del self._buckets[other_key]
                self._loose.update(zip(other_keys, flat.split(other_sizes), strict=True))
        pieces = [self._loose.pop(key, None) for key in keys]
        if all(piece is None for piece in pieces):
            return None
        device = bucket.buffer().device
        return torch.cat(
            [
                torch.zeros(size, device=device) if piece is None else piece.to(device, torch.float32)
                for piece, size in zip(pieces, sizes, strict=True)
            ]
        )

    def _keep_residual(self, bucket: dist.GradBucket, residual: Tensor) -> None:
        bucket_key, keys, sizes = self._layout(bucket)
        self._buckets[bucket_key] = (keys, sizes, residual)
