"""Fine-tuning from a local checkpoint: safe loading, every key accounted for, the backbone frozen in a real fit."""

from __future__ import annotations

import sys

import pytest
import torch
from quick_fit import NO_PREFLIGHT, QUICK_FIT

import hslite
from hslite.errors import ModelError
from hslite.models import get_model
from hslite.models.pretrained import load_pretrained


class Pickled:
    """An object a checkpoint could carry, whose loading would run code."""


def cnn3d(classes: int = 4):
    torch.manual_seed(classes)
    return get_model("cnn3d", in_bands=10, num_classes=classes, patch_size=5)


def save(state, path):
    """Write `state` as teams share it: torch.save, or safetensors for a `.safetensors` path."""
    if path.suffix == ".safetensors":
        safetensors_torch = pytest.importorskip("safetensors.torch", reason='needs pip install "hslite[safetensors]"')
        safetensors_torch.save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


BOTH_FORMATS = pytest.mark.parametrize("name", ["net.pt", "net.safetensors"])


def test_a_state_dict_and_a_lightning_checkpoint_load_the_same_weights(tmp_path):
    source = cnn3d()
    torch.save(source.state_dict(), tmp_path / "net.pt")
    lightning_style = {"state_dict": {**{f"model.{k}": v for k, v in source.state_dict().items()},
                                      "criterion.weight": torch.ones(4)}, "epoch": 3}  # fmt: skip
    torch.save(lightning_style, tmp_path / "task.ckpt")
    for name in ("net.pt", "task.ckpt"):
        target = get_model("cnn3d", in_bands=10, num_classes=4, patch_size=5)
        assert load_pretrained(target, tmp_path / name) == sum(p.numel() for p in target.parameters())
        for key, value in source.state_dict().items():
            torch.testing.assert_close(target.state_dict()[key], value)


def test_a_safetensors_file_loads_the_same_weights_as_the_torch_save_one(tmp_path):
    source = cnn3d()
    for name in ("net.pt", "net.safetensors"):
        target = get_model("cnn3d", in_bands=10, num_classes=4, patch_size=5)
        trainable = load_pretrained(target, save(source.state_dict(), tmp_path / name))
        assert trainable == sum(p.numel() for p in target.parameters())
        for key, value in source.state_dict().items():
            torch.testing.assert_close(target.state_dict()[key], value)
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # a header cut short
    with pytest.raises(ModelError, match="is not a .safetensors file that can be read"):
        load_pretrained(cnn3d(), tmp_path / "cut.safetensors")


@BOTH_FORMATS
def test_another_number_of_classes_names_the_first_tensor_and_excluding_the_head_trains_only_it(tmp_path, name):
    path = save(cnn3d(classes=4).state_dict(), tmp_path / name)
    target = cnn3d(classes=6)
    fresh = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ModelError) as err:
        load_pretrained(target, path)
    assert str(err.value) == (
        f"model.pretrained={path} does not fit CNN3D as built for this scene: its tensor fc.weight is (4, 70) in the "
        "file but (6, 70) in the model (and 1 more of another shape: fc.bias); add model.pretrained_exclude=[fc] to "
        "keep that part freshly initialised, or build the architecture the checkpoint was trained with (model.name, "
        "model.size, data.patch_size, bands)."
    )
    for key, value in target.state_dict().items():  # refused: nothing half-loaded
        torch.testing.assert_close(value, fresh[key])
    trainable = load_pretrained(target, path, exclude=["fc"], freeze=True)
    assert trainable == sum(p.numel() for p in target.fc.parameters())
    assert {n for n, p in target.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}
    source = cnn3d(classes=4).state_dict()
    for key, value in target.state_dict().items():  # the backbone is the file's, the head its own fresh start
        torch.testing.assert_close(value, fresh[key] if key.startswith("fc.") else source[key])


def test_a_safetensors_file_without_the_package_names_the_extra_to_install(tmp_path, monkeypatch):
    (tmp_path / "net.safetensors").write_bytes(b"{}")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # None in sys.modules: the import fails as if absent
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ModelError) as err:
        load_pretrained(cnn3d(), tmp_path / "net.safetensors")
    assert str(err.value) == (
        f"model.pretrained={tmp_path / 'net.safetensors'} is a .safetensors file, which needs the safetensors "
        'package: pip install "hslite[safetensors]".'
    )


@BOTH_FORMATS
def test_missing_and_unexpected_keys_are_named(tmp_path, name):
    state = cnn3d().state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["conv1.weight"]
    with pytest.raises(ModelError, match=r"1 missing \(conv1.weight\); 1 unexpected \(extra.weight\)"):
        load_pretrained(cnn3d(), save(state, tmp_path / name))


def test_a_file_that_is_not_plain_tensors_is_refused_without_advising_an_unsafe_load(tmp_path):
    torch.save({"conv1.weight": Pickled()}, tmp_path / "pickled.pt")  # a class weights_only does not allow
    with pytest.raises(ModelError, match="is not a checkpoint of tensors that can be read safely") as err:
        load_pretrained(cnn3d(), tmp_path / "pickled.pt")
    assert not any(advice in str(err.value) for advice in ("weights_only", "allow_pickle", "pickle.load", "trust"))
    with pytest.raises(ModelError, match="no such file"):
        load_pretrained(cnn3d(), tmp_path / "absent.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ModelError, match="holds list, not a state dict"):
        load_pretrained(cnn3d(), tmp_path / "list.pt")


def test_freezing_everything_is_refused(tmp_path):
    torch.save(cnn3d().state_dict(), tmp_path / "net.pt")
    with pytest.raises(ModelError, match="froze every parameter: name the part to train in model.pretrained_exclude"):
        load_pretrained(cnn3d(), tmp_path / "net.pt", freeze=True)


@pytest.mark.slow
def test_fine_tuning_a_run_with_a_frozen_backbone_changes_only_the_head(tmp_path):
    common = [*QUICK_FIT, NO_PREFLIGHT, f"output.root={tmp_path}"]
    first = hslite.fit("quickstart", common)
    tuned = hslite.fit("quickstart", [*common, f"model.pretrained={first.best_checkpoint}",
                                      "model.pretrained_exclude=[fc]", "model.freeze_backbone=true"])  # fmt: skip
    before = torch.load(first.best_checkpoint, weights_only=True)["state_dict"]
    after = torch.load(tuned.best_checkpoint, weights_only=True)["state_dict"]
    backbone = [k for k in before if k.startswith("model.conv") and k.endswith("weight")]
    assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)
    assert not torch.equal(before["model.fc.weight"], after["model.fc.weight"])


def test_freezing_without_a_checkpoint_is_a_sentence_before_training(tmp_path):
    with pytest.raises(hslite.ConfigError, match="apply to a pretrained start: add model.pretrained=PATH"):
        hslite.fit("quickstart", [*QUICK_FIT, NO_PREFLIGHT, f"output.root={tmp_path}", "model.freeze_backbone=true"])
