"""Start N gloo ranks in forked processes with a short timeout; shared by the scripts in this folder."""

import datetime
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=60)  # a hung collective fails the run instead of waiting 30 min


class FakeBucket:
    """Duck-typed dist.GradBucket: a flat gradient buffer and the parameters it belongs to."""

    def __init__(self, buffer: torch.Tensor, params: list[torch.Tensor], index: int = 0, last: bool = True) -> None:
        assert sum(p.numel() for p in params) == buffer.numel()
        self._buffer, self._params, self._index, self._last = buffer, params, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def _worker(rank: int, world: int, store_path: str, out_dir: str, fn: Callable) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = fn(rank, world)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int], dict], world: int) -> list[dict]:
    """Run fn(rank, world) on `world` forked gloo ranks; return each rank's JSON-able result."""
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world, store_path, tmp, fn), nprocs=world, start_method="fork")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main(fn: Callable[[int, int], dict]) -> None:
    """`script.py WORLD OUT_JSON`: run fn on WORLD ranks and write the list of per-rank results."""
    world, out = int(sys.argv[1]), sys.argv[2]
    Path(out).write_text(json.dumps(run_ranks(fn, world)))
