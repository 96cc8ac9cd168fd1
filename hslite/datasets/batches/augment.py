"""Training-time augmentation of patch batches: the 8 flips and rotations of the square, one gather per batch."""

from __future__ import annotations

import torch

from hslite.datasets.batches.batch_buffers import to_device


def _dihedral_permutations(patch_size: int, device: torch.device) -> torch.Tensor:
    grid = torch.arange(patch_size * patch_size, device=device).view(patch_size, patch_size)
    turns = [torch.rot90(grid, k, (0, 1)) for k in range(4)]
    return torch.stack([t.reshape(-1) for t in turns + [t.flip(1) for t in turns]])  # (8, p*p)


def augment_batch(x: torch.Tensor, generator: torch.Generator, out: torch.Tensor | None = None) -> torch.Tensor:
    """Apply to each sample one of the 8 flips/rotations of the square (chosen by `generator`), in one gather.

    Keeps the shape (n, B, p, p) and the memory layout (contiguous or channels-last) of `x`. Written into `out` if
    given (a batch like `x`, e.g. `PatchGatherer.new_batch`): a page-locked one then goes to the GPU as it is, where
    a fresh result would be copied into page-locked memory again by the DataLoader.
    """
    n, bands, p, _ = x.shape
    choice = to_device(torch.randint(0, 8, (n,), generator=generator, device=generator.device), x.device)
    permutation = _dihedral_permutations(p, x.device)[choice]  # (n, p*p): output pixel m reads input pixel perm[m]
    if x.is_contiguous():
        flat = x.reshape(n, bands, p * p)
        into = None if out is None else out.view(n, bands, p * p)
        return torch.gather(flat, 2, permutation[:, None, :].expand(n, bands, p * p), out=into).view(n, bands, p, p)
    flat = x.permute(0, 2, 3, 1).reshape(n, p * p, bands)
    into = None if out is None else out.permute(0, 2, 3, 1).view(n, p * p, bands)
    pixels = torch.gather(flat, 1, permutation[:, :, None].expand(n, p * p, bands), out=into)
    return pixels.view(n, p, p, bands).permute(0, 3, 1, 2)
