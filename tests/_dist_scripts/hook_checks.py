"""Checks of the int8 all-reduce hook on N gloo ranks; run by tests/test_compression.py.

    python tests/_dist_scripts/hook_checks.py WORLD OUT_JSON

Each rank regenerates every rank's gradients from one seed, so it knows the exact fp32 average to compare with.
Rank results (JSON) hold measurements; the asserts live in the test.
"""

import copy
import time

import torch
import torch.distributed as dist
from _ranks import FakeBucket, main
from torch import nn

from hslite.parallel.compression.hook import (
    dispatch_hook,
    int8_hook,
)
from hslite.parallel.compression.state import CompressionState
from hslite.parallel.wire_format import shard_layout, wire_bytes

CHUNK = 2048


def one_step_bound(grads: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-element bound on |int8 average − fp32 average| for one call with no residual, from the scales.

    Stage 1: rank i's rounding error is ≤ s_i/2 with s_i = max|chunk of g_i|/127, averaged over N ranks.
    Stage 2: the owner re-quantises the average m, error ≤ s_m/2 with s_m ≤ (max|chunk of mean| + stage-1 error)/127.
    """
    world, numel = grads.shape
    shard, chunk, chunks = shard_layout(numel, world, chunk)
    padded = torch.zeros(world, world * shard)
    padded[:, :numel] = grads
    per_chunk = padded.view(world, world * chunks, chunk)
    stage1 = (per_chunk.abs().amax(-1) / 127).sum(0) / (2 * world)
    stage2 = (per_chunk.mean(0).abs().amax(-1) + stage1) / 127 / 2
    return (stage1 + stage2).repeat_interleave(chunk)[:numel]


def hooked_mean(state: CompressionState, grads: torch.Tensor, rank: int, params: list[torch.Tensor]) -> torch.Tensor:
    """This rank's row of grads through the int8 hook; pass the same params every step, as DDP does."""
    return int8_hook(state, FakeBucket(grads[rank].clone(), params)).wait()


def check_one_step(rank: int, world: int) -> dict:
    numel = 3 * world * CHUNK + 777  # not a multiple of world × chunk: padding is exercised
    gen = torch.Generator().manual_seed(0)
    magnitudes = 10 ** torch.empty(numel // 512 + 1).uniform_(-3, 1, generator=gen)  # scales differ chunk to chunk
    grads = torch.randn(world, numel, generator=gen) * magnitudes.repeat_interleave(512)[:numel]
    params = [torch.empty(numel - 1000), torch.empty(1000)]
    out = hooked_mean(CompressionState(chunk_elems=CHUNK), grads, rank, params)
    error = (out - grads.mean(0)).abs()
    bound = one_step_bound(grads, CHUNK)
    return {
        "max_error": error.max().item(),
        "max_error_over_bound": (error / bound).max().item(),
        "fp32_scale": grads.mean(0).abs().max().item(),
        "checksum": out.double().sum().item(),
    }


def check_error_feedback(rank: int, world: int, steps: int = 40) -> dict:
    """Gradients with one spike per chunk and a small constant: the constant is below half a quantum every step."""
    numel = 2 * world * CHUNK
    gen = torch.Generator().manual_seed(1)
    trajectories = {}
    params = [torch.empty(numel // 2), torch.empty(numel // 2)]
    for feedback in (True, False):
        state = CompressionState(chunk_elems=CHUNK, error_feedback=feedback)
        applied = torch.zeros(numel, dtype=torch.float64)
        true = torch.zeros(numel, dtype=torch.float64)
        gen.manual_seed(1)
        drift, ratio = [], []
        for _ in range(steps):
            grads = 1e-3 + 1e-4 * torch.randn(world, numel, generator=gen)
            grads[:, ::CHUNK] = 1.0
            applied += hooked_mean(state, grads, rank, params).double()
            true += grads.mean(0).double()
            gap = (applied - true).abs()
            drift.append(gap.max().item())
            ratio.append((gap / one_step_bound(grads, CHUNK).double()).max().item())
        trajectories["ef" if feedback else "no_ef"] = {"drift": drift, "drift_over_bound": ratio}
    return trajectories


def check_non_finite(rank: int, world: int) -> dict:
    """An inf on rank 0 (an AMP overflow step) must reach every rank as non-finite and leave finite residuals."""
    numel = 4 * world * CHUNK
    state, params = CompressionState(chunk_elems=CHUNK), [torch.empty(numel)]
    grads = torch.randn(world, numel, generator=torch.Generator().manual_seed(2))
    grads[0, 5] = float("inf")
    out = hooked_mean(state, grads, rank, params)
    residual = state.residuals()[id(params[0])]
    return {
        "first_chunk_finite": torch.isfinite(out[:CHUNK]).any().item(),
        "other_chunks_finite": torch.isfinite(out[CHUNK:]).all().item(),
        "residual_finite": torch.isfinite(residual).all().item(),
        "residual_nonzero": (residual[CHUNK:] != 0).any().item(),
    }


def check_wire_bytes(rank: int, world: int) -> dict:
    """Count bytes from the tensors handed to the collectives, by wrapping them."""
    counted = {"bytes": 0}
    a2a, gather_name = dist.all_to_all_single, "all_gather_single"
    gather = dist.all_gather_single

    def counting_a2a(output, input, *args, **kwargs):
        counted["bytes"] += input.numel() * input.element_size() * (world - 1) // world  # own row stays home
        return a2a(output, input, *args, **kwargs)

    def counting_gather(output, input, *args, **kwargs):
        counted["bytes"] += input.numel() * input.element_size() * (world - 1)  # own row to every peer
        return gather(output, input, *args, **kwargs)

    dist.all_to_all_single, orig = counting_a2a, a2a
    setattr(dist, gather_name, counting_gather)
    rows = []
    try:
        for numel in (1_000_000, 250_013, 5_000, 100):
            state = CompressionState(chunk_elems=CHUNK)
            counted["bytes"] = 0
            int8_hook(state, FakeBucket(torch.randn(numel), [torch.empty(numel)])).wait()
            rows.append(
                {
                    "numel": numel,
                    "counted": counted["bytes"],
                    "stats": state.bytes_sent,
                    "formula": wire_bytes(numel, world, "int8", CHUNK),
                    "fp32_ring": wire_bytes(numel, world, "none"),
                }
            )
    finally:
        dist.all_to_all_single = orig
        setattr(dist, gather_name, gather)
    return {"rows": rows}


def check_ddp(rank: int, world: int, steps: int = 6) -> dict:
    """Real DDP with ≥ 2 buckets: int8 hook against plain DDP from the same start; then switch kinds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    plain_model = copy.deepcopy(model)
    hooked = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    plain = nn.parallel.DistributedDataParallel(plain_model, bucket_cap_mb=0.1)
    state = CompressionState("int8", chunk_elems=CHUNK)
    state.bind(model)
    seen = []

    def recording_hook(s: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append((s.step + 1, s.kind))  # s.step counts finished steps
        return dispatch_hook(s, bucket)

    hooked.register_comm_hook(state, recording_hook)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (hooked, plain)]
    gen = torch.Generator().manual_seed(100 + rank)

    def train_step() -> None:
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        for ddp, opt in zip((hooked, plain), optimisers, strict=True):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

    started = time.perf_counter()
    for _ in range(steps):
        train_step()
    int8_diff = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), plain_model.parameters(), strict=True)
    )
    scale = max(p.abs().max().item() for p in plain_model.parameters())
    residual_buckets = len(state._buckets)
    switches = ["bf16", "fp16", "none", "int8"]
    for kind in switches:
        state.set_kind(kind)
        train_step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    total = steps + len(switches)
    return {
        "seconds": time.perf_counter() - started,
        "calls": state.calls,
        "buckets_per_step": [sum(1 for s, _ in seen if s == t) for t in range(1, total + 1)],
        "kinds_per_step": [sorted({k for s, k in seen if s == t}) for t in range(1, total + 1)],
        "param_max_diff_after_int8": int8_diff,
        "param_max_abs": scale,
        "residual_buckets_after_int8": residual_buckets,
        "ranks_agree": all(torch.equal(flat, other) for other in everyone),
    }


def run(rank: int, world: int) -> dict:
    return {
        "one_step": check_one_step(rank, world),
        "error_feedback": check_error_feedback(rank, world),
        "non_finite": check_non_finite(rank, world),
        "wire_bytes": check_wire_bytes(rank, world),
        "ddp": check_ddp(rank, world),
    }


if __name__ == "__main__":
    main(run)
