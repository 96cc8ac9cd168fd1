"""Recipe loading and `key=value` overrides, onto the schema of `recipe.schema`.

Precedence, lowest to highest: the schema's defaults < the recipe file < the recipe's `when_split` section for the
run's `data.split` < command-line `key=value` overrides. Recipes are YAML files read with `yaml.safe_load`, merged and
type-checked by OmegaConf against the schema.

`when_split` holds what a scene's best settings change with the evaluation protocol: on spatially disjoint blocks a
wide patch learns the training fields themselves and does not carry to unseen ones (Nalepa et al., "Validating
hyperspectral image segmentation", IEEE GRSL 2019), so a recipe may name a narrower model there. The command line
still wins, and the run's config.yaml holds the settings that ran.
"""

from __future__ import annotations

import difflib
import importlib.resources
import json
import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path, PurePath
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException

from hslite.datasets.splits import SPLIT_KINDS
from hslite.errors import ConfigError
from hslite.recipe.schema import Config, check_config, valid_keys


def _recipe_dir() -> Path:
    # The top-level recipes/ folder, installed as the package hslite.recipes (pyproject's package-dir): found the same
    # way from an editable install (setuptools' finder maps the folder) and from a wheel (the files are copied in).
    return Path(str(importlib.resources.files("hslite.recipes")))


def list_recipes() -> dict[str, str]:
    """Recipe names shipped with the package and their one-line descriptions."""
    out = {}
    for path in sorted(_recipe_dir().glob("*.yaml")):
        body = yaml.safe_load(path.read_text()) or {}
        out[path.stem] = str(body.get("description", ""))
    return out


def _recipe_path(recipe: str) -> Path:
    candidate = Path(recipe)
    if candidate.suffix in (".yaml", ".yml"):
        if not candidate.is_file():
            raise ConfigError(f"recipe file {recipe} does not exist (from {Path.cwd()}); check the path.")
        return candidate
    path = _recipe_dir() / f"{recipe}.yaml"
    if not path.is_file():
        names = list(list_recipes())
        close = difflib.get_close_matches(recipe, names, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown recipe {recipe!r}.{hint} Known recipes: {', '.join(names)} (or a path to a .yaml file)."
        )
    return path


def _closest_keys(key: str) -> str:
    keys = valid_keys()
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    if not close:
        section = key.split(".")[0]
        close = [k for k in keys if k.startswith(section + ".")][:6]
    if close:
        return f" Closest valid keys: {', '.join(close)}."
    return f" Valid sections: {', '.join(f.name for f in fields(Config))}."


def _merge(base: Any, layer: Any, where: str) -> Any:
    try:
        return OmegaConf.merge(base, layer)
    except ConfigKeyError as err:
        key = str(err.full_key or err.key)
        raise ConfigError(f"{where}: unknown key {key!r}.{_closest_keys(key)}") from None
    except OmegaConfBaseException as err:
        key = str(err.full_key) if err.full_key else "?"
        expected = _expected_type(key)
        msg = str(err).splitlines()[0]
        raise ConfigError(f"{where}: bad value for {key!r}: {msg}{expected}.") from None


def _expected_type(key: str) -> str:
    node: Any = Config
    for part in key.split("."):
        match = [f for f in fields(node)] if is_dataclass(node) else []
        found = next((f for f in match if f.name == part), None)
        if found is None:
            return ""
        node = found.default_factory if is_dataclass(found.default_factory) else found.type  # type: ignore[misc]
    return f" (expected {node})" if isinstance(node, str) else ""


