"""The profiles shipped inside the package (topologies/, devices/): listed and read by name, with yaml.safe_load."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from hslite.errors import ConfigError


def bundled_names(folder: str) -> list[str]:
    """Names of the bundled profiles in `folder` (the YAML files under hslite/preflight_check/hardware/<folder>/)."""
    return sorted(_files(folder))


def read_bundled(folder: str, name: str, what: str) -> Any:
    """The parsed YAML of profile `name`; an unknown name raises ConfigError naming `what` and the known ones."""
    files = _files(folder)
    if name not in files:
        raise ConfigError(f"unknown {what} {name!r}; known profiles: {', '.join(sorted(files))}.")
    return yaml.safe_load(files[name].read_text())


def _files(folder: str) -> dict[str, Any]:
    root = resources.files("hslite.preflight_check.hardware") / folder
    return {f.name.removesuffix(".yaml"): f for f in root.iterdir() if f.name.endswith(".yaml")}
