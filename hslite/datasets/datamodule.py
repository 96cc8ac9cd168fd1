"""LightningDataModule for one scene.

prepare_data fetches files; setup builds the split, the normalisation fitted on training pixels only, and patch
datasets that gather whole batches in one indexing op (`loaders.py` makes their DataLoaders).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning
import numpy as np
from torch.utils.data import DataLoader

from hslite.datasets.batches.patches import PatchDataset, PatchGatherer, stores_bands_first
from hslite.datasets.input_plan import InputPlan, plan_input
from hslite.datasets.loaders import device_type, patch_loader
from hslite.datasets.preprocess import BandNormalizer, PCAReducer, kept_bands, preprocess_block
from hslite.datasets.scene_input import ScenePatches, SceneTiles, held_input, training_spectra
from hslite.datasets.scenes.fetch import ensure_file
from hslite.datasets.scenes.own_scene import own_scene_for
from hslite.datasets.scenes.registry import Scene, get_scene_spec, is_synthetic, load_scene, scene_folder
from hslite.datasets.settings import DataSettings
from hslite.datasets.splits import Split, audit_leakage, load_split_for, make_split
from hslite.errors import DataError
from hslite.ranges import range_problems


class HSIDataModule(lightning.LightningDataModule):
    """Patches of one scene for training, validation, test and a full-scene prediction pass.

    `settings` says which scene and how (`DataSettings`, each field explained there):

        HSIDataModule(DataSettings(scene="indian_pines", root="data", patch_size=9), seed=0)

    Band indices (`remove_bands`) count from 0 in the cube as distributed; `drop_water_bands` adds the scene's
    conventional water-absorption bands. Labels are zero-based (class - 1); prediction labels are -1 where unlabelled.
    `scene` is a registered name or the path of your own cube, whose label raster `labels` names (see `own_scene`).
    Where batches are made (`gather_device`, `pin_memory`, `num_workers`) is `loaders.py`'s subject.
    """

    def __init__(
        self,
        settings: DataSettings,
        seed: int = 0,  # the split's and the augmentation's (a recipe's train.seed)
        pin_memory: bool = False,  # page-locked host batches, for a CUDA device; False: pageable
        gather_device: str | None = None,  # "cuda"/"cuda:N": cube on the GPU, gathered there; None: on the host
    ):
        super().__init__()
        problems = range_problems(settings)
        if problems:
            raise DataError(f"HSIDataModule settings: {' '.join(problems)}")
        if gather_device is not None and device_type(gather_device) not in ("cpu", "cuda"):
            raise DataError(f"gather_device must be None, 'cpu' or 'cuda[:index]'; got {gather_device!r}.")
        if gather_device is not None and settings.num_workers:
            raise DataError(
                f"gather_device={gather_device!r} gathers in the training process, and num_workers="
                f"{settings.num_workers} asks for DataLoader workers (which cannot use CUDA): set num_workers=0, or "
                "gather_device=None."
            )
        self.settings = settings
        # fail on an unknown scene name or a missing file now, not in setup; None for a registered scene
        self.own_scene = own_scene_for(
            settings.scene, settings.labels, settings.wavelengths, list(settings.class_names), settings.ignore_label
        )
        # plain values, so a checkpoint holding them loads weights-only
        self.save_hyperparameters({**asdict(settings), "seed": seed})
        self.seed = seed
        self.pin_memory = pin_memory
        self.gather_device = gather_device
        self.with_validation = False  # train on validation pixels too (`train_on_validation_too`)
        self._where: dict[str, np.ndarray] = {}  # each set's patch coordinates in the gatherer's image
        self._datasets: dict[str, PatchDataset | ScenePatches | SceneTiles] = {}
        self._scene: Scene | None = None
        self._split: Split | None = None
        self._kept_bands: np.ndarray | None = None
        self._normaliser: BandNormalizer | None = None
        self._pca: PCAReducer | None = None
        self._wavelengths: np.ndarray | None = None
        self._num_bands = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the recipe, not the built data: a spawned rank re-runs setup() and rebuilds the same split.

        Shipping the padded cube to every spawned rank through shared memory failed here ("bad value(s) in
        fds_to_keep") and costs as much as re-reading it; setup() is deterministic in the seed (or the split file).
        """
        state = self.__dict__.copy()
        state.update(_datasets={}, _scene=None, _split=None, _kept_bands=None, _normaliser=None, _pca=None)
        state.update(_wavelengths=None, _num_bands=0, _where={}, _gatherer=None)
        return state

    def prepare_data(self) -> None:
        """Make sure the scene's files are present (downloading them when allowed); reads nothing."""
        d = self.settings
        if self.own_scene is not None or is_synthetic(d.scene):
            return
        spec = get_scene_spec(d.scene)
        folder = scene_folder(d.scene, d.root)
        for remote in (spec.cube_file, spec.gt_file):
            ensure_file(remote, folder, d.download)

    def setup(self, stage: str | None = None) -> None:
        """Load, clean, split, normalise (fitted on training pixels only), pad and wrap the scene; idempotent."""
        if self._datasets:
            return
        own, d = self.own_scene, self.settings
        scene = own.load() if own else load_scene(d.scene, d.root, download=d.download, seed=self.seed)
        water = get_scene_spec(d.scene).water_bands if d.drop_water_bands and own is None else ()
        remove = sorted(set(d.remove_bands) | set(water))
        wavelengths, kept = kept_bands(scene.num_bands, scene.wavelengths_nm, remove, d.remove_ranges_nm)
        split = self._load_or_make_split(scene.gt)
        # Fitted on the training pixels only; the cube is read block by block, never held whole (scene_input).
        train_pixels = training_spectra(scene.source, kept, split.train)
        self._normaliser = BandNormalizer(d.normalisation).fit(train_pixels)
        if d.pca_components:
            self._pca = PCAReducer(d.pca_components).fit(self._normaliser.transform(train_pixels))
        device, use_kernel = self.gather_device or "cpu", self.gather_device is None  # "cpu" takes the GPU's path
        normaliser, pca, num_bands = self._normaliser, self._pca, d.pca_components or int(kept.size)

        def transform(block: np.ndarray, first_row: int) -> np.ndarray:
            return preprocess_block(block, kept, normaliser, pca, first_row)

        sets = {"train": split.train, "val": split.val, "test": split.test}
        bands_first = d.on_disk or stores_bands_first(device, use_kernel=use_kernel)
        image, self._where = held_input(scene.source, transform, num_bands, d.patch_size, sets, d.on_disk,
                                        bands_first)  # fmt: skip
        gatherer = PatchGatherer(image, d.patch_size, device=device, use_kernel=use_kernel, pin_memory=self.pinning,
                                 bands_first=bands_first)  # fmt: skip
        for name, coords in sets.items():
            labels = scene.gt[coords[:, 0], coords[:, 1]] - 1
            train = d.augment and name == "train"
            self._datasets[name] = PatchDataset(gatherer, self._where[name], labels, train, self.seed)
        self._datasets["predict"] = (
            SceneTiles(scene.source, transform, d.patch_size, scene.gt, d.eval_batch_size)
            if d.on_disk
            else ScenePatches(gatherer, scene.gt, d.eval_batch_size)
        )
        self._scene, self._split, self._kept_bands, self._wavelengths = scene, split, kept, wavelengths
        self._gatherer = gatherer
        self._num_bands = gatherer.num_bands
        if self.with_validation:
            self.train_on_validation_too()

    def input_plan(self) -> InputPlan:
        """What setup() will hold of the scene (shape, bands in, patch), from the cube's header; reads no pixels."""
        d = self.settings
        return plan_input(self.own_scene, d.scene, d.remove_bands, d.remove_ranges_nm, d.drop_water_bands,
                          d.pca_components, d.patch_size, d.on_disk)  # fmt: skip

    def train_on_validation_too(self) -> None:
        """Train on the training and validation pixels (`train.refit`); normalisation and PCA stay as fitted.

        A setting too, not only a dataset: a spawned rank gets the recipe pickled and re-runs setup(), and trained on
        the training pixels alone until setup() honoured it.
        """
        self.with_validation = True
        coords = np.concatenate([self.split.train, self.split.val])
        labels = self.scene.gt[coords[:, 0], coords[:, 1]] - 1
        where = np.concatenate([self._where["train"], self._where["val"]])  # in the patch bank with data.on_disk
        self._datasets["train"] = PatchDataset(self._gatherer, where, labels, self.settings.augment, self.seed)

    def _load_or_make_split(self, gt: np.ndarray) -> Split:
        d = self.settings
        if d.split_file is None:
            return make_split(gt, d.split, patch_size=d.patch_size, seed=self.seed, train_fraction=d.train_fraction,
                              val_fraction=d.val_fraction, train_per_class=d.train_per_class,
                              val_per_class=d.val_per_class, block_size=d.block_size)  # fmt: skip
        return load_split_for(d.split_file, gt, d.patch_size, d.scene)

    def leakage_audit(self) -> dict[str, Any]:
        """`audit_leakage` of the split in use at this datamodule's patch size (metrics.json records it)."""
        scene, split = self._ready(self._scene), self._ready(self._split)
        return audit_leakage(split, scene.gt.shape, self.settings.patch_size)

    # ------------------------------------------------------------------------------------------------ loaders
    @property
    def pinning(self) -> bool:
        """Whether host batches are page-locked: `pin_memory`, unless the batches are gathered on a device."""
        return self.pin_memory and self.gather_device is None

    def _loader(self, name: str, batch_size: int, shuffle: bool) -> DataLoader:
        if not self._datasets:
            raise DataError("HSIDataModule.setup() must run before its dataloaders are requested.")
        return patch_loader(
            self._datasets[name], batch_size, shuffle, self.settings.num_workers, self.pinning, self.gather_device
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of `settings.batch_size`."""
        return self._loader("train", self.settings.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches of `settings.eval_batch_size`, in split order."""
        return self._loader("val", self.settings.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches of `settings.eval_batch_size`, in split order."""
        return self._loader("test", self.settings.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """Every pixel of the scene in row-major order; labels are class - 1, or -1 where unlabelled."""
        return self._loader("predict", self.settings.eval_batch_size, shuffle=False)

    # --------------------------------------------------------------------------------------------- properties
    def _ready(self, value: Any) -> Any:
        if value is None or not self._datasets:
            raise DataError("HSIDataModule.setup() must run before this property is read.")
        return value

    @property
    def scene(self) -> Scene:
        """The Scene as loaded (all bands, raw values); the model sees its kept, normalised bands."""
        return self._ready(self._scene)

    @property
    def split(self) -> Split:
        """The train/val/test split in use."""
        return self._ready(self._split)

    @property
    def num_bands(self) -> int:
        """Bands the model sees: after band removal and PCA."""
        self._ready(self._scene)
        return self._num_bands

    @property
    def num_classes(self) -> int:
        """Number of classes C (labels 0..C-1 in the datasets)."""
        return self.scene.num_classes

    @property
    def class_names(self) -> list[str]:
        """Class names, index i for label i."""
        return self.scene.class_names

    @property
    def kept_bands(self) -> np.ndarray:
        """0-based indices, in the cube as distributed, of the bands kept before PCA."""
        return self._ready(self._kept_bands)

    @property
    def wavelengths_nm(self) -> np.ndarray | None:
        """Centres of the kept bands in nm, or None when the scene has no wavelengths."""
        self._ready(self._scene)
        return self._wavelengths

    @property
    def input_wavelengths_nm(self) -> np.ndarray | None:
        """Centres of the bands the model sees, or None when they have none (no wavelengths, or PCA components)."""
        return None if self.settings.pca_components else self.wavelengths_nm

    @property
    def normaliser(self) -> BandNormalizer:
        """The BandNormalizer fitted on training pixels."""
        return self._ready(self._normaliser)

    @property
    def pca(self) -> PCAReducer | None:
        """The PCAReducer fitted on training pixels, or None when pca_components is 0."""
        self._ready(self._scene)
        return self._pca
