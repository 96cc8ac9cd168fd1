"""Model registry: a plain dict from name to class; ``get_model`` checks every argument before building."""

import difflib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from torch import nn

from hslite.errors import ModelError
from hslite.models.channel_vit import ChannelViT
from hslite.models.cnn1d import CNN1D
from hslite.models.cnn3d import CNN3D
from hslite.models.hybridsn import HybridSN
from hslite.models.spectralformer import SpectralFormer


class _ModelClass(Protocol):
    """What the registry needs of a model class: its description and its size presets.

    Two optional class attributes switch features on, declared by the model itself: `BAND_GROUPS = True` (it
    encodes band groups separately, so channel groups and rotation can split it) and `FSDP_UNITS` (the submodules
    FSDP gathers one at a time; `parallel.fsdp_policy`).
    """

    SUMMARY: str  # what the model is, a few words
    PAPER: str  # first author, year and title of the paper it follows
    SIZES: dict[str, dict[str, Any]]  # {"small": {...}, "large": {...}}: keyword hyper-parameters of each preset

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module: ...  # in_bands, num_classes, patch_size, **preset


_MODELS: dict[str, _ModelClass] = {
    "cnn1d": CNN1D,
    "cnn3d": CNN3D,
    "hybridsn": HybridSN,
    "spectralformer": SpectralFormer,
    "channel_vit": ChannelViT,
}


def list_models() -> list[str]:
    """Return the registered model names, in registry order."""
    return list(_MODELS)


def describe_models() -> dict[str, str]:
    """Return one line per model: what it is and the paper it follows."""
    return {name: f"{cls.SUMMARY} ({cls.PAPER})" for name, cls in _MODELS.items()}


def has_band_groups(name: str) -> bool:
    """Whether model ``name`` encodes band groups separately (``encode_group`` / ``aggregate`` / ``head``).

    That boundary is where channel groups split a model across ranks and channel-subset rotation leaves groups out.
    """
    return bool(getattr(_MODELS.get(name), "BAND_GROUPS", False))


def get_model(
    name: str,
    *,
    in_bands: int,
    num_classes: int,
    patch_size: int,
    size: str = "small",
    wavelengths_nm: Sequence[float] | np.ndarray | None = None,
    **kwargs: object,
) -> nn.Module:
    """Build model ``name`` at preset ``size`` for (n, in_bands, patch_size, patch_size) inputs.

    ``kwargs`` override single hyper-parameters of the preset (e.g. ``num_groups=8`` for channel_vit). Band-group
    models align their groups to spectral regions with ``wavelengths_nm`` (one per input band; None: equal groups).
    Raises ModelError for an unknown name, size or hyper-parameter, a wrongly typed value, or sizes that do not fit.
    """
    if name not in _MODELS:
        close = difflib.get_close_matches(str(name), _MODELS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ModelError(f"Unknown model {name!r}; valid models are {', '.join(_MODELS)}.{hint}")
    cls = _MODELS[name]
    if size not in cls.SIZES:
        raise ModelError(f"Unknown size {size!r} for model {name!r}; valid sizes are {', '.join(cls.SIZES)}.")
    hparams = dict(cls.SIZES[size])
    unknown = sorted(set(kwargs) - set(hparams))
    if unknown:
        raise ModelError(
            f"Unknown option(s) {', '.join(unknown)} for model {name!r}; valid options are {', '.join(hparams)}."
        )
    for key, value in kwargs.items():
        hparams[key] = _checked_value(name, key, value, hparams[key])
    _check_shape("in_bands", in_bands, minimum=1)
    _check_shape("num_classes", num_classes, minimum=2)
    _check_shape("patch_size", patch_size, minimum=1)
    if patch_size % 2 == 0:
        raise ModelError(
            f"patch_size must be odd so the patch has a centre pixel; got {patch_size}. Use {patch_size + 1}."
        )
    if getattr(cls, "BAND_GROUPS", False):
        hparams["wavelengths_nm"] = wavelengths_nm
    return cls(in_bands=in_bands, num_classes=num_classes, patch_size=patch_size, **hparams)


def _check_shape(label: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelError(f"{label} must be an integer of at least {minimum}; got {value!r}.")


def _checked_value(model: str, key: str, value: object, default: object) -> object:
    """Value of hyper-parameter ``key`` if it has the preset's type (ints pass for floats, lists for tuples)."""
    if isinstance(value, bool):
        pass
    elif isinstance(default, tuple) and isinstance(value, list | tuple):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    elif isinstance(default, float) and isinstance(value, int | float):
        return float(value)
    elif isinstance(default, int) and isinstance(value, int):
        return value
    raise ModelError(
        f"Option {key}={value!r} for model {model!r} has the wrong type; the preset value is {default!r}, "
        f"so pass a {type(default).__name__}."
    )
