"""Counting a model's training step without allocating it, for what-if pricing of models larger than this box.

torch's fake tensors (`FakeTensorMode`) carry shape, dtype, device and storage identity but no data: a model built,
stepped and counted inside the mode costs no memory for its tensors and a time set by its op count, not its size.
The counts are the real tensors': FLOPs, dispatched kernels and sizes agree exactly on every shipped model, bar
bf16 saved activations of transformers, a few per mille short (torch's meta layer_norm keeps its mean and rstd in
the input dtype; tests/test_whatif.py). Fake tensors report their device (the CPU here), so CPU autocast applies to
them as it does to real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_utilities import apply_to_collection
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef


def fake_mode() -> FakeTensorMode:
    """A fresh mode: a model built inside it has fake parameters, and every op inside it allocates nothing.

    Real tensors that meet fake ones inside it (a loaded checkpoint's, say) are taken as fake copies.
    """
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_batch(mode: FakeTensorMode, make_batch: Callable[[int], Any], batch_size: int) -> Any:
    """A batch of `make_batch`, gathered from real data outside `mode`, its tensors then faked with their shapes."""
    with unset_fake_temporarily():
        batch = make_batch(batch_size)
    return apply_to_collection(batch, Tensor, mode.from_tensor)


def storage_key(tensor: Tensor) -> int:
    """Which storage `tensor` views, real or fake (a fake one has no data pointer to tell storages apart)."""
    return StorageWeakRef(tensor.untyped_storage()).cdata
