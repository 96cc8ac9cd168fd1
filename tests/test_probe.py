"""Probe: sane timings for a tiny MLP, activation bytes against an analytic count, cache and threads."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from hslite.errors import ConfigError
from hslite.parallel.plan import Plan, threads_per_process
from hslite.preflight import probe as probe_module
from hslite.preflight.measurements import ProbeResult
from hslite.preflight.probe import probe_model

D, H, C = 16, 32, 5


def linear_stack() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, C))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, D), torch.randint(0, C, (b,))


class Tokenized(nn.Module):
    """A stand-in for a channel-group model: a tokenizer whose output (b × G × D) feeds a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = nn.Sequential(nn.Linear(D, 4 * 8), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokenizer(x).view(-1, 4, 8))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_tiny_mlp_probe_returns_sane_positive_numbers():
    result = probe_model(linear_stack, make_batch, batch_size=8, precision="32-true", threads=1, steps=3)
    for name in ("forward_seconds", "backward_seconds", "optimizer_seconds", "data_seconds"):
        assert 0 < getattr(result, name) < 1, name
    assert result.param_count == D * H + H + H * H + H + H * C + C
    assert result.param_bytes == result.grad_bytes == 4 * result.param_count
    assert result.optimizer_bytes >= 2 * result.param_bytes  # AdamW: exp_avg + exp_avg_sq (+ step counters)
    assert result.peak_bytes == 2 * result.param_bytes + result.optimizer_bytes + result.activation_bytes
    assert result.compute_c0_seconds >= 0 and result.compute_c1_seconds_per_sample >= 0
    assert result.threads == 1 and result.device == "cpu" and result.compress_seconds_per_byte is None
    assert ProbeResult.from_dict(result.to_dict()) == result


def test_activation_bytes_match_an_analytic_count_for_a_linear_stack():
    b = 8
    result = probe_model(linear_stack, make_batch, batch_size=b, precision="32-true", threads=1, warmup=0, steps=1)
    # saved for backward: the input (b×D), both ReLU outputs (b×H each; the next Linear saves the same storage),
    # log-softmax output (b×C), the int64 targets and the loss's fp32 total-weight scalar. Weights are parameters.
    assert result.activation_bytes == 4 * b * (D + 2 * H + C) + 8 * b + 4


def test_cache_hit_is_fast_and_fresh_remeasures(cache_dir, monkeypatch):
    calls = []
    measure = probe_module._measure
    monkeypatch.setattr(probe_module, "_measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    kwargs = dict(batch_size=8, precision="32-true", threads=1, steps=2, cache_key="tiny-mlp")
    first = probe_model(linear_stack, make_batch, **kwargs)
    start = time.monotonic()
    assert probe_model(linear_stack, make_batch, **kwargs) == first
    assert time.monotonic() - start < 0.2 and len(calls) == 1
    probe_model(linear_stack, make_batch, fresh=True, **kwargs)
    assert len(calls) == 2
    probe_model(linear_stack, make_batch, **{**kwargs, "batch_size": 4})  # another key measures again
    assert len(calls) == 3


def test_threads_are_set_for_the_probe_and_restored():
    before = torch.get_num_threads()
    result = probe_model(linear_stack, make_batch, batch_size=4, precision="32-true", threads=1, steps=1)
    assert result.threads == 1 and torch.get_num_threads() == before
    assert threads_per_process(Plan(devices=4), cores=2) == 1
    assert threads_per_process(Plan(devices=1), cores=2) == 2


def test_tokenizer_shares_token_size_and_compression_are_measured():
    result = probe_model(
        Tokenized, make_batch, batch_size=8, precision="32-true", threads=1, steps=1,
        tokenizer_modules=("tokenizer",), band_group_sizes=[8] * 4, measure_compression=True,
    )  # fmt: skip
    assert 0 < result.chag_fraction < 1 and 0 < result.tokenizer_activation_fraction < 1
    assert result.group_token_bytes_per_sample == 4 * 8 * 4  # G × D fp32 elements
    assert result.band_groups == 4 and result.compress_seconds_per_byte > 0
    nested = probe_model(Tokenized, make_batch, batch_size=8, precision="32-true", threads=1, steps=1,
                         tokenizer_modules=("tokenizer.0", "tokenizer"))  # fmt: skip
    assert nested.group_token_bytes_per_sample == 4 * 8 * 4 and 0 < nested.chag_fraction < 1
    with pytest.raises(ConfigError, match="are not submodules"):
        probe_model(Tokenized, make_batch, batch_size=4, precision="32-true", steps=1, tokenizer_modules=("nope",))


def test_bf16_autocast_probe_runs_and_bad_precision_is_refused():
    result = probe_model(linear_stack, make_batch, batch_size=4, precision="bf16-mixed", threads=1, steps=1)
    assert result.precision == "bf16-mixed" and result.forward_seconds > 0
    with pytest.raises(ConfigError, match="precision must be one of"):
        probe_model(linear_stack, make_batch, batch_size=4, precision="fp8")


def test_cpu_ranks_contention_is_measured_with_the_ranks_stepping_at_once():
    result = probe_model(linear_stack, make_batch, batch_size=8, precision="32-true", threads=1, steps=2,
                         concurrent_ranks=2)  # fmt: skip
    assert result.contention >= 1 and result.contention_ranks == 2  # never faster than alone
    assert ProbeResult.from_dict(result.to_dict()) == result
    alone = probe_model(linear_stack, make_batch, batch_size=8, precision="32-true", threads=1, steps=1)
    assert alone.contention is None and alone.contention_ranks == 1


def test_fsdp_overhead_is_measured_on_a_one_rank_group_and_priced_per_micro_step():
    from hslite.models import get_model
    from hslite.preflight import costmodel
    from hslite.preflight.measurements import LinkModel

    def factory() -> nn.Module:
        return get_model("cnn1d", in_bands=32, num_classes=4, patch_size=1)

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 32, 1, 1), torch.randint(0, 4, (b,))

    result = probe_model(factory, batch, batch_size=16, precision="32-true", measure_fsdp=True)
    assert result.fsdp_units == 2  # fc_hidden and the root
    assert result.fsdp_micro_overhead_seconds >= 0 and result.fsdp_optimizer_overhead_seconds >= 0
    assert not torch.distributed.is_initialized()  # the probe's one-rank group is gone again
    fixed = ProbeResult.from_dict({**result.to_dict(), "fsdp_micro_overhead_seconds": 0.01,
                                   "fsdp_optimizer_overhead_seconds": 0.02})  # fmt: skip
    link = LinkModel(1e-4, 1e12)
    plain = costmodel.predict(Plan(devices=2, batch_size=16, accumulate=2), fixed, link, 2**34)
    sharded = costmodel.predict(Plan(devices=2, batch_size=16, accumulate=2, fsdp=True), fixed, link, 2**34)
    assert sharded.compute_seconds - plain.compute_seconds == pytest.approx(
        (2 * 0.01 + 0.02 - fixed.optimizer_seconds / 2) * sharded.oversubscription, rel=1e-6
    )
