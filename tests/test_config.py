"""Recipe schema, precedence, range checks and the errors a person sees."""

import re
import subprocess
import sys
import types
from dataclasses import fields, is_dataclass

import pytest

from hslite.cli import main
from hslite.errors import ConfigError
from hslite.recipe.config import list_recipes, load_config
from hslite.recipe.schema import Config, valid_keys

EXPECTED_RECIPES = {
    "quickstart",
    "indian_pines_1gpu",
    "pavia_university_1gpu",
    "salinas_1gpu",
    "salinas_a_1gpu",
    "houston2013_1gpu",
}


def test_shipped_recipes_are_listed_with_descriptions():
    recipes = list_recipes()
    assert EXPECTED_RECIPES <= set(recipes)
    assert all(recipes[name] for name in recipes), "every recipe needs a one-line description"


@pytest.mark.parametrize("name", sorted(list_recipes()))
def test_every_recipe_loads_and_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    assert cfg.recipe == name


def test_precedence_cli_over_recipe_over_defaults():
    defaults = Config()
    cfg = load_config("salinas_a_1gpu", ["train.max_epochs=3"])
    assert cfg.train.max_epochs == 3  # command line beats the recipe's 40
    assert cfg.data.scene == "salinas_a"  # recipe beats the default
    assert cfg.train.lr == defaults.train.lr  # untouched keys keep the default
    assert load_config("salinas_a_1gpu").train.max_epochs == 60


def test_recipe_can_come_from_overrides_and_yaml_path(tmp_path):
    assert load_config(None, ["recipe=salinas_a_1gpu"]).recipe == "salinas_a_1gpu"
    path = tmp_path / "mine.yaml"
    path.write_text("description: mine\ntrain:\n  max_epochs: 7\n")
    cfg = load_config(str(path))
    assert cfg.train.max_epochs == 7 and cfg.recipe == "mine"


WHEN_SPLIT = """
model:
  name: ssftt
data:
  patch_size: 13
when_split:
  disjoint:
    model: {name: cnn1d}
    data: {patch_size: 1}
"""


def test_when_split_applies_for_its_split_only_and_the_command_line_wins(tmp_path):
    path = tmp_path / "protocols.yaml"
    path.write_text(WHEN_SPLIT)
    plain = load_config(str(path))
    assert (plain.model.name, plain.data.patch_size) == ("ssftt", 13)
    disjoint = load_config(str(path), ["data.split=disjoint"])
    assert (disjoint.model.name, disjoint.data.patch_size) == ("cnn1d", 1)
    chosen = load_config(str(path), ["data.split=disjoint", "model.name=hybridsn"])
    assert (chosen.model.name, chosen.data.patch_size) == ("hybridsn", 1)
    last = load_config(str(path), ["data.split=disjoint", "data.split=stratified"])
    assert last.model.name == "ssftt"  # the last data.split, as for every other key
    path.write_text(WHEN_SPLIT.replace("  patch_size: 13", "  patch_size: 13\n  split: disjoint"))
    assert load_config(str(path)).model.name == "cnn1d"  # the recipe's own split chooses too


def test_indian_pines_1gpu_trains_spectra_on_disjoint_blocks():
    cfg = load_config("indian_pines_1gpu", ["data.split=disjoint"])
    assert (cfg.model.name, cfg.model.window_mean, cfg.data.patch_size) == ("cnn1d", True, 3)
    assert (cfg.data.pca_components, cfg.train.refit, cfg.train.weight_decay) == (0, True, 0.2)
    assert cfg.data.block_size == 20  # the recipe's blocks, whichever model
    assert load_config("indian_pines_1gpu").model.name == "ssftt"


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ("when_split: [disjoint]", "must map a split kind"),
        ("when_split:\n  blocks: {model: {name: cnn1d}}", "'blocks' is not a split kind"),
        ("when_split:\n  disjoint: {data: {split: count}}", "sets data.split"),
        ("when_split:\n  disjoint: {model: cnn1d}", "section 'model' must be a mapping"),
        ("when_split:\n  disjoint: {model: {nmae: cnn1d}}", "when_split.disjoint: unknown key 'model.nmae'"),
    ],
)
def test_bad_when_split_says_what_and_where(tmp_path, section, says):
    path = tmp_path / "bad.yaml"
    path.write_text(section + "\n")
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(str(path), ["data.split=disjoint"])