def value_text(value: Any) -> str:
    """A Python value as `key=value` text that `text_value` reads back as exactly that value.

    Strings are written as JSON strings (a YAML double-quoted scalar), so `"true"`, `"1e-3"`, `"null"` and
    `"corn, notill"` stay the strings they are instead of becoming a bool, a float, None or two list items.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if hasattr(value, "tolist"):  # a numpy or torch scalar or array
        value = value.tolist()
    if isinstance(value, int | float):
        return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan" if math.isnan(value) else repr(value))
    if isinstance(value, str | PurePath):
        return json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {value_text(v)}" for k, v in value.items()) + "}"
    raise ConfigError(
        f"an override value of type {type(value).__name__} ({value!r}) cannot be given: pass a string, number, bool, "
        "None, or a list or dict of them."
    )


def text_value(text: str) -> Any:
    """What `key=text` means on a command line: OmegaConf's YAML reading (`3` a number, `[a,b]` a list)."""
    read: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))
    return read["value"]


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    """Split `key=value` items; anything else is a usage error naming the item."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {item!r}. Example: train.max_epochs=5")
        pairs.append((key.strip(), value))
    return pairs


def load_config(recipe: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < recipe < its `when_split` for the run's split < overrides, type- and range-checked.

    `recipe=NAME` may also come in overrides.
    """
    pairs = parse_overrides(list(overrides))
    named = [str(text_value(v)) for k, v in pairs if k == "recipe"]
    recipe = (named[-1] if named else recipe) or "quickstart"  # the last one, as for every other key
    pairs = [(k, v) for k, v in pairs if k != "recipe"]

    cfg = OmegaConf.structured(Config)
    path = _recipe_path(recipe)
    try:
        body = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(body).__name__}.")
    _check_sections(body, f"recipe {path}")
    when_split = _when_split(body.pop("when_split", None), path)
    body.setdefault("recipe", path.stem)  # a run's config.yaml keeps the recipe it was made from
    cfg = _merge(cfg, OmegaConf.create(body), f"recipe {path.name}")
    named_splits = [text_value(v) for k, v in pairs if k == "data.split"]
    split = named_splits[-1] if named_splits else cfg.data.split
    if split in when_split:
        cfg = _merge(cfg, OmegaConf.create(when_split[split]), f"recipe {path.name}, when_split.{split}")
    for key, value in pairs:
        if key not in valid_keys():
            raise ConfigError(f"unknown key {key!r}.{_closest_keys(key)}")
        cfg = _merge(cfg, OmegaConf.from_dotlist([f"{key}={value}"]), "command line")
    try:
        resolved = OmegaConf.to_object(cfg)
    except InterpolationResolutionError as err:
        raise ConfigError(
            f"{err.full_key or '?'}: a value with `${{...}}` is an interpolation, which hslite configs do not use; "
            "write the value itself."
        ) from None
    return check_config(resolved)  # type: ignore[arg-type]


def _check_sections(body: dict[str, Any], where: str) -> None:
    sections = [f.name for f in fields(Config) if is_dataclass(f.default_factory)]
    flat = [name for name in sections if name in body and not isinstance(body[name], dict)]
    if flat:
        raise ConfigError(
            f"{where}: section {flat[0]!r} must be a mapping of keys (e.g. `{flat[0]}:` then indented "
            f"`key: value` lines), got {body[flat[0]]!r}."
        )


def _when_split(section: Any, path: Path) -> dict[str, dict[str, Any]]:
    """A recipe's `when_split: {<split kind>: {<section>: {...}}}`, checked for shape; its keys are checked on merge."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(
            f"recipe {path}: when_split must map a split kind ({', '.join(SPLIT_KINDS)}) to sections, got {section!r}."
        )
    for kind, layer in section.items():
        if kind not in SPLIT_KINDS:
            raise ConfigError(
                f"recipe {path}: when_split.{kind}: {kind!r} is not a split kind; use one of {', '.join(SPLIT_KINDS)}."
            )
        if not isinstance(layer, dict):
            raise ConfigError(f"recipe {path}: when_split.{kind} must be a mapping of sections, got {layer!r}.")
        if "data" in layer and isinstance(layer["data"], dict) and "split" in layer["data"]:
            raise ConfigError(f"recipe {path}: when_split.{kind} sets data.split, which chose it; remove that key.")
        _check_sections(layer, f"recipe {path}, when_split.{kind}")
    return section


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, for the run folder."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
