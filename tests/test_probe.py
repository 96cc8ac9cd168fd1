"""Probe: timings, the compute model's fit, activation bytes against an analytic count, cache, threads, FSDP's cost."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from hslite.errors import ConfigError
from hslite.parallel.box import threads_per_process
from hslite.parallel.plan import Plan
from hslite.preflight_check.measure import feature_costs, step_timing
from hslite.preflight_check.measure import probe as probe_module
from hslite.preflight_check.measure.probe import ProbeOptions, ProbeTarget, probe_model
from hslite.preflight_check.measure.step_timing import TAIL_STEPS
from hslite.preflight_check.measurements import ProbeResult

D, H, C = 16, 32, 5


def linear_stack() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, C))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, D), torch.randint(0, C, (b,))


class Tokenized(nn.Module):
    """A stand-in for a band-group model: each of 4 groups of 2 inputs encoded to a token of 8 that a head reads."""

    BAND_GROUPS = True

    def __init__(self) -> None:
        super().__init__()
        self.band_groups = [(2 * g, 2 * g + 2) for g in range(4)]
        self.tokenizer = nn.Sequential(nn.Linear(2, 8), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8, C))

    def encode_group(self, x_group: torch.Tensor, group_index: int) -> torch.Tensor:
        return self.tokenizer(x_group)

    def group_parameters(self, group_index: int) -> list[nn.Parameter]:
        return []  # the tokenizer is shared by every group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.stack([self.encode_group(x[:, a:b], g) for g, (a, b) in enumerate(self.band_groups)], 1))


def test_tiny_mlp_probe_returns_sane_positive_numbers():
    result = probe_model(
        linear_stack, make_batch, ProbeTarget(batch_size=8, precision="32-true", threads=1), ProbeOptions(steps=3)
    )
    for name in ("forward_seconds", "backward_seconds", "optimizer_seconds", "data_seconds"):
        assert 0 < getattr(result, name) < 1, name
    assert result.param_count == D * H + H + H * H + H + H * C + C
    assert result.param_bytes == result.grad_bytes == 4 * result.param_count
    assert result.optimizer_bytes >= 2 * result.param_bytes  # AdamW: exp_avg + exp_avg_sq (+ step counters)
    assert result.peak_bytes == 2 * result.param_bytes + result.optimizer_bytes + result.activation_bytes
    assert result.threads == 1 and result.device == "cpu" and result.compress_seconds_per_byte is None
    assert ProbeResult.from_dict(result.to_dict()) == result


def test_the_compute_model_is_fitted_to_the_steps_timed_at_the_batch_and_at_half_of_it(monkeypatch):
    batches: list[int] = []

    def linear_in_batch(model, optimizer, batch, *args) -> list[float]:
        # A step whose forward and backward grow linearly with the batch: c0 = 3 ms, c1 = 60 µs per sample.
        b = batch[0].shape[0]
        batches.append(b)
        return [1e-3 + 2e-5 * b, 2e-3 + 4e-5 * b, 1e-4]

    monkeypatch.setattr(step_timing, "timed_step", linear_in_batch)
    result = probe_model(
        linear_stack,
        make_batch,
        ProbeTarget(batch_size=16, precision="32-true", threads=1),
        ProbeOptions(warmup=1, steps=3),
    )
    # Warm-up, then the timed steps at b, going on to TAIL_STEPS for the step-time distribution; then b/2.
    assert batches == [16] * (1 + TAIL_STEPS) + [8] * 4
    assert result.step_seconds_samples == [3e-3 + 6e-5 * 16 + 1e-4] * TAIL_STEPS
    assert (result.forward_seconds, result.backward_seconds) == (1e-3 + 2e-5 * 16, 2e-3 + 4e-5 * 16)
    assert result.optimizer_seconds == 1e-4 and result.batch_size == 16
    assert result.compute_c0_seconds == pytest.approx(3e-3)
    assert result.compute_c1_seconds_per_sample == pytest.approx(6e-5)


def test_every_timed_step_trains_on_a_batch_gathered_just_before_it_and_the_gathers_are_the_data_time(monkeypatch):
    # Training never steps on one batch twice: a reused batch stays in cache with the weights, which the gather of
    # the next batch would have evicted, and the probe priced one-device steps up to 20 % under what `fit` ran.
    gathered: list[int] = []
    stepped: list[int] = []
    latest: list[int] = []  # the last batch gathered when each step ran

    def counting_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(2e-3)  # a gather that costs something, so the data time is its own
        gathered.append(len(gathered))
        return torch.full((b, D), float(len(gathered) - 1)), torch.zeros(b, dtype=torch.long)

    def recording_step(model, optimizer, batch, *args) -> list[float]:
        stepped.append(int(batch[0][0, 0]))
        latest.append(len(gathered) - 1)
        return [1e-3, 2e-3, 1e-4]

    monkeypatch.setattr(step_timing, "timed_step", recording_step)
    result = probe_model(
        linear_stack,
        counting_batch,
        ProbeTarget(batch_size=16, precision="32-true", threads=1),
        ProbeOptions(warmup=1, steps=3),
    )
    warm_ups = (0, 1 + TAIL_STEPS)  # one at the batch, one at half of it
    timed = [i for i in range(len(stepped)) if i not in warm_ups]
    assert len(timed) == TAIL_STEPS + 3 and len({stepped[i] for i in timed}) == len(timed)
    assert all(stepped[i] == latest[i] for i in timed)
    # nothing gathered and left unstepped (a warm-up batch where there is none), but the batch the sizes count
    assert len(gathered) == len(stepped) + 1
    assert 2e-3 <= result.data_seconds < 0.1
    b = 8
    result = probe_model(
        linear_stack,
        make_batch,
        ProbeTarget(batch_size=b, precision="32-true", threads=1),
        ProbeOptions(warmup=0, steps=1),
    )
    # saved for backward: the input (b×D), both ReLU outputs (b×H each; the next Linear saves the same storage),
    # log-softmax output (b×C), the int64 targets and the loss's fp32 total-weight scalar. Weights are parameters.
    assert result.activation_bytes == 4 * b * (D + 2 * H + C) + 8 * b + 4


def test_cache_hit_measures_nothing_and_fresh_remeasures(own_cache, monkeypatch):
    calls = []
    measure = probe_module.measure_steps
    monkeypatch.setattr(probe_module, "measure_steps", lambda *a, **k: calls.append(1) or measure(*a, **k))
    target, options = (
        ProbeTarget(batch_size=8, precision="32-true", threads=1),
        ProbeOptions(steps=2, cache_key="tiny-mlp"),
    )
    first = probe_model(linear_stack, make_batch, target, options)
    assert probe_model(linear_stack, make_batch, target, options) == first
    assert len(calls) == 1
    probe_model(linear_stack, make_batch, target, replace(options, fresh=True))
    assert len(calls) == 2
    probe_model(linear_stack, make_batch, replace(target, batch_size=4), options)  # another key measures again
    assert len(calls) == 3


def test_threads_are_set_for_the_probe_and_restored():
    before = torch.get_num_threads()
    result = probe_model(
        linear_stack, make_batch, ProbeTarget(batch_size=4, precision="32-true", threads=1), ProbeOptions(steps=1)
    )
    assert result.threads == 1 and torch.get_num_threads() == before
    assert threads_per_process(Plan(devices=4), cores=2) == 1
    assert threads_per_process(Plan(devices=1), cores=2) == 2


def test_group_work_shares_token_size_and_compression_are_measured():
    result = probe_model(
        Tokenized,
        make_batch,
        ProbeTarget(batch_size=8, precision="32-true", threads=1),
        ProbeOptions(steps=1, band_group_sizes=[2] * 4, measure_compression=True),
    )
    assert 0 < result.chag_fraction < 1 and 0 < result.tokenizer_activation_fraction < 1
    assert result.group_token_bytes_per_sample == 4 * 8 * 4  # G × D fp32 elements
    assert result.band_groups == 4 and result.compress_seconds_per_byte > 0
    with pytest.raises(ConfigError, match="has no encode_group method"):
        probe_model(
            linear_stack,
            make_batch,
            ProbeTarget(batch_size=4, precision="32-true"),
            ProbeOptions(steps=1, band_group_sizes=[2] * 4),
        )


def test_16_mixed_on_cpu_is_timed_as_lightning_runs_it_there_as_bf16_without_a_loss_scaler(monkeypatch):
    scalers = []

    def recording_step(model, optimizer, batch, precision, dev, step, scaler=None) -> list[float]:
        scalers.append(scaler)
        return [1e-3, 2e-3, 1e-4]

    monkeypatch.setattr(step_timing, "timed_step", recording_step)
    probe_model(
        linear_stack,
        make_batch,
        ProbeTarget(batch_size=8, precision="16-mixed", threads=1),
        ProbeOptions(warmup=1, steps=1),
    )
    assert scalers and scalers == [None] * len(scalers)
    monkeypatch.undo()
    real = probe_model(
        linear_stack,
        make_batch,
        ProbeTarget(batch_size=4, precision="16-mixed", threads=1),
        ProbeOptions(warmup=0, steps=1),
    )
    assert real.precision == "16-mixed" and real.optimizer_seconds > 0


def test_bf16_autocast_probe_runs_and_bad_precision_is_refused():
    result = probe_model(
        linear_stack, make_batch, ProbeTarget(batch_size=4, precision="bf16-mixed", threads=1), ProbeOptions(steps=1)
    )
    assert result.precision == "bf16-mixed" and result.forward_seconds > 0
    with pytest.raises(ConfigError, match="precision must be one of"):
        probe_model(linear_stack, make_batch, ProbeTarget(batch_size=4, precision="fp8"))


@pytest.mark.slow
def test_cpu_ranks_contention_is_measured_with_the_ranks_stepping_at_once():
    result = probe_model(
        linear_stack,
        make_batch,
        ProbeTarget(batch_size=8, precision="32-true", threads=1, concurrent_ranks=2),
        ProbeOptions(steps=2),
    )
    assert result.contention >= 1 and result.contention_ranks == 2  # never faster than alone
    assert ProbeResult.from_dict(result.to_dict()) == result
    alone = probe_model(
        linear_stack, make_batch, ProbeTarget(batch_size=8, precision="32-true", threads=1), ProbeOptions(steps=1)
    )
    assert alone.contention is None and alone.contention_ranks == 1


def test_fsdp_overhead_is_measured_on_a_one_rank_group_and_priced_per_micro_step():
    from hslite.models import get_model
    from hslite.preflight_check.measurements import LinkModel
    from hslite.preflight_check.price import costmodel

    def factory() -> nn.Module:
        return get_model("cnn1d", in_bands=32, num_classes=4, patch_size=1)

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 32, 1, 1), torch.randint(0, 4, (b,))

    result = probe_model(
        factory, batch, ProbeTarget(batch_size=16, precision="32-true"), ProbeOptions(measure_fsdp=True)
    )
    assert result.fsdp_units == 2  # fc_hidden and the root
    assert result.fsdp_micro_overhead_seconds is not None and result.fsdp_optimizer_overhead_seconds is not None
    assert not torch.distributed.is_initialized()  # the probe's one-rank group is gone again
    fixed = ProbeResult.from_dict({**result.to_dict(), "fsdp_micro_overhead_seconds": 0.01,
                                   "fsdp_optimizer_overhead_seconds": 0.02,
                                   "step_seconds_samples": None})  # fmt: skip  # no straggler tail: overhead alone
    link = LinkModel(1e-4, 1e12)
    plain = costmodel.predict(Plan(devices=2, batch_size=16, accumulate=2), fixed, link, 2**34)
    sharded = costmodel.predict(Plan(devices=2, batch_size=16, accumulate=2, fsdp=True), fixed, link, 2**34)
    assert sharded.compute_seconds - plain.compute_seconds == pytest.approx(
        (2 * 0.01 + 0.02 - fixed.optimizer_seconds / 2) * sharded.oversubscription, rel=1e-6
    )


def test_fsdp_overhead_is_the_sharded_steps_time_beyond_the_plain_steps(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from hslite.models import get_model

    timed_models: list[nn.Module] = []

    def sharded_step(model, *args) -> list[float]:
        timed_models.append(model)
        return [0.010, 0.020, 0.005]  # forward, backward, optimiser: each slower than the plain step's below

    def factory() -> nn.Module:
        return get_model("cnn1d", in_bands=32, num_classes=4, patch_size=1)

    monkeypatch.setattr(feature_costs, "timed_step", sharded_step)
    plain = ProbeResult(
        forward_seconds=0.004, backward_seconds=0.006, optimizer_seconds=0.001, data_seconds=0.0, batch_size=4,
        precision="32-true", threads=1, device="cpu", param_count=0, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
        activation_bytes=0, peak_bytes=0, compute_c0_seconds=0.0, compute_c1_seconds_per_sample=0.0,
    )  # fmt: skip
    batch = (torch.randn(4, 32, 1, 1), torch.randint(0, 4, (4,)))
    micro, optimizer = feature_costs.measure_fsdp_overhead(factory, batch, plain, warmup=1, steps=3)
    assert micro == pytest.approx(0.030 - 0.010) and optimizer == pytest.approx(0.005 - 0.001)
    assert len(timed_models) == 4 and all(isinstance(m, FSDPModule) for m in timed_models)  # FSDP's step is timed
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_ddp_and_fsdp_are_timed_with_the_plans_ranks_stepping_together_and_priced_from_it():
    from hslite.models import get_model
    from hslite.preflight_check.measurements import LinkModel
    from hslite.preflight_check.price import costmodel

    def factory() -> nn.Module:
        return get_model("cnn1d", in_bands=32, num_classes=4, patch_size=1)

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 32, 1, 1), torch.randint(0, 4, (b,))

    result = probe_model(
        factory,
        batch,
        ProbeTarget(batch_size=16, precision="32-true", threads=1, concurrent_ranks=2),
        ProbeOptions(measure_fsdp=True),
    )
    assert result.fsdp_together_seconds is not None and result.ddp_together_seconds is not None
    synced, accumulated, ddp_optimizer = result.ddp_together_seconds
    micro, optimizer = result.fsdp_together_seconds
    assert all(0 < seconds < 1 for seconds in (synced, accumulated, ddp_optimizer, micro, optimizer))
    link = LinkModel(1e-4, 1e9)  # the measurements hold the collectives: the link no longer prices them
    data = result.data_seconds
    sharded = costmodel.predict(Plan(devices=2, batch_size=16, accumulate=2, fsdp=True), result, link, 2**34)
    assert sharded.comm_seconds == 0.0
    assert sharded.compute_seconds == pytest.approx(2 * (micro + data) + optimizer)
    assert any("2 ranks stepping together" in note for note in sharded.notes)
    ddp = costmodel.predict(Plan(devices=2, batch_size=16, accumulate=3), result, link, 2**34)
    assert ddp.compute_seconds == pytest.approx(2 * (accumulated + data) + synced + data + ddp_optimizer)
    # Another rank count or a compressed all-reduce than was timed: priced from the parts and the ring formulas
    assert costmodel.predict(Plan(devices=4, batch_size=16), result, link, 2**34).comm_seconds > 0
    assert costmodel.predict(Plan(devices=2, batch_size=16, compression="bf16"), result, link, 2**34).comm_seconds > 0


@pytest.mark.slow
def test_channel_groups_are_timed_with_the_ranks_stepping_together_as_the_strategy_runs_them():
    from hslite.models import get_model
    from hslite.preflight_check.measurements import LinkModel
    from hslite.preflight_check.price import costmodel

    def factory() -> nn.Module:
        return get_model("channel_vit", in_bands=32, num_classes=4, patch_size=3)

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 32, 3, 3), torch.randint(0, 4, (b,))

    sizes = [stop - start for start, stop in factory().band_groups]
    result = probe_model(
        factory,
        batch,
        ProbeTarget(batch_size=8, precision="32-true", threads=1, concurrent_ranks=2, rotation_groups=2),
        ProbeOptions(band_group_sizes=sizes),
    )
    assert result.chag_together_seconds is not None and set(result.chag_together_seconds) == {"2"}
    assert result.chag_together_rotation == 2  # timed with the plan's rotation of 2 of the 4 groups
    micro, optimizer = result.chag_together_seconds["2"]
    assert 0 < micro < 1 and 0 < optimizer < 1
    link = LinkModel(1e-4, 1e9)
    priced = costmodel.predict(Plan(devices=2, chag=2, batch_size=8, rotation_groups=2), result, link, 2**34)
    assert priced.compute_seconds == pytest.approx(micro + result.data_seconds + optimizer) and priced.comm_seconds == 0
    # Without that rotation, or accumulated, the layout was not timed: priced from the parts
    for plan in (Plan(devices=2, chag=2, batch_size=8), Plan(devices=2, chag=2, batch_size=8, accumulate=2,
                                                            rotation_groups=2)):  # fmt: skip
        assert costmodel.predict(plan, result, link, 2**34).comm_seconds > 0


def test_a_plans_probe_target_is_one_of_its_ranks():
    gpu = ProbeTarget.of_plan(Plan(devices=4, accelerator="gpu", batch_size=32, precision="bf16-mixed", tf32=False))
    assert (gpu.device, gpu.threads, gpu.concurrent_ranks) == (probe_module.PROBE_DEVICE, None, 1)
    assert (gpu.batch_size, gpu.precision, gpu.tf32, gpu.cudnn_benchmark) == (32, "bf16-mixed", False, True)
    cpu = ProbeTarget.of_plan(Plan(devices=2, batch_size=16, rotation_groups=2, chag=1))
    assert (cpu.device, cpu.threads, cpu.concurrent_ranks) == ("cpu", threads_per_process(Plan(devices=2)), 2)
    assert cpu.rotation_groups == 2