def test_override_values_are_typed():
    cfg = load_config(None, ["data.remove_ranges_nm=[[1340,1450]]", "data.root=null", "train.lr=0.01"])
    assert cfg.data.remove_ranges_nm == [[1340.0, 1450.0]]
    assert cfg.data.root is None
    assert cfg.train.lr == 0.01


def test_unknown_key_names_it_and_closest_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_epoch=3"])
    assert "train.max_epoch" in str(err.value) and "train.max_epochs" in str(err.value)


def test_unknown_key_in_recipe_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  patchsize: 9\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert "patchsize" in str(err.value) and "data.patch_size" in str(err.value)


def test_wrong_type_names_the_expected_type():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.patch_size=nine"])
    message = str(err.value)
    assert "data.patch_size" in message and "int" in message


def test_unknown_recipe_lists_recipes():
    with pytest.raises(ConfigError) as err:
        load_config("salinas_b_1gpu")
    assert "salinas_a_1gpu" in str(err.value) and "quickstart" in str(err.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.max_epochs"])


def test_recipe_cannot_execute_code(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_valid_keys_cover_every_section():
    keys = valid_keys()
    for section in ("data", "model", "train", "parallel", "preflight", "output"):
        assert any(k.startswith(section + ".") for k in keys)


SHARE_OR_COUNT = "must be a share in (0, 1] or a whole count > 1"
# (key, bad value, words the message must hold); every numeric field has at least one row.
OUT_OF_RANGE = [
    ("data.remove_bands", "[3,-1]", "every element must be ≥ 0"),
    ("data.remove_ranges_nm", "[[-5,10]]", "every element must be ≥ 0"),
    ("data.pca_components", "-1", "must be ≥ 0"),
    ("data.patch_size", "0", "must be an odd number ≥ 1"),
    ("data.patch_size", "4", "must be an odd number ≥ 1"),
    ("data.train_fraction", "0", "must be in (0, 1)"),
    ("data.train_fraction", "1", "must be in (0, 1)"),
    ("data.val_fraction", "0", "must be in (0, 1)"),
    ("data.val_fraction", "1.2", "must be in (0, 1)"),
    ("data.train_per_class", "-1", "must be ≥ 0"),
    ("data.val_per_class", "-1", "must be ≥ 0"),
    ("data.block_size", "-4", "must be ≥ 0"),
    ("data.batch_size", "0", "must be ≥ 1"),
    ("data.eval_batch_size", "0", "must be ≥ 1"),
    ("data.num_workers", "-1", "must be ≥ 0"),
    ("data.host_memory_gb", "-2", "must be ≥ 0"),
    ("data.ignore_label", "4294967296", "must be in [-2147483648, 4294967295]"),
    ("train.max_epochs", "-3", "must be ≥ 1"),
    ("train.max_epochs", "0", "must be ≥ 1"),
    ("train.max_steps", "0", "must be -1 or ≥ 1"),
    ("train.max_steps", "-2", "must be -1 or ≥ 1"),
    ("train.lr", "-1", "must be > 0"),
    ("train.lr", "0", "must be > 0"),
    ("train.lr", "nan", "must be > 0"),
    ("train.lr", "inf", "must be > 0"),
    ("train.weight_decay", "-0.1", "must be ≥ 0"),
    ("train.warmup_epochs", "-1", "must be ≥ 0"),
    ("train.seed", "-1", "must be in [0, 4294967295]"),
    ("train.seed", "4294967296", "must be in [0, 4294967295]"),
    ("train.limit_train_batches", "0", SHARE_OR_COUNT),
    ("train.limit_val_batches", "1.5", SHARE_OR_COUNT),
    ("train.limit_test_batches", "-2", SHARE_OR_COUNT),
    ("train.check_val_every_n_epoch", "0", "must be ≥ 1"),
    ("parallel.devices", "0", "must be ≥ 1"),
    ("parallel.num_nodes", "0", "must be ≥ 1"),
    ("parallel.accumulate", "0", "must be ≥ 1"),
    ("parallel.chag", "0", "must be ≥ 1"),
    ("parallel.rotation_groups", "-1", "must be ≥ 0"),
    ("model.band_groups", "-2", "must be ≥ 0"),
    ("preflight.min_efficiency", "0", "must be in (0, 1]"),
    ("preflight.min_efficiency", "1.5", "must be in (0, 1]"),
    ("preflight.device_efficiency", "1.5", "must be 0 or in (0, 1]"),
    ("output.checkpoint_every_n_epochs", "0", "must be ≥ 1"),
    ("preflight.probe_steps", "0", "must be ≥ 1"),
    ("parallel.deadlines.collective", "0", "must be > 0"),
    ("parallel.deadlines.startup", "-1", "must be > 0"),
    ("parallel.deadlines.fence", "0", "must be > 0"),
    ("parallel.deadlines.stall", "0", "must be > 0"),
]


@pytest.mark.parametrize(("key", "value", "words"), OUT_OF_RANGE)
def test_out_of_range_value_names_field_value_and_range(key, value, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}"])
    message = str(err.value)
    assert message.startswith(f"{key}=") and "is out of range" in message and words in message, message


@pytest.fixture
def fit_must_not_run(monkeypatch):
    """A stand-in for hslite.run.fit (which imports torch): a range error must stop the CLI before it is reached."""
    stub = types.ModuleType("hslite.run.fit")
    stub.__getattr__ = lambda name: pytest.fail(f"the CLI reached hslite.run.fit.{name} with a bad config")
    monkeypatch.setitem(sys.modules, "hslite.run.fit", stub)


@pytest.mark.parametrize(("key", "value", "words"), OUT_OF_RANGE)
def test_out_of_range_value_is_exit_2_without_traceback(key, value, words, capsys, fit_must_not_run):
    assert main(["fit", f"{key}={value}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"hslite: error: {key}=") and words in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_range_message_is_one_sentence_saying_what_to_do():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_epochs=-3"])
    assert str(err.value) == "train.max_epochs=-3 is out of range: must be ≥ 1."


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_epochs=-3", "train.lr=-1", "parallel.devices=0"])
    message = str(err.value)
    assert all(key in message for key in ("train.max_epochs=-3", "train.lr=-1.0", "parallel.devices=0"))


def test_recipe_values_are_range_checked_too(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: 0\n")
    with pytest.raises(ConfigError, match=r"train.max_steps=0 is out of range: must be -1 or ≥ 1"):
        load_config(str(path))
    assert load_config(str(path), ["train.max_steps=-1"]).train.max_steps == -1  # the override fixes it


@pytest.mark.parametrize(
    "override",
    [
        "train.max_steps=-1",
        "train.max_steps=1",
        "train.limit_train_batches=1.0",
        "train.limit_train_batches=0.25",
        "train.limit_val_batches=2",
        "train.seed=4294967295",
        "data.patch_size=1",
        "data.remove_bands=[0,5]",
        "train.weight_decay=0",
        "train.warmup_epochs=0",
        "preflight.min_efficiency=1",
        "parallel.rotation_groups=0",
        "data.pca_components=0",
    ],
)
def test_edge_values_inside_the_range_load(override):
    load_config(None, [override])


def test_fractions_must_leave_test_pixels():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train_fraction=0.6", "data.val_fraction=0.4"])
    assert "data.train_fraction=0.6 + data.val_fraction=0.4" in str(err.value) and "must be < 1" in str(err.value)
    load_config(
        None, ["data.split=count", "data.train_per_class=5", "data.train_fraction=0.6", "data.val_fraction=0.4"]
    )


def test_count_split_needs_training_pixels():
    with pytest.raises(ConfigError, match=r"data.split=count needs data.train_per_class ≥ 1 .*got 0"):
        load_config(None, ["data.split=count"])


def _numeric_fields(section, prefix=""):
    for f in fields(section):
        if is_dataclass(f.default_factory):
            yield from _numeric_fields(f.default_factory, f"{prefix}{f.name}.")
        elif re.search(r"\b(int|float)\b", str(f.type)):
            yield prefix + f.name, f


def test_every_numeric_field_declares_a_range_and_has_a_bad_value_row():
    numeric = dict(_numeric_fields(Config))
    assert {"train.lr", "train.seed", "data.remove_ranges_nm", "preflight.min_efficiency"} <= set(numeric)
    assert [key for key, f in numeric.items() if "range" not in f.metadata] == []
    assert set(numeric) == {key for key, _, _ in OUT_OF_RANGE}


@pytest.mark.parametrize("command", ["fit", "preflight"])
def test_a_range_error_stops_the_cli_before_torch_is_imported(command):
    probe = (
        f"import sys; from hslite.cli import main; code = main([{command!r}, 'train.lr=-1', 'parallel.devices=0']); "
        "print(code, 'torch' in sys.modules, 'lightning' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert "train.lr=-1.0 is out of range: must be > 0. parallel.devices=0 is out of range" in result.stderr
