"""The preprocessing a run fitted, saved in its folder so that `hslite predict` can apply it to any cube.

`preprocessing.npz` holds plain arrays only (written atomically, loaded with allow_pickle=False): the raw band count,
the kept band indices, the normaliser's offset and scale, the PCA mean and components, the centres of the bands the
model sees, the label codes, and `meta`, one JSON string with the patch size, class names and where the run's scene
came from.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hslite.atomic import atomic_write
from hslite.datasets.preprocess import BandNormalizer, PCAReducer, preprocess_block
from hslite.errors import DataError, unreadable

if TYPE_CHECKING:
    from hslite.datasets.datamodule import HSIDataModule

FORMAT = 1  # bump when the arrays or meta change meaning


@dataclass
class FittedPreprocessing:
    """Everything between a raw cube and the model's input, as fitted on a run's training pixels."""

    raw_bands: int  # bands of the cube as read, before removal
    kept_bands: np.ndarray  # 0-based indices of the bands kept, in the raw cube
    normaliser: BandNormalizer
    pca: PCAReducer | None
    patch_size: int
    class_names: list[str]
    label_codes: np.ndarray | None  # code in the label file of class 1..C; None: classes are written as 1..C
    input_wavelengths_nm: np.ndarray | None  # centres of the bands the model sees (None with PCA or no wavelengths)
    scene: dict[str, Any]  # how to load the run's scene again: {"kind": "registered" | "own", ...}

    @property
    def num_classes(self) -> int:
        """Number of classes C."""
        return len(self.class_names)

    @property
    def num_input_bands(self) -> int:
        """Bands the model sees: kept bands, or PCA components."""
        return self.pca.n_components if self.pca is not None else int(self.kept_bands.size)

    @classmethod
    def from_datamodule(cls, datamodule: HSIDataModule) -> FittedPreprocessing:
        """What a set-up datamodule fitted, with its scene's source made absolute."""
        scene = datamodule.scene
        if datamodule.own_scene is not None:
            source: dict[str, Any] = {"kind": "own", **asdict(datamodule.own_scene)}
        else:
            given = datamodule.settings.root
            root = None if given is None else str(Path(given).expanduser().resolve())
            source = {"kind": "registered", "name": scene.name, "root": root, "seed": datamodule.seed}
        return cls(
            raw_bands=scene.num_bands,
            kept_bands=np.asarray(datamodule.kept_bands, dtype=np.int64),
            normaliser=datamodule.normaliser,
            pca=datamodule.pca,
            patch_size=datamodule.settings.patch_size,
            class_names=list(datamodule.class_names),
            label_codes=None if scene.label_codes is None else np.asarray(scene.label_codes, dtype=np.int64),
            input_wavelengths_nm=datamodule.input_wavelengths_nm,
            scene=source,
        )

    def apply(self, cube: np.ndarray, first_row: int = 0) -> np.ndarray:
        """A raw (rows, cols, raw_bands) block -> the model's bands, float32, as the datamodule made them in fit.

        `first_row` is the block's first scene row, so that a NaN is reported where it is in the scene.
        """
        if cube.shape[-1] != self.raw_bands:
            raise DataError(f"The cube has {cube.shape[-1]} bands; this preprocessing was fitted on {self.raw_bands}.")
        return preprocess_block(cube, self.kept_bands, self.normaliser, self.pca, first_row)

    def save(self, path: Path) -> None:
        """Write preprocessing.npz atomically (see the module docstring for its contents)."""
        norm = self.normaliser.state_dict()
        meta = {
            "format": FORMAT,
            "normalisation": norm["method"],
            "patch_size": self.patch_size,
            "class_names": self.class_names,
            "scene": self.scene,
        }
        arrays: dict[str, Any] = {
            "meta": np.array(json.dumps(meta)),
            "raw_bands": np.array(self.raw_bands),
            "kept_bands": self.kept_bands,
            "norm_offset": np.asarray(norm["offset"], dtype=np.float64),
            "norm_scale": np.asarray(norm["scale"], dtype=np.float64),
        }
        if self.pca is not None:
            arrays.update(pca_mean=np.asarray(self.pca.mean), pca_components=np.asarray(self.pca.components))
        if self.label_codes is not None:
            arrays["label_codes"] = self.label_codes
        if self.input_wavelengths_nm is not None:
            arrays["input_wavelengths_nm"] = np.asarray(self.input_wavelengths_nm, dtype=np.float64)
        atomic_write(path, lambda f: np.savez(f, allow_pickle=False, **arrays))

    @classmethod
    def load(cls, path: Path) -> FittedPreprocessing:
        """Read what `save` wrote; a missing, corrupt or newer file raises a DataError saying so."""
        if not path.is_file():
            raise DataError(
                f"{path} does not exist: the run did not save its preprocessing (it stopped before training, or an "
                "older hslite trained it). Train it again with hslite fit."
            )
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {name: data[name] for name in data.files}
            meta = json.loads(str(arrays["meta"]))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            why, cause = unreadable(err)
            raise DataError(
                f"{path}: {why}; it is not the preprocessing.npz that hslite fit saves in a run folder: point run= at "
                "such a folder, or train the run again with hslite fit."
            ) from cause
        if meta.get("format") != FORMAT:
            raise DataError(f"{path} is preprocessing format {meta.get('format')}; this hslite reads {FORMAT}.")
        normaliser = BandNormalizer(meta["normalisation"])
        normaliser.load_state_dict(
            {"method": meta["normalisation"], "offset": arrays["norm_offset"], "scale": arrays["norm_scale"]}
        )
        pca = None
        if "pca_components" in arrays:
            pca = PCAReducer(arrays["pca_components"].shape[0])
            pca.load_state_dict(
                {"n_components": pca.n_components, "mean": arrays["pca_mean"], "components": arrays["pca_components"]}
            )
        return cls(
            raw_bands=int(arrays["raw_bands"]),
            kept_bands=arrays["kept_bands"],
            normaliser=normaliser,
            pca=pca,
            patch_size=int(meta["patch_size"]),
            class_names=list(meta["class_names"]),
            label_codes=arrays.get("label_codes"),
            input_wavelengths_nm=arrays.get("input_wavelengths_nm"),
            scene=meta["scene"],
        )
