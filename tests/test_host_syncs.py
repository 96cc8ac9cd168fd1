"""A training step waits for the GPU only when it logs; the device-resident gather never waits.

On CUDA the host waits for the GPU's queue to drain (a host sync) when it reads a device value (`.item()`, `float()`,
`bool()`, `.tolist()`, `.cpu()`) and in ops whose output size depends on the values (boolean-mask indexing,
`nonzero`, `unique`, `masked_select`, `bincount`, `repeat_interleave`). On a CPU nothing waits, so the CPU tests count
those calls instead: a dispatch mode sees every aten op, and `.tolist()` / `.cpu()` (which do not dispatch on a CPU
tensor) are wrapped. Calls made by torch.optim (AdamW keeps its step counters on the host on every device) and by the
DataLoader's own code (its sampler's host-side indices) are not syncs on CUDA either, and are left out. With a GPU at
hand, `test_no_sync_on_cuda` checks the same with `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils._python_dispatch import TorchDispatchMode

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.settings import DataSettings
from hslite.models import get_model
from hslite.parallel.plan import Plan
from hslite.parallel.ranks.rank_watch import RankActivity
from hslite.parallel.timing import TrainThroughput
from hslite.parallel.trainer.trainer_args import trainer_kwargs
from hslite.parallel.trainer.usage import RankUsage
from hslite.task import HSIClassifier

aten = torch.ops.aten
SYNCING_OPS = {
    aten._local_scalar_dense.default,  # .item(), float(), int(), bool() of a tensor
    aten.nonzero.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.masked_select.default,
    aten.bincount.default,  # its CUDA kernel reads the largest value back first
    aten.repeat_interleave.Tensor,
}
MASK_INDEXED_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}  # sync with a bool index
HOST_SIDE = ("/torch/optim/", "/torch/utils/data/")  # code whose tensors stay on the host on every device
TORCH_DIR = str(Path(torch.__file__).parent) + "/"
COUNTER_FRAMES = {(__file__, name) for name in ("_call_site", "_record", "__torch_dispatch__", "counted")}
LOG_EVERY = 3


def _call_site() -> str | None:
    """file:line of the code that made the call, or None when torch.optim or the DataLoader's own code made it."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        counter = (name, frame.f_code.co_name) in COUNTER_FRAMES
        if counter or (name.startswith(TORCH_DIR) and not any(h in name for h in HOST_SIDE)):
            frame = frame.f_back  # the counter itself, or torch's wrappers between the caller and the op
            continue
        if any(h in name for h in HOST_SIDE):
            return None
        return f"{Path(name).parent.name}/{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
    return "torch, called from no Python code outside it"


class SyncCounter(TorchDispatchMode):
    """Record each call that would make the host wait for a CUDA device, with its call site, while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._patched: dict[str, object] = {}

    def _record(self, what: str) -> None:
        site = _call_site()
        if site is not None:
            self.calls.append(f"{what} at {site}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS:
            self._record(str(func))
        elif func in MASK_INDEXED_OPS:
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                self._record(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in ("tolist", "cpu"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                self._record(f"Tensor.{_name}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        return super().__exit__(*exc)


class StepWindows(pl.Callback):
    """Count syncs from each training batch's start to the next one's: the step, its logging, the next fetch."""

    def __init__(self) -> None:
        self.calls: dict[int, list[str]] = defaultdict(list)
        self._open: tuple[int, SyncCounter] | None = None

    def _close(self) -> None:
        if self._open is not None:
            step, counter = self._open
            counter.__exit__(None, None, None)
            self.calls[step] += counter.calls
            self._open = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close()
        counter = SyncCounter()
        counter.__enter__()
        self._open = (trainer.global_step, counter)

    def on_train_epoch_end(self, trainer, pl_module):
        self._close()

    def on_validation_start(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        self._close()


def _datamodule(pin_memory: bool = False, gather_device: str | None = None, **overrides) -> HSIDataModule:
    options = dict(scene="synthetic_tiny", patch_size=3, batch_size=8, eval_batch_size=64, train_fraction=0.3)
    return HSIDataModule(DataSettings(**{**options, **overrides}), pin_memory=pin_memory, gather_device=gather_device)


def _fit(tmp_path: Path, windows: pl.Callback, accelerator: str = "cpu", **data) -> None:
    torch.manual_seed(0)
    datamodule = _datamodule(**data)
    task = HSIClassifier(get_model("cnn1d", in_bands=32, num_classes=4, patch_size=3), num_classes=4, warmup_epochs=0)
    kwargs = trainer_kwargs(Plan(accelerator=accelerator, batch_size=8), progress=True)  # as `hslite fit` builds it
    callbacks = [TrainThroughput(), RankUsage(), RankActivity(tmp_path / "ranks"), *kwargs.pop("callbacks"), windows]
    trainer = pl.Trainer(
        **kwargs,
        callbacks=callbacks,
        max_epochs=2,
        limit_train_batches=7,
        limit_val_batches=2,
        log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(task, datamodule=datamodule)


def _logging(step: int) -> bool:
    """Whether Lightning writes the loggers after optimiser step `step` (0-based; its should_update_logs)."""
    return (step + 1) % LOG_EVERY == 0


def test_a_training_step_waits_only_when_it_logs(tmp_path):
    windows = StepWindows()
    _fit(tmp_path, windows)
    assert sorted(windows.calls) == list(range(14))  # 2 epochs of 7 steps, each seen
    waiting = {step: calls for step, calls in windows.calls.items() if calls and not _logging(step)}
    assert not waiting, f"non-logging steps wait for the device: {waiting}"
    for step in filter(_logging, range(14)):
        calls = windows.calls.get(step, [])
        # The logger turns the logged loss into a number: the one read a logging step makes.
        assert len(calls) == 1 and "apply_func.py" in calls[0], f"logging step {step}: {calls}"


def test_the_device_resident_gather_waits_for_nothing():
    module = _datamodule(gather_device="cpu", augment=True)
    module.setup("fit")
    loader = module.train_dataloader()
    batches = iter(loader)
    next(batches)  # the sampler draws the epoch's order
    with SyncCounter() as counter:
        for _ in range(3):
            next(batches)
    assert counter.calls == []


def test_the_counter_sees_what_would_wait():
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x[x > 2]
        x.sum().item()
        bool(x.any())
        torch.unique(x)
        x.tolist()
        weight = torch.zeros(2, requires_grad=True)
        weight.grad = torch.ones(2)
        torch.optim.AdamW([weight], foreach=True).step()  # reads its host-side step counter: not counted
    assert len(counter.calls) == 5 and all("test_host_syncs.py" in call for call in counter.calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("data", [{"pin_memory": True}, {"gather_device": "cuda", "augment": True}], ids=str)
def test_no_sync_on_cuda(tmp_path, data):
    class Strict(pl.Callback):
        """CUDA raises at any synchronising call made inside a non-logging step's window."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # Steady state only: the first batch of an epoch creates Lightning's logged-value states.
            first = batch_idx == 0
            torch.cuda.set_sync_debug_mode("default" if first or _logging(trainer.global_step) else "error")

        def on_train_epoch_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode("default")

        def on_validation_start(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode("default")

        def on_exception(self, trainer, pl_module, exception):
            torch.cuda.set_sync_debug_mode("default")

    try:
        _fit(tmp_path, Strict(), accelerator="gpu", **data)
    finally:
        torch.cuda.set_sync_debug_mode("default")
