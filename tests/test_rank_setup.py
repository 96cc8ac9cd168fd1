"""What every rank sets for itself on a GPU: cuBLAS's fixed workspace under train.deterministic (torch raises at the
first cuBLAS call without it), and no cuDNN kernel timing then, in the plan the probe prices as in the ranks."""

from __future__ import annotations

import os

import torch

from hslite.parallel.ranks.rank_setup import CUBLAS_WORKSPACE, set_deterministic
from hslite.recipe.build import plan_from_config
from hslite.recipe.config import load_config


def test_deterministic_ranks_fix_cublas_workspace_before_any_cublas_call(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        set_deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        set_deterministic(False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own choice is kept
    set_deterministic(True)
    set_deterministic(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_deterministic_plan_does_not_time_cudnn_kernels():
    assert plan_from_config(load_config("quickstart")).cudnn_benchmark
    plan = plan_from_config(load_config("quickstart", ["train.deterministic=true"]))
    assert not plan.cudnn_benchmark and plan.tf32
