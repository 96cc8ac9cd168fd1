"""The int8 hook's CUDA timing events stay bounded over a run that no checkpoint reads, and add up to the same total.

Fake events stand for CUDA ones (no GPU here): each knows its elapsed milliseconds and whether it was waited for.
"""

from __future__ import annotations

from hslite.parallel.compression.state import PENDING_EVENT_PAIRS, CompressionState


class FakeEvent:
    """A CUDA event pair's end: `elapsed_time` from its start, in milliseconds, as torch.cuda.Event answers it."""

    def __init__(self, milliseconds: float) -> None:
        self.milliseconds = milliseconds
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.milliseconds


def test_pending_events_stay_bounded_and_are_read_oldest_first_into_the_same_total():
    state = CompressionState()
    phases = 3 * PENDING_EVENT_PAIRS  # three per bucket: a long run with no checkpoint in it
    ends = [FakeEvent(0.1 + (k % 7) * 0.37) for k in range(phases)]
    most = 0
    for end in ends:
        state.add_quantise_time(FakeEvent(0.0), end)
        most = max(most, len(state._quantise_events))
    assert most == PENDING_EVENT_PAIRS  # memory stays flat; before, one pair per phase of the run was kept
    read = [end.waited for end in ends]
    assert read == [True] * (phases - PENDING_EVENT_PAIRS) + [False] * PENDING_EVENT_PAIRS  # the oldest only
    expected = 0.0
    for end in ends:  # the order the total was always summed in: the same float, not only a close one
        expected += end.milliseconds / 1000
    assert state.quantise_seconds == expected and len(state._quantise_events) == 0 and all(e.waited for e in ends)
