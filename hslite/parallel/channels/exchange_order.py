"""One order of collectives on every rank under channel groups: no gradient all-reduce before the token exchange.

Two communicators are busy in a channel-group backward: the chag sub-group's all-to-all that returns token
gradients (`channel_groups._ExchangeGroupTokens.backward`) and DDP's gradient all-reduces over all ranks, launched
bucket by bucket as gradients become ready. Which buckets are ready before the exchange differs by rank: a rank
that does not own a band group has that group's parameters marked ready (unused) at the first gradient, where its
owner computes them after the exchange; DDP rebuilds its buckets in rank 0's ready order, so a bucket can mix both.
One rank would then issue [all-reduce, all-to-all] and another [all-to-all, all-reduce]. Gloo forgives that; NCCL
does not (a kernel of one communicator waits for peers that are blocked in the other's: a hang).

The guarantee: the gradient hook (`OrderedHook`, wrapping the plain all-reduce or hslite's compressed one) defers
every bucket that becomes ready before this step's exchange and launches them, in DDP's bucket order, right after
the exchange's all-to-all; later buckets go at once. So every rank issues the exchange, then the buckets 0..K in
order, then DDP's unused-parameter map (launched once every bucket has been handed to the hook, which needs the
rank's own band groups' gradients, computed after the exchange). Buckets ready early lose their overlap with the
part of backward before the exchange (the head and aggregation); the tokenizers' backward still overlaps.
`tests/test_collective_order.py` records each rank's collectives and checks the sequences are equal.

No `from __future__ import annotations` here, as in `compression.py`: DDP inspects its hooks' annotations.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[Tensor]]


class ExchangeOrder:
    """Per-rank state of `ordered_hook`: whether this step's exchange has run, and the buckets waiting for it."""

    def __init__(self, inner_state: Any, inner_hook: Hook) -> None:
        self.inner_state, self.inner_hook = inner_state, inner_hook
        self._exchanged = False
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future[Tensor]]] = []

    def step_started(self) -> None:
        """A forward begins: buckets ready from now on wait for its exchange's backward."""
        if self._pending:
            raise RuntimeError(
                f"{len(self._pending)} gradient buckets still wait for a token exchange that never ran backward; "
                "a channel-group forward must run backward before the next forward."
            )
        self._exchanged = False

    def exchanged(self) -> None:
        """The exchange's backward all-to-all is issued: launch the buckets that waited for it, in order."""
        self._exchanged = True
        pending, self._pending = self._pending, []
        for bucket, waiting in pending:
            self.inner_hook(self.inner_state, bucket).then(_passing_to(waiting))

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """The inner hook's future now, after the exchange; before it, a future completed when the bucket goes."""
        if self._exchanged:
            return self.inner_hook(self.inner_state, bucket)
        buffer = bucket.buffer()
        # A CUDA-aware future: set from the inner future's callback, it makes DDP's stream wait for that work.
        waiting: torch.futures.Future[Tensor] = (
            torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        )
        self._pending.append((bucket, waiting))
        return waiting


def _passing_to(waiting: torch.futures.Future[Tensor]) -> Callable[[torch.futures.Future[Tensor]], None]:
    def pass_on(done: torch.futures.Future[Tensor]) -> None:
        waiting.set_result(done.value())

    return pass_on


def ordered_hook(state: ExchangeOrder, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """The DDP communication hook to register with an `ExchangeOrder` state (see the module notes)."""
    return state.hook(bucket)
