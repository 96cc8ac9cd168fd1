"""The int8 error-feedback all-reduce hook: layout and bytes formulas, residual bookkeeping, and multi-rank checks.

The multi-rank checks run tests/_dist_scripts/hook_checks.py in a subprocess (forked gloo ranks, one thread each,
60 s collective timeout) once per world size, and assert on the measurements it returns.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_scripts._ranks import FakeBucket
from torch import nn

from hslite.errors import ConfigError
from hslite.parallel.compression.hook import (
    _clock,
    int8_hook,
)
from hslite.parallel.compression.state import CompressionState
from hslite.parallel.wire_format import shard_layout, wire_bytes

SCRIPTS = Path(__file__).parent / "_dist_scripts"


def test_wire_bytes_follows_the_scheme():
    shard, chunk, chunks = shard_layout(1_000_000, 4, 2048)
    assert (shard, chunk, chunks) == (123 * 2033, 2033, 123)  # 250 000 per rank in 123 balanced chunks
    assert wire_bytes(1_000_000, 4, "int8", 2048) == 2 * 3 * (123 * 2033 + 4 * 123)
    assert wire_bytes(1_000_000, 4, "none") == 2 * 3 * 250_000 * 4
    assert wire_bytes(1_000_000, 4, "bf16") == wire_bytes(1_000_000, 4, "fp16") == 2 * 3 * 250_000 * 2
    assert wire_bytes(1_000_000, 1, "int8") == 0


@pytest.mark.parametrize("numel", [1, 100, 2049, 5000, 250_013, 1_000_000])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_padding_stays_below_one_element_per_chunk_and_rank(numel, world):
    shard, chunk, chunks = shard_layout(numel, world, 2048)
    assert shard == chunk * chunks and chunk <= 2048
    assert 0 <= world * shard - numel < world * chunks


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="chunk_elems"):
        CompressionState(chunk_elems=0)
    with pytest.raises(ConfigError, match="unknown gradient compression 'fp8'; use one of none, int8, bf16, fp16"):
        CompressionState().set_kind("fp8")


def _model_and_state():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # parameters of 12, 4, 8, 2 elements
    state = CompressionState()
    state.bind(model)
    return list(model.parameters()), state


def test_residuals_follow_parameters_when_ddp_rebuilds_buckets():
    (w0, b0, w1, b1), state = _model_and_state()
    # DDP's first step: one bucket with every parameter. Its residual is one flat tensor.
    first = torch.arange(26, dtype=torch.float32)
    state._keep_residual(FakeBucket(torch.zeros(26), [w0, b0, w1, b1], index=0), first)
    pieces = dict(zip(("w0", "b0", "w1", "b1"), first.split([12, 4, 8, 2]), strict=True))
    # Rebuilt layout: same index 0 with other parameters, in another order, then the rest in bucket 1.
    got0 = state._take_residual(FakeBucket(torch.zeros(10), [b1, w1], index=0))
    assert torch.equal(got0, torch.cat([pieces["b1"], pieces["w1"]]))
    got1 = state._take_residual(FakeBucket(torch.zeros(16), [w0, b0], index=1))
    assert torch.equal(got1, torch.cat([pieces["w0"], pieces["b0"]]))
    assert state._take_residual(FakeBucket(torch.zeros(16), [w0, b0], index=1)) is None  # taken, not copied


def test_residuals_checkpoint_by_parameter_name():
    (w0, b0, w1, b1), state = _model_and_state()
    state._keep_residual(FakeBucket(torch.zeros(10), [b1, w1], index=0), torch.randn(10))
    state._keep_residual(FakeBucket(torch.zeros(16), [w0, b0], index=1), torch.randn(16))
    state.set_kind("bf16")
    saved = state.state_dict()
    assert sorted(saved["residuals"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    (w0_, b0_, w1_, b1_), restored = _model_and_state()
    restored.load_state_dict(saved)
    assert restored.kind == "bf16"
    # A resumed DDP starts again from one bucket holding everything.
    flat = restored._take_residual(FakeBucket(torch.zeros(26), [w0_, b0_, w1_, b1_], index=0))
    expected = [saved["residuals"][n] for n in ("0.weight", "0.bias", "1.weight", "1.bias")]
    assert torch.equal(flat, torch.cat(expected))


def test_unbound_residuals_refuse_to_checkpoint():
    state = CompressionState()
    state._keep_residual(FakeBucket(torch.zeros(3), [torch.empty(3)]), torch.ones(3))
    with pytest.raises(RuntimeError, match="bind"):
        state.state_dict()


def test_the_quantise_clock_records_events_on_the_buckets_gpu_and_reads_them_once(monkeypatch):
    recorded, waited = [], []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream):
            recorded.append(stream)

        def synchronize(self):
            waited.append(self)

        def elapsed_time(self, end):
            return 250.0  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("a host stall per bucket"))
    assert isinstance(_clock(torch.device("cpu")), float) and recorded == []
    state = CompressionState()
    state.add_quantise_time(_clock(torch.device("cuda:1")), _clock(torch.device("cuda:1")))
    assert recorded == ["stream of cuda:1"] * 2 and waited == []  # perf_counter alone would time kernel launches
    assert state.quantise_seconds == 0.25 and len(waited) == 1  # read when the total is asked for
    assert state.quantise_seconds == 0.25 and len(waited) == 1


def test_the_quantise_timer_leaves_the_collectives_out_and_the_cpu_unsynchronised(monkeypatch):
    # One rank of two, its peer's messages faked as copies of its own (numerically meaningless); each collective
    # takes 0.2 s.
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronised.append(device))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def all_to_all_single(output, inputs, group=None):
        time.sleep(0.2)
        output.copy_(inputs)

    def all_gather(output, inputs, group=None):
        time.sleep(0.2)
        output.view(2, -1).copy_(inputs.expand(2, -1))

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(dist, "all_gather_single", all_gather)
    state = CompressionState()
    int8_hook(state, FakeBucket(torch.linspace(-1, 1, 10_000), [torch.empty(10_000)])).wait()
    assert state.calls["int8"] == 1 and 0 < state.quantise_seconds < 0.2 and synchronised == []


@pytest.fixture(
    scope="module", params=[pytest.param(2, id="2ranks"), pytest.param(4, id="4ranks", marks=pytest.mark.slow)]
)
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("hook") / "ranks.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "hook_checks.py"), str(request.param), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_one_hooked_allreduce_is_within_the_int8_bound(ranks):
    for rank in ranks:
        # The bound is derived from the scales (see one_step_bound); a ratio near 1 shows it is tight, not loose.
        assert rank["one_step"]["max_error_over_bound"] <= 1.0 + 1e-4
        assert rank["one_step"]["max_error_over_bound"] > 0.3
    assert len({rank["one_step"]["checksum"] for rank in ranks}) == 1  # every rank applies the same update


@pytest.mark.distributed
def test_error_feedback_keeps_the_sum_of_updates_within_one_step_of_error(ranks):
    for rank in ranks:
        ef, no_ef = rank["error_feedback"]["ef"], rank["error_feedback"]["no_ef"]
        # With feedback the gap is the current residual: one step's bound, measured from that step's gradients
        # (+10 % because the residual itself slightly enlarges the scales it is quantised with).
        assert max(ef["drift_over_bound"]) <= 1.1
        # Without it the sub-quantum constant is never sent and the gap grows with every step.
        steps = len(no_ef["drift"])
        assert no_ef["drift_over_bound"][-1] >= 5
        assert no_ef["drift"][-1] >= 3 * no_ef["drift"][steps // 4]
        assert ef["drift"][-1] <= no_ef["drift"][-1] / 5


@pytest.mark.distributed
def test_an_overflow_reaches_every_rank_and_does_not_poison_the_residual(ranks):
    for rank in ranks:
        assert rank["non_finite"] == {
            "first_chunk_finite": False,  # the whole chunk holding the inf is non-finite: AMP's scaler skips the step
            "other_chunks_finite": True,
            "residual_finite": True,
            "residual_nonzero": True,  # only the poisoned chunk's residual is reset
        }


@pytest.mark.distributed
def test_bytes_counted_on_the_collectives_match_wire_bytes(ranks):
    for rank in ranks:
        for row in rank["wire_bytes"]["rows"]:
            assert row["counted"] == row["stats"] == row["formula"], row
            if row["numel"] >= 1000:
                assert row["fp32_ring"] / row["counted"] >= 3.5, row


@pytest.mark.distributed
def test_real_ddp_with_several_buckets_agrees_with_plain_ddp(ranks):
    for rank in ranks:
        ddp = rank["ddp"]
        assert ddp["buckets_per_step"][0] == 1  # DDP's first step: one bucket with every parameter
        assert min(ddp["buckets_per_step"][1:]) >= 2
        assert ddp["residual_buckets_after_int8"] >= 2
        assert ddp["kinds_per_step"][-4:] == [["bf16"], ["fp16"], ["none"], ["int8"]]
        # 6 SGD steps at lr 0.05: the gap to uncompressed DDP is ~lr × one step's quantisation error (~3e-5 here).
        assert ddp["param_max_diff_after_int8"] <= 1e-3
        assert ddp["ranks_agree"]
