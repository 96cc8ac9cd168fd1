"""A team's own model: `register` from Python, an installed package's `hslite.models` entry point, and the protocol's
errors, each a sentence naming what to change."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quick_fit import NO_PREFLIGHT, QUICK_FIT
from torch import nn

import hslite.models as models
from hslite.errors import ModelError
from hslite.models import get_model, list_models, register

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "own_model"


class Tiny(nn.Module):
    SUMMARY = "linear on the centre spectrum"
    PAPER = ""
    SIZES = {"small": {"scale": 1.0}}

    def __init__(self, *, in_bands, num_classes, patch_size, scale):
        super().__init__()
        self.centre, self.linear = patch_size // 2, nn.Linear(in_bands, num_classes)

    def forward(self, x):
        return self.linear(x[:, :, self.centre, self.centre])


@pytest.fixture
def registry(monkeypatch):
    """The registry as it was, restored after the test: registrations here do not leak into other tests."""
    monkeypatch.setattr(models, "_registered", {})
    monkeypatch.setattr(models, "_plugins", None)
    monkeypatch.setattr(models, "_plugin_errors", {})
    return models


def test_a_registered_class_is_listed_built_and_described(registry):
    assert register("tiny", Tiny) is Tiny
    assert list_models()[-1] == "tiny" and list_models()[:5] == ["cnn1d", "cnn3d", "hybridsn", "spectralformer",
                                                                 "channel_vit"]  # fmt: skip
    assert registry.describe_models()["tiny"] == "linear on the centre spectrum [registered in this process]"
    model = get_model("tiny", in_bands=7, num_classes=3, patch_size=5)
    assert model(torch.randn(4, 7, 5, 5)).shape == (4, 3)

    @register("tiny_too")
    class Decorated(Tiny):
        pass

    assert "tiny_too" in list_models()


class Wider(Tiny):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.extra = nn.Linear(2, 2)


def _class(**attributes):
    return type("Broken", (Tiny,), attributes)


@pytest.mark.parametrize(
    ("name", "cls", "message"),
    [
        ("cnn3d", Tiny, "is a shipped model's; register yours under another name"),
        ("My-Net", Tiny, "lower-case letters, digits and underscores"),
        ("bad", _class(SIZES={}), 'needs SIZES = {"small": {...}}'),
        ("bad", _class(SUMMARY=""), "needs SUMMARY"),
        ("bad", _class(SIZES={"small": ["hidden", 3]}), r"SIZES\['small'\] must be a dict"),
        (
            "bad",
            _class(BAND_GROUPS=True),
            "BAND_GROUPS = True but has no encode_group, encode_groups, aggregate, head, group_parameters",
        ),
        ("bad", _class(FSDP_UNITS="linear"), "FSDP_UNITS must be a tuple of submodule names"),
        ("bad", Tiny(in_bands=2, num_classes=2, patch_size=1, scale=1.0), "must be a class"),
    ],
)
def test_a_class_that_does_not_follow_the_protocol_is_refused_at_register(registry, name, cls, message):
    with pytest.raises(ModelError, match=message):
        register(name, cls)
    assert name not in registry._registered


def test_a_name_taken_needs_replace_true(registry):
    register("tiny", Tiny)
    with pytest.raises(ModelError, match="already registered to Tiny; pick another name or pass replace=True"):
        register("tiny", _class())
    register("tiny", _class(), replace=True)


def test_a_model_that_cannot_be_built_or_returns_the_wrong_shape_says_what_to_change(registry):
    register("no_kwargs", _class(__init__=lambda self, in_bands: None))
    with pytest.raises(ModelError, match="could not be built with in_bands=7, num_classes=3, patch_size=5"):
        get_model("no_kwargs", in_bands=7, num_classes=3, patch_size=5)
    register("wrong_shape", _class(forward=lambda self, x: x.mean(dim=(2, 3))))
    with pytest.raises(ModelError, match=r"to \(2, 7\); it must return logits \(2, 3\)"):
        get_model("wrong_shape", in_bands=7, num_classes=3, patch_size=5)
    plain = {"SUMMARY": "not a module", "PAPER": "", "SIZES": {"small": {}}, "__init__": lambda self, **kw: None}
    register("no_module", type("Plain", (), plain))
    with pytest.raises(ModelError, match="built a Plain; it must build a torch.nn.Module"):
        get_model("no_module", in_bands=7, num_classes=3, patch_size=5)


def _installed(site: Path, entry_points: str, module: Path | None = None) -> dict[str, str]:
    """A package installed into `site` as pip lays one out (module + dist-info): the environment to see it."""
    if module is not None:
        shutil.copy(module, site / module.name)
    info = site / "hslite_example_spectral_mlp-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hslite-example-spectral-mlp\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "PYTHONWARNINGS": "ignore"}


def _cli(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hslite", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_an_installed_package_model_is_listed_and_trained_by_name(tmp_path):
    env = _installed(
        tmp_path, "[hslite.models]\nspectral_mlp = spectral_mlp:SpectralMLP\n", EXAMPLE / "spectral_mlp.py"
    )
    listed = _cli(env, "models", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "spectral_mlp" in listed.stdout and "[package hslite-example-spectral-mlp]" in listed.stdout
    fit = _cli(env, "fit", *QUICK_FIT, NO_PREFLIGHT, "model.name=spectral_mlp", "output.root=runs", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    (run,) = (tmp_path / "runs" / "quickstart").iterdir()
    assert json.loads((run / "metrics.json").read_text())["OA"] > 0
    assert "name: spectral_mlp" in (run / "config.yaml").read_text()


@pytest.mark.slow
def test_an_entry_point_that_fails_to_import_is_one_sentence_and_hides_no_other_model(tmp_path):
    env = _installed(tmp_path, "[hslite.models]\nghost = not_installed_module:Ghost\n")
    listed = _cli(env, "models", cwd=tmp_path)
    assert listed.returncode == 1 and "channel_vit" in listed.stdout and "ghost" not in listed.stdout
    assert (
        "Model 'ghost' from entry point ghost = not_installed_module:Ghost of package hslite-example-spectral-mlp "
        "cannot be used: ModuleNotFoundError" in listed.stderr
    )
    assert "pip uninstall hslite-example-spectral-mlp" in listed.stderr and "Traceback" not in listed.stderr
    fit = _cli(env, "fit", *QUICK_FIT, NO_PREFLIGHT, "model.name=ghost", cwd=tmp_path)
    assert fit.returncode == 2 and "Model 'ghost' from entry point" in fit.stderr and "Traceback" not in fit.stderr


def test_cached_measurements_are_keyed_by_architecture_not_by_name_alone():
    from hslite.models import architecture_digest

    one, same = (Tiny(in_bands=7, num_classes=3, patch_size=5, scale=1.0) for _ in range(2))
    wider = Tiny(in_bands=8, num_classes=3, patch_size=5, scale=1.0)
    assert architecture_digest(one) == architecture_digest(same) != architecture_digest(wider)
    assert architecture_digest(one) != architecture_digest(_class()(in_bands=7, num_classes=3, patch_size=5, scale=1))


def test_the_preflight_does_not_read_a_cached_probe_of_another_model_under_the_same_name(registry):
    from hslite.parallel.plan import Plan
    from hslite.recipe.build import prepared_datamodule
    from hslite.recipe.config import load_config
    from hslite.recipe.recipe_parts import RecipeParts

    cfg = load_config("quickstart", [*QUICK_FIT, "model.name=tiny"])
    datamodule = prepared_datamodule(cfg)
    keys = []
    for cls in (Tiny, Wider):
        register("tiny", cls, replace=True)
        keys.append(RecipeParts.of(cfg, Plan(accelerator="cpu"), datamodule, 1, None, True).cache_key)
    assert keys[0].startswith("tiny-small-") and keys[0] != keys[1]
