"""Vectorised patch extraction: the padded cube lives once as a tensor and a batch is gathered in one call.

Layout: the models take contiguous (n, B, p, p) float32 patches, in which a patch row is only p floats.
- On the CPU the cube is stored band-major, (B, H+2r, W+2r), and the C kernel `_patchgather` copies each patch's
  B*p rows of p floats straight into the batch, prefetching the next sample's rows while it copies this one (they
  lie a band plane apart, which no hardware prefetcher follows). torch's index ops pay a fixed cost per row that
  is several times the copy of p floats.
- Without the kernel (a GPU, or an install without a C compiler) and for `channels_last=True`, the cube is stored
  pixel-major, (H+2r, W+2r, B), where a patch row is ONE run of p*B floats (p neighbouring spectra). Channels-last
  batches are those runs, one `index_select`. For contiguous batches, a chunk of a few samples is gathered into a
  staging buffer that stays in cache, transposed from (p*p, B) to (B, p*p) per sample by `torch.channel_shuffle`
  (fbgemm's SIMD transpose on the CPU) and copied into the batch. CHUNK_BYTES sets the chunk from the patch size,
  not from any cache: a few samples, whose staging plus the shuffle's output is 1 MiB.

`benchmarks/patches.py` prints what each path reaches (samples/s, fraction of this box's copy bandwidth) and the
torch path's speed against the kernel's; the torch path's gather, transpose and copy each take a share of its time.

Buffers: `gather(coords, out=...)` fills a caller's buffer; without `out` a batch comes from a BufferPool
(hslite/datasets/batches/batch_buffers.py), whose memory is reused only once no tensor references it, so a DataLoader
that holds several batches, or a model that keeps one, never sees it overwritten; with `pin_memory` it is
page-locked, for an asynchronous copy to a CUDA device.

Device-resident gather (`device="cuda"`): the cube, and a PatchDataset's coordinates and labels, live on the GPU and
a batch is gathered there, so no patch crosses the bus; only a batch's sample indices (and augmentation choices) go
up, asynchronously (`to_device`). They move to the device at the first gather, in the process that gathers: a
datamodule set up in a process that then spawns one rank per GPU holds no device copy, and "cuda" means the device
current there (Lightning sets each rank's before its setup). A gatherer that has gathered keeps its host cube and
pickles that, not the device copy: spawned, a CUDA tensor travels as a handle to the launcher's GPU, and every rank
would open it and gather there.
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from hslite.datasets.batches.augment import augment_batch
from hslite.datasets.batches.batch_buffers import BufferPool, to_device
from hslite.errors import DataError

_patchgather: ModuleType | None
try:
    from hslite.datasets.batches import _patchgather
except ImportError:  # installed without a C compiler: the slower torch path below (benchmarks/patches.py)
    _patchgather = None

CHUNK_BYTES = 512 * 1024  # bytes of patches per chunk (8 IP-sized ones); 256 KiB-1 MiB measured the same


def stores_bands_first(device: str | torch.device, channels_last: bool = False, use_kernel: bool = True) -> bool:
    """Whether a PatchGatherer with these options stores its cube band-major (the C kernel's layout)."""
    return use_kernel and torch.device(device).type == "cpu" and not channels_last and _patchgather is not None


class PatchGatherer:
    """Hold a padded (H+2r, W+2r, B) cube once as a tensor and gather p x p patches around (row, col) centres.

    Coordinates are those of the unpadded image: patch (row, col) covers padded rows row..row+p-1. Patches come
    back as contiguous (n, B, p, p) float32 tensors, or with `channels_last=True` as (n, B, p, p) tensors with NHWC
    strides (no transpose: one copy at memory speed, for a consumer that takes channels-last input), on `device`:
    the cube moves there at the first gather (see the module notes). `use_kernel=False` gathers with torch ops where
    the C kernel would apply (to compare the two, or to run a GPU's gather on the CPU). `pin_memory` page-locks the
    host batches, for a CUDA device (see batch_buffers.py). `bands_first`: `padded_cube` is (B, H+2r, W+2r); built
    in the layout `stores_bands_first` names, it is stored without a copy.
    """

    def __init__(
        self,
        padded_cube: torch.Tensor | np.ndarray,
        patch_size: int,
        device: str | torch.device = "cpu",
        channels_last: bool = False,
        use_kernel: bool = True,
        pin_memory: bool = False,
        bands_first: bool = False,
    ):
        cube = torch.as_tensor(padded_cube, dtype=torch.float32)
        if bands_first and cube.ndim == 3:  # (B, H+2r, W+2r): stored as is when the kernel gathers (no copy)
            cube = cube.permute(1, 2, 0)
        if cube.ndim != 3 or patch_size < 1 or patch_size % 2 == 0 or min(cube.shape[:2]) < patch_size:
            raise DataError(
                f"PatchGatherer needs a padded (rows, cols, bands) cube and an odd patch_size no larger than it; got "
                f"shape {tuple(cube.shape)} and patch_size {patch_size}."
            )
        self.patch_size = int(patch_size)
        self.channels_last = bool(channels_last)
        self.padded_rows, self.padded_cols, self.num_bands = (int(s) for s in cube.shape)
        self.rows = self.padded_rows - self.patch_size + 1
        self.cols = self.padded_cols - self.patch_size + 1
        self.device = torch.device(device)  # as asked: "cuda" is the device current where the cube is placed
        kernel = _patchgather if stores_bands_first(device, channels_last, use_kernel) else None
        self._kernel = kernel.gather if kernel is not None else None
        if self._kernel is not None:
            self.storage = cube.permute(2, 0, 1).contiguous()  # band-major: the kernel copies rows of p floats
        else:
            self.storage = cube.contiguous().reshape(-1)  # pixel-major: spectrum after spectrum; on `device` by place()
        self.row_offsets = torch.arange(self.patch_size) * self.padded_cols
        # Off the CPU a chunk costs kernel launches, not cache misses: take the batch whole there.
        self.samples_per_chunk = max(1, CHUNK_BYTES // self.nbytes_per_patch) if self.device.type == "cpu" else None
        self._runs_view: torch.Tensor | None = None
        self._buffers = BufferPool(pin_memory=pin_memory)
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # cube and row offsets, once placed off the host

    def place(self) -> torch.device:
        """Move the cube to this gatherer's device if it is not there yet; return the device, index resolved.

        The host cube is kept, for pickling (module notes): host memory the fit's check counts anyway (`peak_bytes`).
        """
        if self._host is None and self.storage.device != self.device:
            self._host = (self.storage, self.row_offsets)
            self.storage, self.row_offsets = self.storage.to(self.device), self.row_offsets.to(self.device)
            self._runs_view = None
        return self.storage.device

    def _runs(self) -> torch.Tensor:
        # Built lazily (and dropped when pickled): row a is the p*B floats of pixels a..a+p-1, an overlapping view.
        if self._runs_view is None:
            run = self.patch_size * self.num_bands
            rows = self.storage.numel() // self.num_bands - self.patch_size + 1
            self._runs_view = self.storage.as_strided((rows, run), (self.num_bands, 1))
        return self._runs_view

    def new_batch(self, n: int) -> torch.Tensor:
        """An uninitialised (n, B, p, p) batch in this gatherer's layout and memory (page-locked with `pin_memory`).

        What `gather` fills, and what an augmented batch is written to, so that it too reaches the GPU in one copy.
        """
        b, p = self.num_bands, self.patch_size
        if self.device.type != "cpu":
            layout = torch.channels_last if self.channels_last else torch.contiguous_format
            return torch.empty((n, b, p, p), dtype=torch.float32, device=self.place(), memory_format=layout)
        if self.channels_last:
            return self._buffers.empty((n, p, p, b)).permute(0, 3, 1, 2)
        return self._buffers.empty((n, b, p, p))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_runs_view"] = None
        if self._host is not None:  # placed: the host cube travels, and the unpickled gatherer places it anew
            state["storage"], state["row_offsets"] = self._host
            state["_host"] = None
        return state

    @property
    def native(self) -> bool:
        """Whether the C kernel gathers (CPU, contiguous layout, built at install)."""
        return self._kernel is not None

    @property
    def nbytes_per_patch(self) -> int:
        """Bytes of one gathered (B, p, p) float32 patch."""
        return 4 * self.num_bands * self.patch_size**2

    def gather(self, coords: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the (n, B, p, p) float32 patches centred on `coords` (n, 2) long (row, col), in `out` if given.

        `out` must be a float32 tensor of that shape on this device, contiguous in the gatherer's layout. Coordinates
        may be on any device (they are moved with `to_device`) and are not range-checked here (PatchDataset checks
        them once); out-of-range ones raise or wrap.
        """
        coords = to_device(coords.long(), self.place())
        n, b, p = coords.shape[0], self.num_bands, self.patch_size
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        if out is None:
            out = self.new_batch(n)
        elif (
            tuple(out.shape) != (n, b, p, p)
            or out.dtype != torch.float32
            or out.device != self.storage.device
            or not out.is_contiguous(memory_format=layout)
        ):
            raise DataError(
                f"out must be a float32 tensor of shape {(n, b, p, p)} on {self.storage.device}, {layout} "
                f"contiguous; got {out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}."
            )
        if n == 0:
            return out
        if self._kernel is not None:
            self._kernel(self.storage.numpy(), coords.contiguous().numpy(), out.numpy(), p)
            return out
        # First pixel of each of a patch's p rows, patch after patch: (n*p,) indices into the runs view.
        starts = (coords[:, :1] * self.padded_cols + coords[:, 1:] + self.row_offsets).reshape(-1)
        if self.channels_last or p == 1 or b == 1:  # the runs are the batch ((p*p, B) is (B, p*p) if p or B is 1)
            torch.index_select(self._runs(), 0, starts, out=out.permute(0, 2, 3, 1).view(n * p, p * b))
            return out
        size, chunk = b * p * p, min(n, self.samples_per_chunk or n)
        staging = torch.empty((chunk * p, p * b), dtype=torch.float32, device=self.storage.device)  # reused per chunk
        pixels = staging.as_strided((chunk, size, 1, 1), (size, 1, size, size))  # one channels-last pixel per sample
        for rows, patches in zip(starts.split(chunk * p), out.view(n, size, 1, 1).split(chunk), strict=True):
            count = patches.shape[0]  # the last chunk may be short
            torch.index_select(self._runs(), 0, rows, out=staging if count == chunk else staging[: count * p])
            # channel m*B + band -> band*p*p + m, i.e. (p*p, B) -> (B, p*p) per sample; fbgemm's SIMD transpose on CPU
            patches.copy_(torch.channel_shuffle(pixels if count == chunk else pixels[:count], p * p))
        return out


class PatchDataset(Dataset):
    """Patches around labelled pixels; `__getitems__` returns a whole batch from one gather.

    Labels are zero-based (class - 1), or -1 for unlabelled pixels in prediction sets. Use with
    `DataLoader(..., collate_fn=collate_patches)`. Batches are on the gatherer's device: with a device-resident
    gatherer the coordinates and labels move there with the cube, and only each batch's indices cross the bus.
    """

    def __init__(
        self,
        gatherer: PatchGatherer,
        coords: np.ndarray | torch.Tensor,
        labels: np.ndarray | torch.Tensor,
        augment: bool = False,
        seed: int = 0,
    ):
        self.gatherer = gatherer
        self.coords = torch.as_tensor(np.asarray(coords), dtype=torch.long).reshape(-1, 2)
        self.labels = torch.as_tensor(np.asarray(labels), dtype=torch.long).reshape(-1)
        if self.coords.shape[0] != self.labels.shape[0]:
            raise DataError(f"{self.coords.shape[0]} coordinates but {self.labels.shape[0]} labels; they must pair up.")
        if self.coords.numel() and (
            self.coords.min() < 0
            or self.coords[:, 0].max() >= gatherer.rows
            or self.coords[:, 1].max() >= gatherer.cols
        ):
            raise DataError(f"Patch coordinates fall outside the {gatherer.rows}x{gatherer.cols} image.")
        self.augment = augment
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._generator_worker: int | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the batch (x (n, B, p, p) float32, y (n,) int64) for these sample indices."""
        device = self.gatherer.place()
        if self.coords.device != device:
            self.coords, self.labels = self.coords.to(device), self.labels.to(device)
        index = to_device(torch.as_tensor(indices, dtype=torch.long), device)
        x = self.gatherer.gather(self.coords[index])
        if self.augment:
            x = augment_batch(x, self._augment_generator(), out=self.gatherer.new_batch(len(indices)))
        return x, self.labels[index]

    @property
    def augmentation_generator(self) -> torch.Generator:
        """The generator of this process's flips; checkpoints save its state so a resumed run flips alike."""
        return self._generator

    def with_own_augmentation(self, seed: int) -> PatchDataset:
        """A shallow copy with its own augmentation generator: drawing from it leaves this dataset's flips unchanged."""
        twin = copy.copy(self)
        twin._generator = torch.Generator().manual_seed(seed)
        twin._generator_worker = None
        return twin

    def _augment_generator(self) -> torch.Generator:
        # Each worker is a copy of this dataset: reseed from the worker's own seed (new every epoch, derived from the
        # main process RNG) so workers and epochs do not repeat each other's flips.
        info = get_worker_info()
        if info is not None and self._generator_worker != info.seed:
            self._generator.manual_seed(info.seed)
            self._generator_worker = info.seed
        return self._generator


def collate_patches(batch: Any) -> Any:
    """Pass through the (x, y) batch that `PatchDataset.__getitems__` already built (module-level so it pickles)."""
    return batch
