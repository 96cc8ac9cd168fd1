"""The channel-group gradient hook, one rank, no process group: buckets ready before the token exchange wait for it
and then go in DDP's order; later ones go at once (the multi-rank check is tests/test_collective_order.py)."""

from __future__ import annotations

import pytest
import torch

from hslite.parallel.channels.exchange_order import ExchangeOrder, ordered_hook


class Bucket:
    def __init__(self, index: int):
        self.index, self._buffer = index, torch.full((3,), float(index))

    def buffer(self):
        return self._buffer


def _recording_hook(launched: list[int]):
    def hook(state, bucket):
        launched.append(bucket.index)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer() * 2)
        return done

    return hook


def test_buckets_ready_before_the_exchange_go_right_after_it_in_order():
    launched: list[int] = []
    order = ExchangeOrder(None, _recording_hook(launched))
    order.step_started()
    early = [ordered_hook(order, Bucket(i)) for i in (0, 1)]
    assert launched == [] and not any(f.done() for f in early)  # nothing issued before the exchange
    order.exchanged()
    assert launched == [0, 1] and [f.wait().tolist() for f in early] == [[0.0] * 3, [2.0] * 3]
    late = ordered_hook(order, Bucket(2))
    assert launched == [0, 1, 2] and late.wait().tolist() == [4.0] * 3  # after the exchange: at once


def test_a_forward_with_buckets_still_waiting_is_refused():
    order = ExchangeOrder(None, _recording_hook([]))
    order.step_started()
    ordered_hook(order, Bucket(0))
    with pytest.raises(RuntimeError, match="still wait for a token exchange"):
        order.step_started()
