"""Interconnect models: all-reduce latency alpha and bandwidth BW, measured on this machine or read from a profile.

`measure_links` spawns the ranks, times all_reduce at several sizes and fits docs/design.md's ring formula; it also
measures how much of DDP's all-reduce hides under backward (overlap o). `load_topology` reads a YAML profile for
devices and nodes that are not visible here (`topology.py`: a multi-node plan is priced from one before its launch).
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hslite.cache import read_cache, write_cache
from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.box import threads_per_process
from hslite.parallel.plan import Plan
from hslite.parallel.spawned_rank import end_finished_rank
from hslite.preflight_check.measurements import LinkModel

# Sizes that span latency- and bandwidth-bound all-reduces; gloo on CPU saturates by a few MiB, NCCL needs more.
DEFAULT_SIZES_BYTES = {"gloo": (4 << 10, 64 << 10, 1 << 20, 4 << 20), "nccl": (64 << 10, 4 << 20, 64 << 20, 256 << 20)}
MAX_SIZE_BYTES = {"gloo": 64 << 20, "nccl": 1 << 30}  # adaptive growth stops here (see _rank_main)
WARMUP_REPEATS = 2  # the first collectives of a fresh group pay connection set-up; never timed
OVERLAP_BUCKET_CAP_BYTES = 2 << 20  # several buckets for the synthetic model (8 MiB of gradients) so overlap can show


def fit_link(points: list[tuple[int, float]], world_size: int) -> tuple[float, float]:
    """Alpha and BW from (bytes, seconds) by least squares on T = 2(N−1)·alpha + 2(N−1)/N·S/BW (docs/design.md)."""
    if world_size < 2 or len(points) < 2:
        raise ConfigError(f"fitting a link needs ≥ 2 ranks and ≥ 2 sizes, got {world_size} ranks, {len(points)} sizes.")
    sizes = np.array([s for s, _ in points], dtype=float)
    seconds = np.array([t for _, t in points], dtype=float)
    # Relative residuals (rows scaled by 1/T): the small, latency-bound sizes then weigh as much as the large ones.
    weights = 1.0 / np.maximum(seconds, 1e-9)
    design = np.stack([np.ones_like(sizes), sizes], 1) * weights[:, None]
    intercept, slope = np.linalg.lstsq(design, seconds * weights, rcond=None)[0]
    if intercept < 0:  # latency below the noise: bound it by the smallest all-reduce's time (conservative)
        intercept = float(seconds[sizes.argmin()])
        slope = float(np.sum(weights**2 * (seconds - intercept) * sizes) / np.sum(weights**2 * sizes**2))
    if slope <= 0:  # no size resolved bandwidth: latency from the mean, BW bounded as if the largest were all transfer
        intercept, slope = float(seconds.mean()), float(seconds[sizes.argmax()] / sizes.max())
    n = world_size
    return float(intercept) / (2 * (n - 1)), 2 * (n - 1) / n / float(slope)


def measure_links(
    world_size: int,
    sizes_bytes: tuple[int, ...] | None = None,
    backend: str = "gloo",
    threads_per_process: int = 1,
    repeats: int = 5,
    timeout_seconds: float = 60.0,
    fresh: bool = False,
) -> LinkModel:
    """Measure alpha, BW and overlap o with `world_size` spawned ranks; cached per (backend, N, threads, host).

    Method: each size is all-reduced `repeats` times after a warm-up, behind a barrier; a size's time is the slowest
    rank's median. Overlap: a synthetic 8-layer MLP's backward is timed alone (T_b), with DDP's bucketed
    asynchronous all-reduce (emulated with gradient hooks, 2 MiB buckets) and waiting for it (T_ddp), and its
    gradients' all-reduce alone (T_ar); o = (T_b + T_ar − T_ddp) / T_b clipped to [0, 1], the inverse of
    docs/design.md's T_N = T_b + max(0, T_ar − o·T_b). `fresh=True` ignores the cache.

    Ranks start with torch.multiprocessing's "spawn" and meet through a FileStore (no port). Spawned ranks re-import
    the caller's main script, so a script calling this needs the `if __name__ == "__main__":` guard and should keep
    heavy imports (lightning) out of its top level.
    """
    if world_size <= 1:
        return LinkModel.no_cost()
    if backend not in DEFAULT_SIZES_BYTES:
        raise ConfigError(f"link backend must be 'gloo' or 'nccl', got {backend!r}.")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ConfigError(
            f"measuring {world_size} NCCL ranks needs {world_size} visible GPUs, found {torch.cuda.device_count()}; "
            "price the plan from a topology profile (preflight.topology=...) instead."
        )
    sizes = tuple(sizes_bytes or DEFAULT_SIZES_BYTES[backend])
    key = {"backend": backend, "world_size": world_size, "threads": threads_per_process, "host": socket.gethostname()}
    key["sizes_bytes"], key["repeats"] = list(sizes), repeats
    cached = None if fresh else read_cache("links", key)
    if cached is not None:
        return LinkModel.from_dict(cached)
    with tempfile.TemporaryDirectory(prefix="hslite-links-") as tmp:
        out = Path(tmp) / "result.json"
        args = (world_size, backend, str(Path(tmp) / "store"), sizes, repeats, threads_per_process, str(out))
        ctx = mp.start_processes(
            _rank_main, args=(*args, timeout_seconds), nprocs=world_size, join=False, start_method="spawn"
        )
        _join_within(ctx, timeout_seconds, f"measuring {world_size} {backend} ranks")
        measured = json.loads(out.read_text())
    points, overlap = [(int(s), float(t)) for s, t in measured["points"]], float(measured["overlap"])
    alpha, bw = fit_link(points, world_size)
    source = f"measured: {world_size} {backend} ranks × {threads_per_process} threads on {key['host']}"
    link = LinkModel(alpha, bw, overlap, source, points)
    write_cache("links", key, link.to_dict())
    return link


def measure_links_for(plan: Plan, *, fresh: bool = False, timeout_seconds: float = 60.0) -> LinkModel:
    """A `link_for` for `run_preflight` that measures this machine (cached).

    The ranks of the plan's gradient all-reduce (all of them: DDP spans channel groups too): gloo with the threads
    one CPU rank gets, or NCCL on GPUs. Multi-node plans
    cannot be measured here: use `load_topology(name).link_for`.
    """
    if plan.num_nodes > 1:
        raise ConfigError(f"{plan.describe()} spans {plan.num_nodes} nodes; price it with a topology profile.")
    if plan.accelerator == "gpu":
        return measure_links(plan.world_size, backend="nccl", fresh=fresh, timeout_seconds=timeout_seconds)
    threads = threads_per_process(plan)
    return measure_links(plan.world_size, threads_per_process=threads, fresh=fresh, timeout_seconds=timeout_seconds)


def _join_within(ctx: mp.ProcessContext, timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                for proc in ctx.processes:  # only the ranks this call spawned
                    proc.terminate()
                raise HSLiteError(
                    f"{what} took longer than {timeout_seconds:.0f} s; raise timeout_seconds, or price the plan "
                    "from a topology profile (preflight.topology=...)."
                )
    except (
        mp.ProcessRaisedException,
        mp.ProcessExitedException,
    ) as err:  # a rank failed; join() has already stopped the others
        last_line = str(err).strip().splitlines()[-1]
        raise HSLiteError(
            f"{what} failed on a rank ({last_line}). Ranks are spawned, so they re-import the calling script: guard "
            "it with `if __name__ == '__main__':`, or price the plan from a topology profile instead."
        ) from err


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    sizes: tuple[int, ...],
    repeats: int,
    threads: int,
    out: str,
    timeout_seconds: float,
) -> None:
    # A FileStore rendezvous needs no port, so parallel measurements can never collide.
    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world_size)
    timeout = timedelta(seconds=timeout_seconds)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    try:
        points, overlap = _points_and_overlap(device, backend, sizes, repeats, dist.group.WORLD)
        if rank == 0:
            Path(out).write_text(json.dumps({"points": points, "overlap": overlap}))
    finally:
        dist.destroy_process_group()
    end_finished_rank()


def measure_launched_link(group: Any, world_size: int, device: torch.device, repeats: int = 5) -> LinkModel:
    """Alpha, BW and overlap of `group`, whose `world_size` ranks a launcher already started: each of them calls this.

    The same method as `measure_links` on the ranks a job runs on (a Lightning script's, `hslite.PreflightGate`):
    the link measured is the one training will use, not a stand-in spawned beside it. Not cached.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    points, overlap = _points_and_overlap(device, backend, DEFAULT_SIZES_BYTES[backend], repeats, group)
    alpha, bw = fit_link(points, world_size)
    return LinkModel(alpha, bw, overlap, f"measured on the launched job's {world_size} {backend} ranks", points)


def _points_and_overlap(
    device: torch.device, backend: str, sizes: tuple[int, ...], repeats: int, group: Any
) -> tuple[list[tuple[int, float]], float]:
    points = [(size, _timed_allreduce(torch.zeros(size // 4, device=device), repeats, group)) for size in sizes]
    # Bandwidth is only resolved once transfer time dominates latency: grow the largest size until the biggest
    # all-reduce takes twice the smallest. Every rank sees the same (MAX-reduced) times, so all agree to stop.
    while points[-1][1] < 2 * points[0][1] and points[-1][0] < MAX_SIZE_BYTES[backend]:
        size = points[-1][0] * 4
        points.append((size, _timed_allreduce(torch.zeros(size // 4, device=device), repeats, group)))
    return points, _measured_overlap(device, repeats, group)


def _slowest_median(samples: list[float], device: torch.device, group: Any) -> float:
    value = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)  # a collective ends when its slowest rank does
    return float(value.item())


def _timed(fn: Any, repeats: int, device: torch.device, group: Any, prepare: Any = lambda: None) -> float:
    # `prepare` runs outside the timed region (e.g. the forward before a timed backward).
    samples = []
    for i in range(WARMUP_REPEATS + repeats):
        state = prepare()
        dist.barrier(group=group)
        start = time.perf_counter()
        fn(state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP_REPEATS:
            samples.append(time.perf_counter() - start)
    return _slowest_median(samples, device, group)


def _timed_allreduce(buffer: torch.Tensor, repeats: int, group: Any) -> float:
    return _timed(lambda _: dist.all_reduce(buffer, group=group), repeats, buffer.device, group)


def _measured_overlap(device: torch.device, repeats: int, group: Any) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).to(device)
    batch = torch.randn(32, 512, device=device)
    backward_seconds = _timed(lambda loss: loss.backward(), repeats, device, group, lambda: model(batch).sum())
    allreduce_seconds = _timed_allreduce(
        torch.zeros(sum(p.numel() for p in model.parameters()), device=device), repeats, group
    )
    works = _bucketed_allreduce_hooks(model, OVERLAP_BUCKET_CAP_BYTES, group)
    bucketed_seconds = _timed(
        lambda loss: _backward_and_wait(loss, works), repeats, device, group, lambda: model(batch).sum()
    )
    hidden_seconds = backward_seconds + allreduce_seconds - bucketed_seconds
    return min(1.0, max(0.0, hidden_seconds / backward_seconds))


def _bucketed_allreduce_hooks(model: nn.Module, bucket_cap_bytes: int, group: Any) -> list[Any]:
    # DDP's reducer (Li et al., "PyTorch Distributed", VLDB 2020): parameters are bucketed in reverse order and a
    # bucket's all-reduce starts asynchronously as soon as all its gradients exist. Emulated with gradient hooks
    # because constructing DDP imports torch._dynamo (seconds per rank on a small CPU), which alone would break the
    # budget.
    buckets: list[list[nn.Parameter]] = [[]]
    for param in reversed(list(model.parameters())):
        if buckets[-1] and sum(p.numel() * p.element_size() for p in buckets[-1]) >= bucket_cap_bytes:
            buckets.append([])
        buckets[-1].append(param)
    works: list[Any] = []
    ready: dict[int, int] = {}

    def on_grad(bucket_index: int) -> Any:
        def hook(_: nn.Parameter) -> None:
            ready[bucket_index] = ready.get(bucket_index, 0) + 1
            if ready[bucket_index] == len(buckets[bucket_index]):
                ready[bucket_index] = 0
                grads = [p.grad.flatten() for p in buckets[bucket_index] if p.grad is not None]
                # DDP copies into a flat bucket too
                works.append(dist.all_reduce(torch.cat(grads), group=group, async_op=True))

        return hook

    for index, bucket in enumerate(buckets):
        for param in bucket:
            param.register_post_accumulate_grad_hook(on_grad(index))
    return works


def _backward_and_wait(loss: torch.Tensor, works: list[Any]) -> None:
    loss.backward()
    while works:
        works.pop(0).wait()
