"""fp32 all-reduce vs hslite's int8 hook vs the bf16 hook over gloo: median seconds, bytes per rank, prediction.

    python benchmarks/allreduce.py                       # 1/8/32/128 MB gradients, 2 and 4 ranks
    python benchmarks/allreduce.py --sizes-mb 1 8 --worlds 2 --repeats 3

Each world size forks its ranks (one thread each) once; every (size, kind) is run once to warm up and then timed
`repeats` times behind a barrier; a time is the slowest rank's median. Bytes per rank: fp32 and bf16 are ring
all-reduce bytes (2·(N−1)/N·S), int8 is counted by the hook from the tensors it hands to its collectives. The
"pred" columns are the pre-flight's `allreduce_seconds` on its measured link (`measure_links`, cached) for the
bytes `wire_format.compressed_bytes` puts on the wire, plus its default CPU quantise cost for int8, as `predict`
composes them.
"""

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hslite.parallel.compression.hook import bf16_hook, int8_hook
from hslite.parallel.compression.state import CompressionState
from hslite.parallel.wire_format import compressed_bytes, wire_bytes

MB = 2**20
KINDS = ("fp32", "int8", "bf16")


class _Bucket:
    """The part of dist.GradBucket the hooks read: one flat buffer of one parameter."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer, self._params = buffer, [torch.empty(buffer.numel())]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def _allreduce(kind: str, state: CompressionState, bucket: _Bucket) -> None:
    if kind == "fp32":
        dist.all_reduce(bucket.buffer())
    else:
        (int8_hook if kind == "int8" else bf16_hook)(state, bucket).wait()


def _rank(rank: int, world: int, store_path: str, sizes_mb: list[float], repeats: int, out: str) -> None:
    torch.set_num_threads(1)  # N ranks share the cores; more threads oversubscribe and make timings meaningless
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    rows = []
    for size_mb in sizes_mb:
        numel = int(size_mb * MB) // 4
        gen = torch.Generator().manual_seed(rank)
        grads = torch.randn(numel, generator=gen)
        bucket, state = _Bucket(grads.clone()), CompressionState("int8")
        row = {"size_mb": size_mb, "numel": numel}
        for kind in KINDS:
            samples = []
            for i in range(1 + repeats):
                bucket.buffer().copy_(grads)  # the same gradients every call, outside the timed region
                sent_before, quantise_before = state.bytes_sent, state.quantise_seconds
                dist.barrier()
                started = time.perf_counter()
                _allreduce(kind, state, bucket)
                if i:
                    samples.append(time.perf_counter() - started)
            slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            row[f"{kind}_s"] = slowest.item()
            if kind == "int8":
                row["int8_bytes"] = state.bytes_sent - sent_before
                row["int8_quantise_s"] = state.quantise_seconds - quantise_before
        row["fp32_bytes"] = wire_bytes(numel, world, "none")
        row["bf16_bytes"] = wire_bytes(numel, world, "bf16")
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(world: int, sizes_mb: list[float], repeats: int) -> list[dict]:
    """Time the three all-reduces on `world` forked gloo ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        args = (world, os.path.join(tmp, "store"), sizes_mb, repeats, out)
        mp.start_processes(_rank, args=args, nprocs=world, start_method="fork")
        return json.loads(Path(out).read_text())


def predictor(world: int):
    """Pre-flight prediction of each kind's all-reduce seconds on this machine's measured gloo link, or None."""
    try:
        from hslite.preflight_check.hardware.links import measure_links
        from hslite.preflight_check.price import costmodel, formulas
    except ImportError:
        return None, "pending: hslite.preflight_check.price.costmodel / links not available"
    link = measure_links(world)

    def predict(size_bytes: float, kind: str) -> float:
        compression = {"fp32": "none", "int8": "int8", "bf16": "bf16"}[kind]
        seconds = formulas.allreduce_seconds(compressed_bytes(size_bytes, compression), world, link)
        if kind == "int8":
            seconds += costmodel.DEFAULT_COMPRESS_SECONDS_PER_BYTE["cpu"] * size_bytes
        return seconds

    return predict, f"alpha {link.alpha_seconds * 1e6:.0f} µs, BW {link.bandwidth_bytes_per_second / 1e9:.2f} GB/s"


def report(world: int, rows: list[dict], predict, link_note: str) -> None:
    """Print one table per world size and the bytes ratio line per size."""
    print(f"\n{world} gloo ranks × 1 thread on {os.cpu_count()} cores; pre-flight link: {link_note}")
    head = f"{'size MB':>8} " + " ".join(f"{k + ' s':>9} {'pred s':>8} {k + ' MB':>9}" for k in KINDS)
    print(head + f" {'int8 quant s':>12}")
    for row in rows:
        cells = []
        for kind in KINDS:
            pred = f"{predict(row['size_mb'] * MB, kind):8.4f}" if predict else f"{'pending':>8}"
            cells.append(f"{row[f'{kind}_s']:9.4f} {pred} {row[f'{kind}_bytes'] / MB:9.2f}")
        print(f"{row['size_mb']:8g} " + " ".join(cells) + f" {row['int8_quantise_s']:12.4f}")
    for row in rows:
        ratio = row["fp32_bytes"] / row["int8_bytes"]
        speed = row["fp32_s"] / row["int8_s"]
        print(f"{row['size_mb']:g} MB: bytes ratio fp32/int8: {ratio:.1f}x (time ratio fp32/int8 {speed:.2f}x)")


def main() -> None:
    """Parse arguments, run each world size, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-predict", action="store_true", help="skip measuring the link for the pred columns")
    args = parser.parse_args()
    for world in args.worlds:
        predict, link_note = (None, "not asked (--no-predict)") if args.no_predict else predictor(world)
        report(world, measure(world, args.sizes_mb, args.repeats), predict, link_note)


if __name__ == "__main__":
    main()
