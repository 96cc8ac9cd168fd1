"""The three verdicts a team with an 8-GPU box meets, each shown by a shipped recipe priced from device profiles.

Foundation-size channel ViTs (ViT-L to ViT-e) are counted on fake tensors, so pricing a 4 B-parameter model takes
seconds and no memory here (`preflight.fake_tensors`). The synthetic stand-in has Indian Pines' bands and classes.
"""

from __future__ import annotations

import pytest

from hslite import api

STAND_IN = ["data.scene=synthetic_indian_pines", "preflight.fresh=false"]


def _verdict(recipe: str, device: str, topology: str):
    return api.preflight(recipe, [*STAND_IN, f"preflight.device={device}", f"preflight.topology={topology}"])


@pytest.mark.slow
def test_vit_l_on_nvlink_data_parallelism_pays():
    verdict = _verdict("indian_pines_vit_l_8gpu", "h100_sxm", "nvlink_8")
    assert verdict.go and verdict.efficiency >= 0.5 and verdict.requested.dp == 8
    assert verdict.predictions[verdict.requested].fits_memory


@pytest.mark.slow
def test_vit_l_with_a_wide_context_needs_channel_groups():
    verdict = _verdict("indian_pines_vit_l_wide_8gpu", "rtx_4090", "pcie4_8")
    assert not verdict.go and any("activations dominate" in reason for reason in verdict.reasons)
    better = verdict.better_plan
    assert better is not None and better.chag_enabled and better.world_size == 8
    # accumulation alone cannot make it fit: no plain-DP layout of this global batch fits a 24 GB card
    plain = [p for p in verdict.predictions if not p.chag_enabled and not p.fsdp and p.world_size == 8]
    assert plain and not any(verdict.predictions[p].fits_memory for p in plain)


@pytest.mark.slow
def test_vit_e_on_40gb_cards_needs_fsdp():
    verdict = _verdict("indian_pines_vit_e_8gpu", "a100_40gb", "nvlink_8")
    assert not verdict.go and any("shard them with FSDP" in reason for reason in verdict.reasons)
    better = verdict.better_plan
    assert better is not None and better.fsdp and verdict.predictions[better].fits_memory
    assert verdict.best_single.world_size > 1  # no single card holds the model: E against the fewest that do
    states = verdict.to_dict()["requested_prediction"]["memory_breakdown_bytes"]
    assert states["params"] + states["grads"] + states["optimizer"] > 40 * 2**30  # beyond a card before activations
