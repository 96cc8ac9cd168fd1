"""Where a forward's memory and time go: bytes autograd saves for backward, and the tokenizer's share of both.

Channel groups and rotation split only the tokenizer's work, so the probe measures that share (`measure_tokenizer`)
instead of assuming it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hslite.errors import ConfigError
from hslite.preflight.fake_tensors import storage_key
from hslite.preflight.measurements import Footprint
from hslite.preflight.timers import autocast, intervals_seconds, mark
from hslite.preflight.training_step import TrainingStep, batch_to


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for backward during a forward, one count per storage, parameters excluded.

    Storages are attributed to the tokenizer when first saved while its forward runs (`inside` is set by hooks).
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


def measure_tokenizer(
    result: Footprint,
    model: nn.Module,
    make_batch: Callable[[int], Any],
    names: tuple[str, ...],
    precision: str,
    dev: torch.device,
    step: TrainingStep,
    *,
    forwards: int = 3,
) -> float:
    """Fill `result`'s tokenizer share of activation bytes and its group-token bytes; return its share of forward time.

    `model` is in training mode on `dev`; `names` are its submodules as in `named_modules()`; the output of the
    last one, summed over its calls, is the group tokens that channel groups exchange. The time share is the median
    of `forwards` forwards (one is enough where only the bytes are wanted).
    """
    modules = dict(model.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        raise ConfigError(
            f"tokenizer_modules {missing} are not submodules; some names: {', '.join(list(modules)[1:9])}."
        )
    batch = batch_to(make_batch(result.batch_size), dev)
    state: dict[str, Any] = {"depth": 0, "spans": [], "output_bytes": 0}  # spans: [start, end] of outermost calls

    def enter(*_: Any) -> None:
        state["depth"] += 1
        counter.inside = True
        if state["depth"] == 1:
            state["spans"].append([mark(dev)])

    def leave(module: nn.Module, _: Any, output: Any) -> None:
        state["depth"] -= 1
        counter.inside = state["depth"] > 0
        if state["depth"] == 0:
            state["spans"][-1].append(mark(dev))
        if module is modules[names[-1]]:  # the last named module produces the group tokens
            outputs = output if isinstance(output, (tuple, list)) else [output]
            state["output_bytes"] += sum(t.numel() * t.element_size() for t in outputs if torch.is_tensor(t))

    handles = [
        h for n in names for h in (modules[n].register_forward_pre_hook(enter), modules[n].register_forward_hook(leave))
    ]
    shares = []
    try:
        for _ in range(forwards):  # the counter of the last one gives the activation share
            state.update(spans=[], output_bytes=0)
            counter = SavedTensorCounter(model)
            with autocast(precision, dev), counter:
                marks = [mark(dev)]
                step.loss(model, batch)
                marks.append(mark(dev))
            tokenizer_seconds = sum(intervals_seconds(span, dev)[0] for span in state["spans"])
            shares.append(tokenizer_seconds / intervals_seconds(marks, dev)[0])
    finally:
        for handle in handles:
            handle.remove()
    if not state["spans"]:
        raise ConfigError(f"tokenizer_modules {list(names)} never ran in the model's forward; name modules that do.")
    result.tokenizer_activation_fraction = counter.inside_bytes / max(counter.total_bytes, 1)
    result.group_token_bytes_per_sample = state["output_bytes"] // result.batch_size
    return statistics.median(shares)
