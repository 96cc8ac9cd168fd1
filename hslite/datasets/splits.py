"""Train/val/test splits of the labelled pixels: stratified, fixed count per class, or spatially disjoint blocks.

A `Split` holds the (row, col) coordinates of each subset, the patch size and the options it was drawn with, and
saves to, and loads from, an .npz file. `audit_leakage` says how far a split's test patches are from its training
patches: random pixel splits put most test patches over training pixels, which inflates their accuracy.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hslite.datasets.preprocess import patch_radius
from hslite.errors import DataError, unreadable

SPLIT_KINDS = ("stratified", "count", "disjoint")
DEFAULT_BLOCKS_PER_PATCH = 4  # split=disjoint with block_size=0: blocks of 4 × patch_size pixels a side


@dataclass
class Split:
    """Train/val/test (row, col) coordinates of labelled pixels, as (k, 2) int64 arrays, and how they were drawn.

    `patch_size` is the patch the split was drawn for (None: a file saved before it was recorded); `options` the
    protocol's parameters (fractions or counts per class, block size).
    """

    kind: str
    seed: int
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    patch_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def protocol(self) -> dict[str, Any]:
        """What metrics.json says of the split: kind, seed, patch size, options and the subsets' sizes."""
        sizes = {name: len(getattr(self, name)) for name in ("train", "val", "test")}
        return {"kind": self.kind, "seed": self.seed, "patch_size": self.patch_size, **self.options, "pixels": sizes}

    def same_pixels(self, other: Split) -> bool:
        """True when both put the same pixels, in the same order, in train, val and test."""
        return all(np.array_equal(getattr(self, k), getattr(other, k)) for k in ("train", "val", "test"))

    def save(self, path: str | Path) -> None:
        """Save as .npz (kind, seed, train, val, test, patch size, options as JSON)."""
        np.savez(Path(path), kind=np.array(self.kind), seed=np.array(self.seed), train=self.train, val=self.val,
                 test=self.test, patch_size=np.array(-1 if self.patch_size is None else self.patch_size),
                 options=np.array(json.dumps(self.options)))  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> Split:
        """Load a split written by `save` (files from before the patch size was recorded load with None)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                fields = {key: data[key] for key in ("kind", "seed", "train", "val", "test")}
                patch = int(data["patch_size"]) if "patch_size" in data else -1
                options = json.loads(str(data["options"])) if "options" in data else {}
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            why, cause = unreadable(err)
            fix = "point data.split_file at a run's split.npz or remove the key"
            raise DataError(f"{path}: {why}; it is not a split file written by Split.save: {fix}.") from cause
        subsets = {key: np.asarray(fields[key], dtype=np.int64).reshape(-1, 2) for key in ("train", "val", "test")}
        return cls(str(fields["kind"]), int(fields["seed"]), **subsets, patch_size=None if patch < 0 else patch,
                   options=options)  # fmt: skip

    def counts(self, gt: np.ndarray) -> dict[str, dict[int, int]]:
        """Pixels per class (1..C, C = gt.max()) in each subset: {"train": {1: n, ...}, "val": ..., "test": ...}."""
        num_classes = int(gt.max())
        return {
            name: dict(enumerate(np.bincount(gt[c[:, 0], c[:, 1]], minlength=num_classes + 1)[1:].tolist(), 1))
            for name, c in (("train", self.train), ("val", self.val), ("test", self.test))
        }


def make_split(
    gt: np.ndarray,
    kind: str,
    *,
    train_fraction: float = 0.1,
    val_fraction: float = 0.1,
    train_per_class: int = 0,
    val_per_class: int = 0,
    block_size: int = 0,
    patch_size: int = 1,
    seed: int = 0,
) -> Split:
    """Split the labelled pixels of `gt` into train/val/test.

    "stratified": per-class fractions (scikit-learn). "count": `train_per_class` and `val_per_class` pixels of each
    class, the rest test. "disjoint": square blocks of `block_size` pixels (0: 4 × patch_size) go whole to one subset
    (balanced per class), then val/test pixels closer than 2*(patch_size//2) to a training pixel are dropped, so no
    training patch overlaps a val/test patch.
    """
    if kind not in SPLIT_KINDS:
        raise DataError(f"Unknown split {kind!r}; choose one of {', '.join(SPLIT_KINDS)}.")
    coords = np.argwhere(gt > 0).astype(np.int64)
    labels = gt[gt > 0]
    if coords.size == 0:
        raise DataError("The ground truth has no labelled pixels (all 0), so it cannot be split.")
    rng = np.random.default_rng(seed)
    options: dict[str, Any]
    if kind == "count":
        options = {"train_per_class": train_per_class, "val_per_class": val_per_class}
        parts = _count_split(labels, train_per_class, val_per_class, rng)
    else:
        _check_fractions(labels, train_fraction, val_fraction)
        options = {"train_fraction": train_fraction, "val_fraction": val_fraction}
        if kind == "stratified":
            parts = _stratified_split(labels, train_fraction, val_fraction, seed)
        else:
            options["block_size"] = block_size or DEFAULT_BLOCKS_PER_PATCH * patch_size
            parts = _block_split(gt.shape, coords, labels, train_fraction, val_fraction, options["block_size"], rng)
    _check_every_class_trains(labels, parts[0], kind)
    train, val, test = (coords[np.sort(p)] for p in parts)
    if kind == "disjoint":
        val, test = (_drop_near(subset, train, gt.shape, patch_size) for subset in (val, test))
        chosen = "data.block_size" if block_size else f"the default, 4 × patch_size {patch_size}"
        _check_blocks_leave_a_test(gt.shape, (train, val, test), labels.size, options, chosen)
    return Split(kind, int(seed), train, val, test, patch_size=patch_size, options=options)


def audit_leakage(split: Split, shape: tuple[int, int], patch_size: int) -> dict[str, Any]:
    """How close the test patches are to the training patches at `patch_size`.

    `min_centre_distance`: the smallest Euclidean distance, in pixels, from a test pixel to a training pixel;
    `overlapping_test_patches`: test patches that share a pixel with a training patch (centres within 2·r in
    Chebyshev distance, r = patch_size // 2); both 0-overlap and a large distance mean an honest test.
    """
    from scipy.ndimage import distance_transform_edt

    test = split.test
    if test.size == 0 or split.train.size == 0:
        return {"patch_size": patch_size, "test_patches": len(test), "min_centre_distance": None,
                "overlapping_test_patches": 0}  # fmt: skip
    not_train = np.ones(shape, dtype=bool)
    not_train[split.train[:, 0], split.train[:, 1]] = False
    distance = distance_transform_edt(not_train)[test[:, 0], test[:, 1]]
    near = _near_train(split.train, shape, patch_size)
    overlapping = int(near[test[:, 0], test[:, 1]].sum()) if near is not None else 0
    return {"patch_size": patch_size, "test_patches": len(test), "min_centre_distance": float(distance.min()),
            "overlapping_test_patches": overlapping}  # fmt: skip


def _check_fractions(labels: np.ndarray, train_fraction: float, val_fraction: float) -> None:
    if not (0 < train_fraction < 1 and 0 <= val_fraction < 1 and train_fraction + val_fraction < 1):
        raise DataError(
            f"train_fraction={train_fraction} and val_fraction={val_fraction} must satisfy 0 < train, 0 <= val and "
            "train + val < 1 (the rest is test)."
        )
    classes, counts = np.unique(labels, return_counts=True)
    for cls, count in zip(classes, counts, strict=True):
        if train_fraction * count < 1:
            raise DataError(
                f"train_fraction={train_fraction} leaves class {cls} ({count} pixels) with no training pixel; "
                f"use train_fraction >= {1 / count:.3g} or a count split (split=count, train_per_class=...)."
            )


def _stratified_split(labels: np.ndarray, train_fraction: float, val_fraction: float, seed: int) -> tuple:
    from sklearn.model_selection import train_test_split

    index = np.arange(labels.size)
    try:
        train, rest = train_test_split(index, train_size=train_fraction, stratify=labels, random_state=seed)
        if val_fraction == 0:
            return train, rest[:0], rest
        val, test = train_test_split(
            rest, train_size=val_fraction / (1 - train_fraction), stratify=labels[rest], random_state=seed
        )
    except ValueError as err:
        raise DataError(f"A stratified split is impossible with these fractions: {err}. Try split=count.") from err
    return train, val, test


def _count_split(labels: np.ndarray, train_per_class: int, val_per_class: int, rng: np.random.Generator) -> tuple:
    if train_per_class < 1 or val_per_class < 0:
        raise DataError(
            f"split=count needs train_per_class >= 1 and val_per_class >= 0; got {train_per_class}, {val_per_class}."
        )
    parts: tuple[list, list, list] = ([], [], [])
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        if members.size <= train_per_class + val_per_class:
            raise DataError(
                f"Class {cls} has {members.size} pixels, too few for train_per_class={train_per_class} + "
                f"val_per_class={val_per_class} with any left to test; lower the counts."
            )
        for part, chunk in zip(
            parts, np.split(members, [train_per_class, train_per_class + val_per_class]), strict=True
        ):
            part.append(chunk)
    return tuple(np.concatenate(part) for part in parts)


def _block_split(shape, coords, labels, train_fraction, val_fraction, block_size, rng) -> tuple:
    if block_size < 1:
        raise DataError(f"split=disjoint needs block_size >= 1 (pixels per block side); got {block_size}.")
    blocks_per_row = -(-shape[1] // block_size)
    block_of_pixel = (coords[:, 0] // block_size) * blocks_per_row + coords[:, 1] // block_size
    blocks, inverse = np.unique(block_of_pixel, return_inverse=True)
    histogram = np.zeros((blocks.size, int(labels.max()) + 1))
    np.add.at(histogram, (inverse, labels), 1)
    fractions = np.array([train_fraction, val_fraction, 1 - train_fraction - val_fraction])
    targets = fractions[:, None] * histogram.sum(axis=0)[None, :]
    assigned = np.zeros_like(targets)
    subset_of_block = np.full(blocks.size, -1, dtype=np.int64)
    order = rng.permutation(blocks.size)
    # First, rarest class first, one block of each class still missing from train goes to train, then one to test
    # (when the class has another block), so a few-block class is not lost to one subset.
    for subset in (0, 2):
        for cls in np.argsort(histogram.sum(axis=0), kind="stable"):
            holders = [b for b in order if histogram[b, cls] > 0 and subset_of_block[b] < 0]
            if cls > 0 and holders and not (subset_of_block[histogram[:, cls] > 0] == subset).any():
                subset_of_block[holders[0]] = subset
                assigned[subset] += histogram[holders[0]]
    # Then greedily: each remaining block, in random order, goes to the subset whose per-class quota it fills most.
    for block in order[subset_of_block[order] < 0]:
        need = np.clip((targets - assigned) / np.maximum(targets, 1e-9), 0, 1) @ histogram[block]
        subset = int(np.argmax(need)) if need.max() > 0 else 2
        subset_of_block[block] = subset
        assigned[subset] += histogram[block]
    subset_of_pixel = subset_of_block[inverse]
    return tuple(np.flatnonzero(subset_of_pixel == s) for s in range(3))


def _check_blocks_leave_a_test(shape, parts, labelled: int, options: dict[str, Any], chosen: str) -> None:
    """Refuse blocks so few that holding every class in training leaves most pixels there, or none to validate/test."""
    train, val, test = (len(p) for p in parts)
    train_fraction, val_fraction, block_size = options["train_fraction"], options["val_fraction"], options["block_size"]
    most_train = train_fraction + (1 - train_fraction - val_fraction) / 2  # half of what should have been test
    if train / labelled <= most_train and test and (val or not val_fraction):
        return
    blocks = -(-shape[0] // block_size) * -(-shape[1] // block_size)
    suggestion = max(1, int(np.sqrt(shape[0] * shape[1] / 50)))  # some 50 blocks on the scene
    raise DataError(
        f"split=disjoint with blocks of {block_size} pixels ({chosen}) leaves {blocks} blocks on a "
        f"{shape[0]}×{shape[1]} scene: holding every class in training put {train / labelled:.0%} of the labelled "
        f"pixels there (train_fraction={train_fraction}), {val} in validation and {test} in test. Set a smaller "
        f"data.block_size, e.g. {suggestion} (some 50 blocks)."
    )


def _check_every_class_trains(labels: np.ndarray, train: np.ndarray, kind: str) -> None:
    classes, counts = np.unique(labels, return_counts=True)
    trained = set(np.unique(labels[train]).tolist())
    for cls, count in zip(classes.tolist(), counts.tolist(), strict=True):
        if cls not in trained:
            hint = "use a smaller block_size or another seed" if kind == "disjoint" else "raise train_fraction"
            raise DataError(f"The {kind} split left class {cls} ({count} pixels) with no training pixel; {hint}.")


def _drop_near(subset: np.ndarray, train: np.ndarray, shape: tuple[int, int], patch_size: int) -> np.ndarray:
    near_train = _near_train(train, shape, patch_size)
    if near_train is None or subset.size == 0:
        return subset
    return subset[~near_train[subset[:, 0], subset[:, 1]]]


def _near_train(train: np.ndarray, shape: tuple[int, int], patch_size: int) -> np.ndarray | None:
    """Pixels whose patch overlaps a training pixel's patch; None for 1×1 patches, which overlap nothing."""
    radius = patch_radius(patch_size)
    if radius == 0:
        return None
    from scipy.ndimage import binary_dilation

    train_mask = np.zeros(shape, dtype=bool)
    train_mask[train[:, 0], train[:, 1]] = True
    # Two p x p windows overlap when their centres are within 2r (Chebyshev), so dilate by 2r.
    return binary_dilation(train_mask, structure=np.ones((4 * radius + 1, 4 * radius + 1), dtype=bool))


def load_split_for(path: str | Path, gt: np.ndarray, patch_size: int, scene_name: str) -> Split:
    """A saved split, checked against the scene it is used on: its pixels labelled there, no leak at this patch size."""
    if not Path(path).is_file():
        raise DataError(f"split_file {path} does not exist; save one with Split.save or drop the option.")
    split = Split.load(path)
    for name, coords in (("train", split.train), ("val", split.val), ("test", split.test)):
        inside = (coords >= 0).all() and (coords[:, 0] < gt.shape[0]).all() and (coords[:, 1] < gt.shape[1]).all()
        if not inside or (coords.size and (gt[coords[:, 0], coords[:, 1]] == 0).any()):
            raise DataError(
                f"{path}: its {name} set has pixels outside the {gt.shape} scene or unlabelled; it was made for "
                f"another scene than {scene_name}."
            )
    overlapping = audit_leakage(split, gt.shape, patch_size)["overlapping_test_patches"]
    if split.kind == "disjoint" and overlapping:
        drawn = "an unrecorded patch size" if split.patch_size is None else f"patch_size={split.patch_size}"
        raise DataError(
            f"{path} is a spatially disjoint split drawn for {drawn}; at data.patch_size={patch_size} {overlapping} "
            f"of its {len(split.test)} test patches overlap a training patch, so the test would see training pixels. "
            f"Drop data.split_file to draw a new split for this patch, or use data.patch_size={split.patch_size or 1}."
        )
    return split
