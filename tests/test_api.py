"""The Python API: `import hslite` stays light, calls take the CLI's recipe and overrides and return objects."""

from __future__ import annotations

import subprocess
import sys

import pytest
from quick_fit import NO_PREFLIGHT, QUICK_FIT
from test_own_models import Tiny

import hslite
import hslite.models as models
from hslite.api import override_items
from hslite.errors import ConfigError


def test_import_hslite_loads_neither_torch_nor_lightning_until_a_call_needs_them():
    probe = "import sys, hslite; print('torch' in sys.modules, 'lightning' in sys.modules, sorted(dir(hslite)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False False") and "'fit'" in out and "'preflight'" in out and "'register_model'" in out
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        hslite.fitt  # noqa: B018


def test_dict_overrides_arrive_in_the_config_as_the_values_given(monkeypatch):
    import hslite.run.fit

    loaded = []
    monkeypatch.setattr(hslite.run.fit, "fit", loaded.append)
    given = {
        "data.class_names": ["corn, notill", "grass"],  # a comma inside a name is not a second name
        "description": "true",  # a string that reads as a bool
        "output.root": "1e-3",  # ... as a float
        "data.root": "a=b: #c",  # YAML's own punctuation
        "train.max_epochs": 3,
        "train.refit": False,
        "train.lr": 1e-3,
    }
    hslite.fit("quickstart", given)
    (cfg,) = loaded
    assert cfg.data.class_names == ["corn, notill", "grass"] and cfg.description == "true"
    assert cfg.output.root == "1e-3" and cfg.data.root == "a=b: #c"
    assert cfg.train.max_epochs == 3 and cfg.train.refit is False and cfg.train.lr == 1e-3
    with pytest.raises(ConfigError, match=r"^description: a value with `\$\{\.\.\.\}` is an interpolation"):
        hslite.fit("quickstart", {"description": "${x}"})
    with pytest.raises(ConfigError, match=r"^description: a value with"):
        hslite.fit("quickstart", ["description=${x}"])  # the command line's form: the same sentence


def test_overrides_are_key_value_strings_or_a_dict_of_python_values():
    assert override_items(["train.max_epochs=3"]) == ["train.max_epochs=3"] and override_items(None) == []
    with pytest.raises(ConfigError, match=r"got the string 'train.max_epochs=3': write \['train.max_epochs=3'\]"):
        override_items("train.max_epochs=3")
    with pytest.raises(ConfigError, match="type object"):
        override_items({"train.lr": object()})


@pytest.mark.slow
def test_fit_of_an_own_model_class_returns_the_run_and_predict_maps_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_registered", {})
    run = hslite.fit("quickstart", [*QUICK_FIT, NO_PREFLIGHT, f"output.root={tmp_path}"], model=Tiny)
    assert run.run_dir.parent == tmp_path / "quickstart" and run.best_checkpoint.is_file()
    assert 0 < run.metrics["OA"] <= 1 and "name: tiny" in (run.run_dir / "config.yaml").read_text()
    mapped = hslite.predict(run.run_dir, overrides={"progress": False})
    assert mapped.classes.shape == (24, 24) and (mapped.out_dir / "prediction.tif").is_file()


def test_preflight_returns_the_verdict_object_the_cli_prints():
    import hslite.comparison.rows
    from hslite.preflight_check.decide.verdict import Verdict

    # The functions and the packages behind them have names of their own: importing one leaves the other as it is
    assert callable(hslite.preflight) and callable(hslite.compare) and Verdict.better_plan
    assert hslite.comparison.rows.CompareRow is not None
    verdict = hslite.preflight("quickstart", {"data.scene": "synthetic_tiny"})
    assert verdict.go is True and verdict.exit_code == 0 and verdict.better_plan is None
    assert verdict.to_dict()["decision"] == "GO"


def test_the_strategies_a_lightning_script_uses_come_from_one_public_place():

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from hslite import strategies

    assert sorted(strategies.__all__) == ["CompressedDDPStrategy", "Deadlines", "FencedDDPStrategy", "ShardedStrategy"]
    int8 = strategies.CompressedDDPStrategy("int8", start_method="spawn")  # as its docstring builds them
    assert isinstance(int8, strategies.FencedDDPStrategy) and isinstance(int8, DDPStrategy)
    assert int8.compression == "int8"
    sharded = strategies.ShardedStrategy(2, "32-true", "gloo")
    assert isinstance(sharded, ModelParallelStrategy) and callable(sharded.shard)


def test_compare_returns_the_table_it_wrote(tmp_path):
    table = hslite.compare(["quickstart"], {"data.scene": "synthetic_tiny", "output.root": str(tmp_path)})
    assert [row.label for row in table.rows] == ["quickstart"] and table.rows[0].decision == "GO"
    assert (table.folder / "compare.json").is_file() and table.to_dict()["rows"][0]["label"] == "quickstart"
