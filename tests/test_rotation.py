"""Channel-subset rotation: the schedule's coverage and agreement, and what inactive groups are spared."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hslite.errors import ConfigError
from hslite.models import get_model
from hslite.models.band_groups import contiguous_band_groups
from hslite.parallel.channels.group_owners import rank_groups
from hslite.parallel.channels.rotation import RotationSchedule, check_rotation


def _schedule(groups: int, active: int, seed: int = 0, chag: int = 1) -> RotationSchedule:
    return RotationSchedule(contiguous_band_groups(4 * groups, groups), active, seed, chag)


@pytest.mark.parametrize("groups, active, chag", [(4, 2, 1), (4, 1, 1), (5, 2, 1), (8, 3, 1), (8, 4, 2), (8, 2, 2)])
def test_every_group_is_active_in_every_cycle_of_ceil_g_over_k_steps(groups, active, chag):
    schedule = _schedule(groups, active, chag=chag)
    cycle = math.ceil(groups / active)
    assert schedule.steps_per_cycle == cycle
    for start in range(0, 10 * cycle, cycle):
        seen = [schedule.active_groups(step) for step in range(start, start + cycle)]
        assert all(len(step) == active and len(set(step)) == active for step in seen)
        assert set().union(*seen) == set(range(groups))
    for step in range(20):  # each channel-group rank encodes the same number of its own groups
        active_groups = set(schedule.active_groups(step))
        assert all(len(active_groups & set(owned)) == active // chag for owned in schedule.owners)
    assert schedule.owners == rank_groups([4] * groups, chag)  # the groups each rank owns under channel groups


def test_the_schedule_is_the_same_on_every_rank_and_follows_the_seed():
    a, b, other = _schedule(8, 2, seed=7), _schedule(8, 2, seed=7), _schedule(8, 2, seed=8)
    steps = range(40)
    assert [a.active_groups(s) for s in steps] == [b.active_groups(s) for s in steps]  # no communication needed
    assert [a.active_groups(s) for s in steps] != [other.active_groups(s) for s in steps]
    assert len({tuple(a.active_groups(s)) for s in steps}) > 4  # it rotates, not a fixed subset


def test_rotation_settings_that_cannot_work_are_config_errors():
    check_rotation(4, 2, 2)
    with pytest.raises(ConfigError, match="between 1 and 3: the model has 4 band groups"):
        check_rotation(4, 4)
    with pytest.raises(ConfigError, match=r"multiple of parallel.chag=2.*one of \[2, 4, 6\]"):
        check_rotation(8, 3, 2)


def _groups_params(model: nn.Module, group: int) -> dict[str, nn.Parameter]:
    """Every parameter of band group `group`'s own: its band embeddings, query, spectrum projection, group embedding."""
    prefixes = [f"{name}.{group}" for name in ("band_embeddings", "group_queries", "group_spectra", "group_embeddings")]
    own = {
        name: p
        for name, p in model.named_parameters()
        if any(name.split(".")[:2] == pre.split(".") for pre in prefixes)
    }
    assert len(own) == 5  # the projection has a weight and a bias
    return own


def test_inactive_groups_get_no_gradient_and_keep_their_optimiser_state():
    torch.manual_seed(0)
    model = get_model("channel_vit", in_bands=16, num_classes=3, patch_size=3, num_groups=4)
    schedule = RotationSchedule(model.band_groups, 2, seed=0)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(6, 16, 3, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    for step in range(4):
        active = schedule.active_groups(step)
        inactive = [g for g in range(4) if g not in active]
        before = {
            name: (p.detach().clone(), copy.deepcopy(optimiser.state.get(p)))
            for g in inactive
            for name, p in _groups_params(model, g).items()
        }
        nn.functional.cross_entropy(schedule.forward(model, x, active), y).backward()
        for g in inactive:
            assert all(p.grad is None for p in _groups_params(model, g).values())
        for g in active:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in _groups_params(model, g).values())
        optimiser.step()
        optimiser.zero_grad()
        for g in inactive:
            for name, p in _groups_params(model, g).items():
                value, state = before[name]
                assert torch.equal(p.detach(), value), f"{name} moved while inactive (weight decay or momentum)"
                after = optimiser.state.get(p)
                assert (state is None and not after) or all(torch.equal(state[k], after[k]) for k in state), name


