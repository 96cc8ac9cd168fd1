"""What the compressed all-reduce puts on the wire: kinds, int8 chunking and bytes per rank (torch-free).

The int8 hook (`compression.py`) and the counters of bytes sent read `wire_bytes` (one bucket on one rank); the
pre-flight's cost model reads `compressed_bytes` (a step's gradients as the kind sends them, which its ring formulas
multiply), from the same element sizes and int8 chunking.
"""

from __future__ import annotations

import math

from hslite.errors import ConfigError
from hslite.parallel.plan import COMPRESSIONS

KINDS = COMPRESSIONS
DEFAULT_CHUNK_ELEMS = 2048  # one fp32 scale per 2048 int8 values: 0.2 % of the payload
SCALE_BYTES = 4  # scales travel as fp32
ELEMENT_BYTES = {"none": 4, "int8": 1, "bf16": 2, "fp16": 2}  # bytes a gradient element travels as


def check_kind(kind: str) -> str:
    """Return kind when it names a compression, else raise ConfigError listing the valid ones."""
    if kind not in KINDS:
        raise ConfigError(f"unknown gradient compression {kind!r}; use one of {', '.join(KINDS)}.")
    return kind


def shard_layout(numel: int, world_size: int, chunk_elems: int) -> tuple[int, int, int]:
    """How int8 splits a bucket: (elements per rank's shard, elements per scale chunk, chunks per shard).

    The bucket is zero-padded to world_size × shard elements. Chunks are balanced (each ≤ chunk_elems) rather than
    fixed at chunk_elems, so padding stays below world_size × chunks elements and a small bucket is not padded up to
    world_size × chunk_elems, which would cost more bytes than the fp32 all-reduce it replaces.
    """
    per_rank = -(-numel // world_size)
    chunks = max(1, -(-per_rank // chunk_elems))
    chunk = -(-per_rank // chunks)
    return chunks * chunk, chunk, chunks


def wire_bytes(numel: int, world_size: int, kind: str = "int8", chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """Bytes one rank sends to all-reduce a bucket of numel gradient elements with this compression kind.

    int8: an all-to-all and an all-gather of (shard int8 values + their fp32 scales), each sending (N−1) messages,
    about 2·(N−1)/N·S/4 for S fp32 bytes. bf16, fp16, none: ring all-reduce, 2·(N−1) chunks of numel/N elements.
    """
    check_kind(kind)
    if world_size <= 1 or numel == 0:
        return 0
    if kind == "int8":
        shard, _, chunks = shard_layout(numel, world_size, chunk_elems)
        return 2 * (world_size - 1) * (shard + SCALE_BYTES * chunks)
    return 2 * (world_size - 1) * -(-numel // world_size) * ELEMENT_BYTES[kind]


def compressed_bytes(fp32_bytes: float, kind: str) -> float:
    """A step's fp32 gradient bytes as `kind` sends them: S·(element bytes)/4, and one fp32 scale per int8 chunk."""
    check_kind(kind)
    scales = SCALE_BYTES * math.ceil(fp32_bytes / 4 / DEFAULT_CHUNK_ELEMS) if kind == "int8" else 0
    return fp32_bytes * ELEMENT_BYTES[kind] / 4 + scales


def fsdp_wire_bytes(param_bytes: float, grad_bytes: float, shards: int, replicas: int = 1) -> float:
    """Bytes one rank sends per FSDP micro-step: ring formulas over a shard group of `shards` ranks.

    The parameters gathered twice (forward and backward; `param_bytes` in the compute dtype) and the fp32 gradients
    reduce-scattered, (S − 1)/S of each; under hybrid sharding, the all-reduce of the rank's 1/S gradient shard over
    the `replicas` (one per node), 2(R − 1)/R of it.
    """
    inside = (shards - 1) / shards * (2 * param_bytes + grad_bytes)
    return inside + 2 * (replicas - 1) / replicas * grad_bytes / shards
