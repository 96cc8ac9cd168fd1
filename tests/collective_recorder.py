"""Record every torch.distributed call a rank makes, to check two rules NCCL enforces and gloo forgives.

1. Device: each tensor handed to a collective must live where the group's backend can take it. The ranks here are CPU
   processes over gloo, where anything goes; the check is against the backend the same plan gets on GPUs
   (`process_group_backend("gpu")`): a device type it has no backend for is the "No backend type associated with
   device type cpu" that NCCL-only groups raise. On GPUs the same calls would hand CUDA tensors where these hand CPU
   ones (gradients, tokens, shards), so only CPU tensors can break the rule here, and they do only if the GPU
   backend lacks a CPU half.
2. Order: every rank must issue the same sequence of collectives, across communicators too (a kernel of one NCCL
   communicator can wait for a peer blocked in another's). Groups are named by their shape (size and rank stride:
   a chag group of consecutive ranks, a dp group strided), so the ranks of different chag groups compare equal.

`RecordCollectives` is a Lightning callback: it patches torch.distributed in each spawned rank at setup and writes
`<folder>/rank<r>.json` at teardown. DDP's own bucket all-reduces run in C++ and are not seen, unless a Python hook
issues them (hslite's compression hooks; the ordered hook of channel groups).
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
    "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip


def _label(group: Any) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():
        return "world"
    return f"size{len(ranks)}-stride{ranks[1] - ranks[0] if len(ranks) > 1 else 0}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class RecordCollectives(pl.Callback):
    """Patch torch.distributed's collectives in this rank to log (op, group shape, devices, dtypes), in call order."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.calls: list[dict[str, Any]] = []
        self._originals: dict[str, Any] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        if not dist.is_initialized():
            return
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._recording(name, original))

    def _recording(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def record(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            tensors = [t for key, value in bound.items() if key != "group" for t in _tensors(value)]
            self.calls.append(
                {
                    "op": name,
                    "group": _label(bound.get("group")),
                    "devices": sorted({t.device.type for t in tensors}),
                    "dtypes": sorted({str(t.dtype) for t in tensors}),
                    "numel": sum(t.numel() for t in tensors),  # not compared: all-to-all splits differ by rank
                }
            )
            return original(*args, **kwargs)

        return record

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:  # noqa: D102
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals = {}
        if dist.is_initialized():
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"rank{dist.get_rank()}.json").write_text(json.dumps(self.calls))


def recorded(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's recorded calls, by rank."""
    return {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in folder.glob("rank*.json")}


def backend_device_types(backend: str) -> set[str]:
    """Device types a torch.distributed backend string serves: "gloo" -> cpu, cuda; "nccl" -> cuda; "cpu:gloo,..."."""
    if ":" in backend:
        return {pair.split(":")[0] for pair in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}}[backend]


def check_collectives(calls: dict[int, list[dict[str, Any]]], world_size: int, gpu_backend: str) -> None:
    """Assert every rank recorded, the sequences of (op, group, dtypes) agree, and every device has a backend."""
    assert sorted(calls) == list(range(world_size)), f"ranks that recorded: {sorted(calls)}"
    served = backend_device_types(gpu_backend)
    for rank, sequence in calls.items():
        for index, call in enumerate(sequence):
            missing = set(call["devices"]) - served
            assert not missing, (
                f"rank {rank}'s call {index} ({call['op']} on {call['group']}) hands {sorted(missing)} tensors to a "
                f"collective; the GPU backend {gpu_backend!r} has no backend for them"
            )
    shapes = {rank: [(c["op"], c["group"], c["dtypes"]) for c in sequence] for rank, sequence in calls.items()}
    for rank in range(1, world_size):
        if shapes[rank] != shapes[0]:
            first = next(
                (i for i, (a, b) in enumerate(zip(shapes[0], shapes[rank], strict=False)) if a != b),
                min(len(shapes[0]), len(shapes[rank])),
            )
            raise AssertionError(
                f"rank {rank} issues collectives in another order than rank 0 from call {first}: "
                f"rank 0 {shapes[0][first : first + 4]} vs rank {rank} {shapes[rank][first : first + 4]} "
                f"({len(shapes[0])} and {len(shapes[rank])} calls)"
            )