def test_models_without_groups_see_inactive_bands_zeroed_and_the_rest_rescaled():
    class Probe(nn.Module):
        def forward(self, x):
            self.seen = x
            return x.mean(dim=(2, 3))

    schedule = RotationSchedule([(0, 2), (2, 5), (5, 6)], 1, seed=0)
    x = torch.ones(2, 6, 3, 3)
    probe = Probe()
    schedule.forward(probe, x, [1])
    assert probe.seen[0, :, 0, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 2.0, 0.0]  # 6 bands / 3 active


def test_a_recipe_sets_g_for_band_group_models_and_for_the_masks_of_the_others():
    from hslite.recipe.build import band_groups_for, build_model, prepared_datamodule
    from hslite.recipe.config import load_config

    vit = load_config("quickstart", ["model.name=channel_vit", "model.band_groups=8", "data.patch_size=3"])
    datamodule = prepared_datamodule(vit)
    model = build_model(vit, datamodule)
    assert len(model.band_groups) == 8 and band_groups_for(vit, datamodule, model) == model.band_groups
    cnn = load_config("quickstart", ["model.band_groups=3"])
    assert len(band_groups_for(cnn, datamodule, build_model(cnn, datamodule))) == 3
    default = load_config("quickstart")
    assert len(band_groups_for(default, datamodule, build_model(default, datamodule))) == 4


@pytest.mark.parametrize(
    ("groups", "active", "chag", "count"), [(4, 2, 1, 6), (4, 1, 1, 4), (8, 4, 2, 6), (8, 4, 1, 16)]
)  # C(G, k) subsets, C(G/chag, k/chag) under chag, at most 16
def test_evaluation_averages_over_the_subsets_training_draws(groups, active, chag, count):
    schedule = _schedule(groups, active, chag=chag)
    subsets = schedule.evaluation_subsets()
    assert len(subsets) == count and len({tuple(s) for s in subsets}) == count
    drawn = {tuple(schedule.active_groups(step)) for step in range(2000)}
    assert {tuple(s) for s in subsets} <= drawn  # only subsets training can draw: under chag, k/chag per rank


@pytest.mark.slow
def test_rotation_trains_as_well_as_every_band_on_unseen_blocks(tmp_path):
    """Parity of accuracy: 2 of 4 groups per step against all 4, same recipe, split and seed, on spatially disjoint
    blocks. Evaluated with all 4 groups at once, which its across-group attention never saw in training, the rotating
    model scored 21 % against 54 %: what indian_pines_1gpu_rotation showed on disjoint blocks (14 % against an SVM's
    70 %). Evaluated as the ensemble of the pairs it trained on, 54 %."""
    from hslite.recipe.config import load_config
    from hslite.run.fit import fit

    base = ["data.scene=synthetic_tiny", "data.patch_size=3", "data.split=disjoint", "data.train_fraction=0.4",
            "data.val_fraction=0.2", "train.max_epochs=40", "train.class_weights=false", "train.progress=false",
            "output.save_map=false", "output.save_checkpoint=false", "preflight.enabled=false",
            f"output.root={tmp_path}"]  # fmt: skip
    oa = {k: fit(load_config("indian_pines_1gpu_rotation", [*base, f"parallel.rotation_groups={k}"])).metrics["OA"]
          for k in (0, 2)}  # fmt: skip
    assert oa[0] > 0.4, oa  # 4 classes: the model learns the scene at all
    assert oa[2] > oa[0] - 0.1, oa


@pytest.mark.filterwarnings("ignore::rasterio.errors.NotGeoreferencedWarning")  # synthetic_tiny has no georeference
def test_predict_maps_a_rotation_run_as_fit_evaluated_it(tmp_path):
    """`hslite predict` calls the model as fit's evaluation did (the subsets' ensemble), so its map is the run's own."""
    import numpy as np
    import rasterio

    from hslite.cli import main

    args = ["recipe=indian_pines_1gpu_rotation", "data.scene=synthetic_tiny", "data.patch_size=3",
            "train.max_epochs=3", "train.progress=false", "output.save_map=true", "preflight.enabled=false",
            f"output.root={tmp_path}"]  # fmt: skip
    assert main(["fit", *args]) == 0
    (run,) = (tmp_path / "indian_pines_1gpu_rotation").iterdir()
    assert main(["predict", f"run={run}", "progress=false"]) == 0
    (out,) = (run / "predict").iterdir()
    with rasterio.open(run / "prediction.tif") as ours, rasterio.open(out / "prediction.tif") as theirs:
        np.testing.assert_array_equal(ours.read(), theirs.read())
