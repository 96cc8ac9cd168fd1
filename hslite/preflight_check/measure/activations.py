"""Where a forward's memory and time go: bytes autograd saves for backward, and the per-group work's share of both.

Channel groups and rotation split only a band-group model's per-group work (its `encode_group`), so the probe
measures that share (`measure_tokenizer`) instead of assuming it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.parallel.channels.group_gradients import group_parameters
from hslite.preflight_check.measure.fake_tensors import storage_key
from hslite.preflight_check.measure.timers import autocast, intervals_seconds, mark
from hslite.preflight_check.measure.training_step import TrainingStep, batch_to
from hslite.preflight_check.measurements import Footprint


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for backward during a forward, one count per storage, parameters excluded.

    Storages are attributed to the per-group work when first saved while it runs (`inside`, set around it).
    """

    def __init__(self, model: nn.Module) -> None:
        self._param_storages = {storage_key(p) for p in model.parameters()}
        self._seen: dict[int, tuple[int, bool]] = {}
        self.inside = False
        super().__init__(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: Tensor) -> Tensor:
        key = storage_key(tensor)
        if key not in self._param_storages and key not in self._seen:
            self._seen[key] = (tensor.untyped_storage().nbytes(), self.inside)
        return tensor

    @property
    def total_bytes(self) -> int:
        """Bytes saved for backward so far."""
        return sum(n for n, _ in self._seen.values())

    @property
    def inside_bytes(self) -> int:
        """Of those, the bytes first saved while a tokenizer module ran."""
        return sum(n for n, inside in self._seen.values() if inside)


@contextmanager
def around_group_work(model: nn.Module, enter: Callable[[], None], leave: Callable[[Any], None]) -> Iterator[None]:
    """Call `enter()` before and `leave(output)` after each `model.encode_group(...)` run inside the block.

    `encode_group` is a band-group model's per-group work (the protocol of `models.ModelClass`): what channel groups
    split across ranks and rotation leaves out, its outputs the group tokens the ranks exchange.
    """
    if not callable(getattr(model, "encode_group", None)):
        raise ConfigError(
            f"{type(model).__name__} has no encode_group method: only a band-group model (BAND_GROUPS = True, "
            "README 'Your own model') has per-group work to split."
        )
    original: Callable[..., Any] = model.encode_group  # type: ignore[assignment]

    def encode_group(*args: Any, **kwargs: Any) -> Any:
        enter()
        output = original(*args, **kwargs)
        leave(output)
        return output

    model.encode_group = encode_group  # type: ignore[assignment]  # an instance attribute, before the class's method
    try:
        yield
    finally:
        del model.encode_group


def measure_tokenizer(
    result: Footprint,
    model: nn.Module,
    make_batch: Callable[[int], Any],
    precision: str,
    dev: torch.device,
    step: TrainingStep,
    *,
    forwards: int = 3,
) -> float:
    """Fill `result`'s per-group activation share, group-token and own-gradient bytes; return the work's time share.

    `model` is a band-group model in training mode on `dev`; its per-group work is `encode_group` (every call of it
    in a forward), whose outputs are the group tokens that channel groups exchange. The time share is the median of
    `forwards` forwards (one is enough where only the bytes are wanted).
    """
    batch = batch_to(make_batch(result.batch_size), dev)
    state: dict[str, Any] = {"spans": [], "output_bytes": 0}  # spans: [start, end] of each call

    def enter() -> None:
        counter.inside = True
        state["spans"].append([mark(dev)])

    def leave(output: Any) -> None:
        counter.inside = False
        state["spans"][-1].append(mark(dev))
        state["output_bytes"] += output.numel() * output.element_size()

    shares = []
    with around_group_work(model, enter, leave):
        for _ in range(forwards):  # the counter of the last one gives the activation share
            state.update(spans=[], output_bytes=0)
            counter = SavedTensorCounter(model)
            with autocast(precision, dev), counter:
                marks = [mark(dev)]
                step.loss(model, batch)
                marks.append(mark(dev))
            group_seconds = sum(intervals_seconds(span, dev)[0] for span in state["spans"])
            shares.append(group_seconds / intervals_seconds(marks, dev)[0])
    if not state["spans"]:
        raise ConfigError(f"{type(model).__name__}'s forward never called encode_group: a band-group model encodes "
                          "its groups with it (README 'Your own model').")  # fmt: skip
    result.group_grad_bytes = [
        sum(p.numel() * p.element_size() for p in group_parameters(model, g)) for g in range(len(state["spans"]))
    ]  # one encode_group call per group in the last forward
    result.tokenizer_activation_fraction = counter.inside_bytes / max(counter.total_bytes, 1)
    result.group_token_bytes_per_sample = state["output_bytes"] // result.batch_size
    return statistics.median(shares)
