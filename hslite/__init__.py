"""hslite: single-node hyperspectral training that measures whether more GPUs pay before it uses them.

    import hslite
    run = hslite.fit("quickstart", {"train.max_epochs": 5})
    verdict = hslite.preflight("quickstart_cpu4")
    trainer = lightning.pytorch.Trainer(..., callbacks=[hslite.PreflightGate()])  # your own script, gated

`import hslite` imports neither torch nor Lightning: each name below loads its module on first use (PEP 562).
`hslite.preflight` and `hslite.compare` are functions; the code behind them is in `hslite.preflight_check` and
`hslite.comparison`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hslite.errors import ConfigError, DataError, HSLiteError, ModelError

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "fit": "hslite.api",
    "preflight": "hslite.api",
    "compare": "hslite.api",
    "predict": "hslite.api",
    "CompareTable": "hslite.api",
    "register_model": "hslite.models",
    "PreflightGate": "hslite.preflight_check.own_script.callback",
    "PreflightRefused": "hslite.preflight_check.decide.verdict",
}
_RENAMED = {"register_model": "register"}

__all__ = [
    "CompareTable",
    "ConfigError",
    "DataError",
    "HSLiteError",
    "ModelError",
    "PreflightGate",
    "PreflightRefused",
    "__version__",
    "compare",
    "fit",
    "predict",
    "preflight",
    "register_model",
]

if TYPE_CHECKING:
    from hslite.api import CompareTable, compare, fit, predict, preflight
    from hslite.models import register as register_model
    from hslite.preflight_check.decide.verdict import PreflightRefused
    from hslite.preflight_check.own_script.callback import PreflightGate


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hslite' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
