"""Model registry: shipped models, installed packages' (entry-point group ``hslite.models``) and ``register``-ed ones.

``get_model`` checks every argument before building. A recipe names registered models only, never an import path,
so recipe files hold no code.
"""

import difflib
import hashlib
import re
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from hslite.errors import ModelError
from hslite.models.channel_vit import ChannelViT
from hslite.models.cnn1d import CNN1D
from hslite.models.cnn3d import CNN3D
from hslite.models.hybridsn import HybridSN
from hslite.models.spectralformer import SpectralFormer
from hslite.models.ssftt import SSFTT

ENTRY_POINT_GROUP = "hslite.models"  # an installed package's models: `[project.entry-points."hslite.models"]`


class ModelClass(Protocol):
    """What a registered model class is: described, sized by presets, and built for one scene's input.

    ``cls(in_bands=B, num_classes=K, patch_size=p, **SIZES[size])`` returns an ``nn.Module`` that maps patches
    (n, B, p, p) to logits (n, K); ``p`` is odd (the centre pixel is the one classified). Two optional class
    attributes switch features on, declared by the model itself: ``BAND_GROUPS = True`` (the model encodes
    contiguous band groups separately, exposing ``band_groups``, ``encode_group``, ``encode_groups``,
    ``aggregate``, ``head`` and ``group_parameters`` as ``ChannelViT`` does, and takes ``num_groups`` and
    ``wavelengths_nm``; channel groups and rotation split it there) and ``FSDP_UNITS`` (names of the submodules
    FSDP gathers one at a time; ``parallel.fsdp_policy``).
    """

    SUMMARY: str  # what the model is, a few words
    PAPER: str  # first author, year and title of the paper it follows ("" for a team's own model)
    SIZES: dict[str, dict[str, Any]]  # {"small": {...}, "large": {...}}: keyword hyper-parameters of each preset

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module:
        """in_bands=, num_classes=, patch_size= and one preset's keywords -> the model."""


BAND_GROUP_METHODS = ("encode_group", "encode_groups", "aggregate", "head", "group_parameters")
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")

_BUILTIN: dict[str, ModelClass] = {
    "cnn1d": CNN1D,
    "cnn3d": CNN3D,
    "hybridsn": HybridSN,
    "spectralformer": SpectralFormer,
    "channel_vit": ChannelViT,
    "ssftt": SSFTT,
}
_registered: dict[str, ModelClass] = {}  # register()
_plugins: dict[str, tuple[ModelClass, str]] | None = None  # name -> (class, distribution), loaded on first use
_plugin_errors: dict[str, str] = {}  # name -> the sentence that says what to change


def register(name: str, cls: ModelClass | None = None, *, replace: bool = False) -> Any:
    """Register model class ``cls`` under ``name``, so recipes and ``model.name=`` can use it in this process.

    ``register("mynet", MyNet)``, or ``@register("mynet")`` above the class. Raises ModelError if ``cls`` does not
    follow the model protocol (``ModelClass``), or if ``name`` is taken (a shipped model is never replaced; another
    registration is with ``replace=True``). Returns ``cls``. An installed package registers its models for every
    process through the ``hslite.models`` entry-point group instead (README, "Your own model").
    """
    if cls is None:
        return lambda target: register(name, target, replace=replace)
    _check_name(name)
    check_model_class(name, cls)
    if name in _BUILTIN:
        raise ModelError(f"Model name {name!r} is a shipped model's; register yours under another name.")
    if name in _registered and _registered[name] is not cls and not replace:
        taken = getattr(_registered[name], "__qualname__", _registered[name])
        raise ModelError(
            f"Model name {name!r} is already registered to {taken}; pick another name or pass replace=True."
        )
    _registered[name] = cls
    return cls


def check_model_class(name: str, cls: object) -> None:
    """Raise ModelError naming what to change unless ``cls`` follows the model protocol (``ModelClass``)."""
    where = f"Model {name!r} ({getattr(cls, '__qualname__', type(cls).__name__)})"
    if isinstance(cls, nn.Module) or not callable(cls):
        seen = f"an instance of {type(cls).__name__}" if isinstance(cls, nn.Module) else type(cls).__name__
        raise ModelError(f"{where} must be a class (or factory) that builds an nn.Module; got {seen}.")
    summary, paper, sizes = (getattr(cls, key, None) for key in ("SUMMARY", "PAPER", "SIZES"))
    if not isinstance(summary, str) or not summary.strip():
        raise ModelError(f'{where} needs SUMMARY = "what it is, in a few words" as a class attribute.')
    if not isinstance(paper, str):
        raise ModelError(f'{where} needs PAPER = "author year, title" (or "" for your own design).')
    if not isinstance(sizes, dict) or not sizes:
        raise ModelError(
            f'{where} needs SIZES = {{"small": {{...}}}}: at least one size preset, each a dict of its keyword '
            "hyper-parameters (an empty dict for none)."
        )
    for size, preset in sizes.items():
        if not isinstance(size, str) or not isinstance(preset, dict) or not all(isinstance(k, str) for k in preset):
            raise ModelError(
                f"{where}: SIZES[{size!r}] must be a dict from hyper-parameter name to value; got {preset!r}."
            )
    if getattr(cls, "BAND_GROUPS", False):
        missing = [method for method in BAND_GROUP_METHODS if not callable(getattr(cls, method, None))]
        if missing:
            raise ModelError(
                f"{where} declares BAND_GROUPS = True but has no {', '.join(missing)}: implement them (see "
                "hslite.models.ChannelViT) or drop BAND_GROUPS."
            )
    units = getattr(cls, "FSDP_UNITS", ())
    if not isinstance(units, tuple | list) or not all(isinstance(unit, str) for unit in units):
        raise ModelError(f"{where}: FSDP_UNITS must be a tuple of submodule names; got {units!r}.")


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ModelError(
            f"Model name {name!r} must be lower-case letters, digits and underscores, starting with a letter "
            "(recipes and model.name= use it)."
        )


