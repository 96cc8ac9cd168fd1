"""Bucketed, error-feedback int8 all-reduce of gradients as a DDP communication hook, with bf16/fp16/fp32 fallbacks.

Register `dispatch_hook` once with a `CompressionState`; the state's `kind` picks int8, bf16, fp16 or plain fp32 at
every call, so the kind can change during training (DDP accepts `register_comm_hook` only once per model).

No `from __future__ import annotations` here: DDP inspects the hook's annotations and rejects string ones.
"""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hslite.parallel.compression.state import CompressionState
from hslite.parallel.wire_format import SCALE_BYTES, shard_layout, wire_bytes

# Smallest normal fp32: dividing by it instead of a zero scale keeps an all-zero chunk's codes at 0 rather than NaN.
_TINY = torch.finfo(torch.float32).tiny

Hook = Callable[[CompressionState, dist.GradBucket], torch.futures.Future[Tensor]]


def _count_call(state: CompressionState, kind: str, bucket: dist.GradBucket) -> None:
    state.calls[kind] += 1
    if bucket.is_last():
        state.step += 1


def _clock(device: torch.device) -> float | torch.cuda.Event:
    """A point in time for the quantise timer: perf_counter on CPU, a CUDA event on `device`'s stream on a GPU.

    CUDA kernels run after the host queues them, so on a GPU perf_counter alone would time kernel launches, not the
    work. An event is recorded in the stream between the kernels and costs the host nothing; the elapsed time is read
    when the total is (`CompressionState.quantise_seconds`), not at every bucket, which would stall backward six
    times per bucket.
    """
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _completed(tensor: Tensor) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def _quantise(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: scale = max|x|/127 and codes = round(x/scale), returned as integral fp32 values."""
    # One temporary serves |x| and then the codes: fresh multi-MB CPU tensors cost a page fault per 4 kB page.
    codes = x.abs()
    scale = codes.amax(dim=-1).div_(127.0)
    # |x|/scale ≤ 127 by construction, so rounding cannot leave the int8 range and no clamp is needed. A NaN or inf
    # makes its chunk's scale non-finite, which dequantises the whole chunk to NaN: AMP's scaler still sees it.
    torch.div(x, scale.clamp_min(_TINY).unsqueeze(-1), out=codes).round_()
    return codes, scale


def _pack(codes: Tensor, scales: Tensor) -> Tensor:
    """Messages of int8 codes followed by their fp32 scales as raw bytes, one row per destination rank."""
    # Codes and scales share one message, so a bucket costs two collectives (all-to-all, all-gather), not four.
    rows, shard = codes.shape
    message = torch.empty(rows, shard + SCALE_BYTES * scales.shape[1], dtype=torch.int8, device=codes.device)
    message[:, :shard].copy_(codes)
    message[:, shard:].copy_(scales.contiguous().view(torch.int8))
    return message


def _scales(message: Tensor, shard: int) -> Tensor:
    return message[:, shard:].contiguous().view(torch.float32)


def int8_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average a gradient bucket across ranks in int8 with per-chunk scales and error feedback.

    Algorithm, on each of N ranks, for a bucket g (in fp32 whatever the gradient dtype) and this rank's residual e:
      1. x = g + e, zero-padded to N shards of whole chunks (`shard_layout`).
      2. Quantise x per chunk: scale = max|x|/127, codes = round(x/scale) in int8.
      3. Reduce-scatter as an all-to-all: rank j receives every rank's codes and scales of shard j (gloo has no
         reduce-scatter future and cannot average int8, so the sum is done here in fp32).
      4. The owner dequantises, sums and divides by N: m = mean of the N dequantised shards.
      5. Re-quantise m per chunk and all-gather the int8 shards with their scales; dequantise into the bucket.
      6. New residual e = x − dequant(codes of step 2): what this rank failed to send. The owner also adds
         N × (m − dequant(requantised m)) on its shard: its input is divided by N before it reaches the average, so
         N times the second rounding error re-sends exactly what the average lost. Both errors then telescope: the
         sum of applied updates equals the sum of true averages up to the current residuals (one step's error).
    The collectives run synchronously and a completed future is returned: waiting on a second collective inside a
    `.then` callback deadlocks over gloo once DDP has two or more buckets.

    Bytes sent per rank: 2·(N−1)·(shard + 4·chunks) ≈ 2·(N−1)/N·S/4 for S fp32 bytes (`wire_bytes`).

    Tuning: int8 pays where the link, not the arithmetic, limits the step (Ethernet, PCIe without NVLink; gloo on
    CPU); on NVLink the quantise passes cost more than the bytes saved, prefer bf16 or none. A smaller chunk_elems
    tightens the error around outliers at 4 bytes per chunk (0.2 % at 2048, 3 % at 128). Each bucket costs two
    collective latencies, so keep buckets in the MB range (DDP's bucket_cap_mb). Error feedback holds one fp32 copy of
    the gradients per rank. Beyond ~16 ranks the owner's N-times-amplified residual starts to inflate the next step's
    scales; keep that error in averaged space then.
    """
    _count_call(state, "int8", bucket)
    buffer = bucket.buffer()
    group = state.process_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or buffer.numel() == 0:
        return _completed(buffer)

    started = _clock(buffer.device)
    numel = buffer.numel()
    shard, chunk, chunks = shard_layout(numel, world, state.chunk_elems)
    x = torch.empty(world * shard, dtype=torch.float32, device=buffer.device)
    x[numel:].zero_()
    residual = state._take_residual(bucket) if state.error_feedback else None
    if residual is None:
        x[:numel].copy_(buffer)
    else:  # written straight into x: one pass instead of a copy and an add
        torch.add(buffer, residual, out=x[:numel])
    x_chunks = x.view(world * chunks, chunk)
    codes, scales = _quantise(x_chunks)
    send = _pack(codes.view(world, shard), scales.view(world, chunks))
    if state.error_feedback:  # x becomes the residual in place, x − codes·scale: no copy, one pass
        x_chunks.addcmul_(codes, scales.unsqueeze(-1), value=-1)
    del codes
    received = torch.empty_like(send)
    state.add_quantise_time(started, _clock(buffer.device))
    dist.all_to_all_single(received, send, group=group)

    started = _clock(buffer.device)
    their_scales = _scales(received, shard)
    mean = torch.zeros(chunks, chunk, dtype=torch.float32, device=buffer.device)
    for sender in range(world):  # one shard-sized temporary at a time, not an N-shard dequantised copy
        mean.addcmul_(received[sender, :shard].view(chunks, chunk), their_scales[sender].unsqueeze(-1))
    mean.div_(world)  # before re-quantising, so the second scale fits the average
    mean_codes, mean_scales = _quantise(mean)
    row = _pack(mean_codes.view(1, shard), mean_scales.view(1, chunks)).view(-1)
    if state.error_feedback:
        second_error = mean.addcmul_(mean_codes, mean_scales.unsqueeze(-1), value=-1).view(-1)
        x.view(world, shard)[rank].add_(second_error, alpha=world)
        # A chunk that held a NaN/inf (an AMP overflow step, skipped by the scaler) must not poison later steps.
        torch.nan_to_num_(x, nan=0.0, posinf=0.0, neginf=0.0)
        state._keep_residual(bucket, x[:numel])
    gathered = torch.empty(world, row.numel(), dtype=torch.int8, device=buffer.device)
    state.add_quantise_time(started, _clock(buffer.device))
    dist.all_gather_single(gathered.view(-1), row, group=group)  # all_gather_into_tensor's name since torch 2.10

    started = _clock(buffer.device)
    all_scales = _scales(gathered, shard)
    for owner in range(-(-numel // shard)):  # owners whose shard holds real (unpadded) elements
        start, stop = owner * shard, min(numel, (owner + 1) * shard)
        codes, scale = gathered[owner, :shard].view(chunks, chunk), all_scales[owner].unsqueeze(-1)
        if stop - start == shard:  # dequantise straight into the bucket
            torch.mul(codes, scale, out=buffer[start:stop].view(chunks, chunk))
        else:  # the last shard runs into the padding
            buffer[start:stop].copy_(torch.mul(codes, scale).view(-1)[: stop - start])
    state.add_quantise_time(started, _clock(buffer.device))
    message_bytes = (world - 1) * (send.shape[1] * send.element_size() + row.numel() * row.element_size())
    state.bytes_sent += message_bytes
    state.bytes_received += message_bytes  # all-to-all and all-gather are symmetric: N−1 messages in, N−1 out
    return _completed(buffer)


def _torch_hook(kind: str, torch_hook: Callable, state: CompressionState, bucket: dist.GradBucket):
    _count_call(state, kind, bucket)
    residual = state._take_residual(bucket)
    if residual is not None:  # int8 residuals left after a switch away from int8 are sent once, not dropped
        bucket.buffer().add_(residual.to(bucket.buffer().dtype))
    sent = wire_bytes(bucket.buffer().numel(), dist.get_world_size(state.process_group), kind)
    state.bytes_sent += sent
    state.bytes_received += sent
    return torch_hook(state.process_group, bucket)


def bf16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average in bfloat16 (torch's bf16_compress_hook, which DDP refuses to register off CUDA by its name)."""
    return _torch_hook("bf16", default_hooks.bf16_compress_hook, state, bucket)


def fp16_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average in float16 (torch's fp16_compress_hook; divides before the sum to avoid overflow)."""
    return _torch_hook("fp16", default_hooks.fp16_compress_hook, state, bucket)


def fp32_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Plain all-reduce average, as DDP does without a hook, with the same statistics as the others."""
    return _torch_hook("none", default_hooks.allreduce_hook, state, bucket)


_HOOKS: dict[str, Hook] = {"int8": int8_hook, "bf16": bf16_hook, "fp16": fp16_hook, "none": fp32_hook}


def dispatch_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """The hook to register: runs the hook of `state.kind`, so `state.set_kind` switches compression mid-training."""
    return _HOOKS[state.kind](state, bucket)
