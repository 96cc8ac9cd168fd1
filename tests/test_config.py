"""Recipe schema, precedence and the errors a person sees."""

import pytest

from hslite.config import Config, list_recipes, load_config, valid_keys
from hslite.errors import ConfigError

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


@pytest.mark.parametrize("name", sorted(EXPECTED_RECIPES))
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
    assert load_config("salinas_a_1gpu").train.max_epochs == 40


def test_recipe_can_come_from_overrides_and_yaml_path(tmp_path):
    assert load_config(None, ["recipe=salinas_a_1gpu"]).recipe == "salinas_a_1gpu"
    path = tmp_path / "mine.yaml"
    path.write_text("description: mine\ntrain:\n  max_epochs: 7\n")
    cfg = load_config(str(path))
    assert cfg.train.max_epochs == 7 and cfg.recipe == "mine"


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