def _load_plugins() -> dict[str, tuple[ModelClass, str]]:
    """The entry points of group ``hslite.models``, loaded once; each failure is kept as its own sentence."""
    global _plugins
    if _plugins is None:
        _plugins = {}
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            package = entry.dist.name if entry.dist is not None else "an unknown package"
            source = f"entry point {entry.name} = {entry.value} of package {package}"
            try:
                _check_name(entry.name)
                if entry.name in _BUILTIN:
                    raise ModelError(f"{entry.name!r} is a shipped model's name; rename the entry point.")
                cls = entry.load()
                check_model_class(entry.name, cls)
            except Exception as err:  # a broken plugin is reported by name; it must not hide the other models
                _plugin_errors[entry.name] = (
                    f"Model {entry.name!r} from {source} cannot be used: {type(err).__name__}: {err}. Fix or "
                    f"reinstall {package}, or uninstall it (pip uninstall {package})."
                )
                continue
            _plugins[entry.name] = (cls, package)
    return _plugins


def _models() -> dict[str, ModelClass]:
    """Every usable model: shipped, then installed packages', then registered in this process."""
    plugins = {name: cls for name, (cls, _) in _load_plugins().items()}
    return {**_BUILTIN, **plugins, **_registered}


def plugin_errors() -> list[str]:
    """One sentence per installed model entry point that could not be loaded (empty when all load)."""
    _load_plugins()
    return list(_plugin_errors.values())


def list_models() -> list[str]:
    """Return the usable model names: shipped first, then installed and registered ones."""
    return list(_models())


def describe_models() -> dict[str, str]:
    """Return one line per model: what it is, the paper it follows, and the package it comes from if not shipped."""
    plugins = _load_plugins()
    lines = {}
    for name, cls in _models().items():
        line = f"{cls.SUMMARY} ({cls.PAPER})" if cls.PAPER else cls.SUMMARY
        if name in _registered:
            line += " [registered in this process]"
        elif name in plugins:
            line += f" [package {plugins[name][1]}]"
        lines[name] = line
    return lines


def has_band_groups(name: str) -> bool:
    """Whether model ``name`` encodes band groups apart, where channel groups split it, rotation leaves some out."""
    return bool(getattr(_models().get(name), "BAND_GROUPS", False))


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
    models = _models()
    if name not in models:
        if name in _plugin_errors:
            raise ModelError(_plugin_errors[name])
        close = difflib.get_close_matches(str(name), models, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ModelError(
            f"Unknown model {name!r}; valid models are {', '.join(models)}.{hint} Your own model: "
            "hslite.models.register(name, cls), or an installed package's `hslite.models` entry point."
        )
    cls = models[name]
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
    if name in _BUILTIN:
        return cls(in_bands=in_bands, num_classes=num_classes, patch_size=patch_size, **hparams)
    return _built_own_model(name, cls, in_bands, num_classes, patch_size, hparams)


def _built_own_model(
    name: str, cls: ModelClass, in_bands: int, num_classes: int, patch_size: int, hparams: dict[str, Any]
) -> nn.Module:
    """A model that is not shipped, built and checked once on a two-patch batch, so a mismatch is one sentence."""
    where = f"Model {name!r} ({getattr(cls, '__qualname__', cls)})"
    try:
        model = cls(in_bands=in_bands, num_classes=num_classes, patch_size=patch_size, **hparams)
    except TypeError as err:
        raise ModelError(
            f"{where} could not be built with in_bands={in_bands}, num_classes={num_classes}, "
            f"patch_size={patch_size} and its preset {sorted(hparams)}: {err}. Its constructor must take those "
            "keywords."
        ) from err
    if not isinstance(model, nn.Module):
        raise ModelError(f"{where} built a {type(model).__name__}; it must build a torch.nn.Module.")
    if any(p.is_meta for p in model.parameters()):
        return model  # what-if pricing builds on the meta device: nothing to run
    device = next(model.parameters(), torch.empty(0)).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(torch.zeros(2, in_bands, patch_size, patch_size, device=device))
    model.train(was_training)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (2, num_classes):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ModelError(
            f"{where} maps patches (2, {in_bands}, {patch_size}, {patch_size}) to {shape}; it must return logits "
            f"(2, {num_classes}): one row of class scores per patch."
        )
    return model


def architecture_digest(model: nn.Module) -> str:
    """12 hex digits of the model's class and parameter names and shapes: what a cached measurement is of."""
    cls = type(model)
    shapes = ";".join(f"{name}{tuple(p.shape)}" for name, p in model.named_parameters())
    return hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}:{shapes}".encode()).hexdigest()[:12]


def _check_shape(label: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelError(f"{label} must be an integer of at least {minimum}; got {value!r}.")


def _checked_value(model: str, key: str, value: object, default: object) -> object:
    """Value of hyper-parameter ``key`` if it has the preset's type (ints pass for floats, lists for tuples)."""
    if isinstance(value, bool) or isinstance(default, bool):  # a bool is an int to Python, and never one here
        if type(value) is type(default):
            return value
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
