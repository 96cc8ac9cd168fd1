"""Cost model: docs/design.md's reference cases, P*, memory accounting, accumulation, compression, channel groups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hslite.parallel.plan import COMPRESSIONS, Plan
from hslite.parallel.wire_format import compressed_bytes
from hslite.preflight_check.decide.check_plans import Scope, Sources, run_preflight
from hslite.preflight_check.hardware.device_profile import DEFAULT_LAUNCH_US
from hslite.preflight_check.measure import step_timing
from hslite.preflight_check.measurements import LinkModel, ProbeResult
from hslite.preflight_check.price import costmodel as cm
from hslite.preflight_check.price import formulas

GB = 1e9
MB = 1e6
GRAD_BYTES = 2_000_000 * 4  # 2M fp32 parameters: 8 MB, ~16 MB on the wire per all-reduce
COMPUTE_SECONDS = 8e-3


def make_probe(**overrides) -> ProbeResult:
    """A hand-built probe: 8 ms of forward+backward at b=64 for a 2M-parameter fp32 model."""
    fields = dict(
        forward_seconds=COMPUTE_SECONDS / 3,
        backward_seconds=2 * COMPUTE_SECONDS / 3,
        optimizer_seconds=0.0,
        data_seconds=0.0,
        batch_size=64,
        precision="32-true",
        threads=1,
        device="cuda:0",
        param_count=2_000_000,
        param_bytes=GRAD_BYTES,
        grad_bytes=GRAD_BYTES,
        optimizer_bytes=2 * GRAD_BYTES,
        activation_bytes=64 * 1_000_000,
        peak_bytes=4 * GRAD_BYTES + 64 * 1_000_000 + 5_000_000,  # 5 MB of workspace
        compute_c0_seconds=0.0,
        compute_c1_seconds_per_sample=COMPUTE_SECONDS / 64,
    )
    fields.update(overrides)
    return ProbeResult(**fields)


def gpu_plan(devices: int = 4, **changes) -> Plan:
    return Plan(devices=devices, accelerator="gpu", batch_size=64).with_(**changes)


@pytest.mark.parametrize(
    ("link", "expected_r", "expected_speedup"),
    [
        (LinkModel(0.0, 1 * GB), 2.0, 1.33),  # ~10 GbE
        (LinkModel(1e-4, 40 * GB), 0.0625, 3.77),  # 40 GB/s, 0.1 ms latency
        (LinkModel(0.0, 600 * GB), 0.0033, 3.99),  # NVLink class
    ],
)
def test_seed_worked_cases_under_their_simplification(link, expected_r, expected_speedup):
    ar = formulas.allreduce_seconds(GRAD_BYTES, 4, link, ring_factor_exact=False)
    assert ar / COMPUTE_SECONDS == pytest.approx(expected_r, abs=0.005)
    step = COMPUTE_SECONDS + ar  # no optimiser time, nothing of the all-reduce hidden under the backward
    assert 4 * COMPUTE_SECONDS / step == pytest.approx(expected_speedup, abs=0.006)
    # the same numbers through predict(), which reports r and S(N) directly
    prediction = cm.predict(gpu_plan(), make_probe(), link, 80 * 2**30, ring_factor_exact=False)
    assert prediction.r == pytest.approx(expected_r, abs=0.005)
    assert prediction.speedup == pytest.approx(expected_speedup, abs=0.006)
    assert prediction.speedup == pytest.approx(4 / (1 + prediction.r))


def test_exact_ring_factor_charges_latency_per_step_and_fraction_of_bytes():
    link = LinkModel(1e-4, 40 * GB)
    assert formulas.allreduce_seconds(GRAD_BYTES, 4, link) == pytest.approx(6 * 1e-4 + 1.5 * GRAD_BYTES / (40 * GB))
    assert formulas.allgather_seconds(GRAD_BYTES, 4, link) == pytest.approx(3 * 1e-4 + 0.75 * GRAD_BYTES / (40 * GB))
    assert formulas.reduce_scatter_seconds(GRAD_BYTES, 4, link) == formulas.allgather_seconds(GRAD_BYTES, 4, link)
    assert formulas.allreduce_seconds(GRAD_BYTES, 1, link) == 0.0


def test_critical_params_follow_the_sign_rule_on_the_seeds_cases():
    c1_per_param_sample = COMPUTE_SECONDS / (2_000_000 * 64)
    # the simplified bound: T_comm = alpha + 2·P·b_g/BW
    fast = formulas.critical_params(0.0, c1_per_param_sample, 64, 1e-4, 2 * 4 / (40 * GB))
    assert fast.pays == "above" and fast.params == pytest.approx(1e-4 / (c1_per_param_sample * 64 - 8 / (40 * GB)))
    assert c1_per_param_sample * fast.params * 64 == pytest.approx(1e-4 + 2 * fast.params * 4 / (40 * GB))  # r = 1
    assert fast.pays_at(2 * fast.params) and not fast.pays_at(fast.params / 2)
    never = formulas.critical_params(0.0, c1_per_param_sample, 64, 0.0, 2 * 4 / (1 * GB))
    assert never.pays == "never" and never.params is None and not never.pays_at(1e12)
    always = formulas.critical_params(1e-3, c1_per_param_sample, 64, 1e-4, 2 * 4 / (40 * GB))
    assert always.pays == "always" and always.pays_at(1)
    # The P* example of docs/design.md: c0 = 2 ms, 1 GB/s, b = 9: the compute's fixed part hides the link's latency, so
    # DP pays below about 0.4 M parameters, where a denominator ≤ 0 once read as "never"
    small = formulas.critical_params(2e-3, 1 / 3 * 1e-9, 9, 0.0, 2 * 4 / (1 * GB))
    assert small.pays == "below" and small.params == pytest.approx(0.4e6)
    assert small.pays_at(0.3e6) and not small.pays_at(0.5e6)


def test_ring_terms_of_p_star_are_the_ring_all_reduce():
    link = LinkModel(1e-4, 40 * GB)
    alpha, beta = formulas.ring_allreduce_terms(link, 4, 4)
    assert alpha + beta * 2_000_000 == pytest.approx(formulas.allreduce_seconds(GRAD_BYTES, 4, link))


def test_fit_compute_model_recovers_line_and_clips_noise():
    assert step_timing.fit_compute_model([32, 64], [0.002 + 32e-4, 0.002 + 64e-4]) == pytest.approx((0.002, 1e-4))
    assert step_timing.fit_compute_model([32, 64], [0.01, 0.009]) == pytest.approx((0.0095, 0.0))


def test_memory_accounting_sums_terms_and_scales_activations_with_batch():
    probe = make_probe()
    pred = cm.predict(gpu_plan(1, batch_size=128), probe, LinkModel.no_cost(), 80 * 2**30)
    terms = pred.memory_breakdown_bytes
    assert terms == {
        "params": GRAD_BYTES,
        "grads": GRAD_BYTES,
        "optimizer": 2 * GRAD_BYTES,
        "activations": 2 * 64 * 1_000_000,
        "workspace": 5_000_000,
    }
    assert pred.per_device_peak_bytes == sum(terms.values())
    assert not cm.predict(gpu_plan(1), probe, LinkModel.no_cost(), 50_000_000).fits_memory
    fsdp = cm.predict(gpu_plan(4, fsdp=True), probe, LinkModel(0, 40 * GB), 80 * 2**30).memory_breakdown_bytes
    assert fsdp["params"] + fsdp["grads"] + fsdp["optimizer"] == 4 * GRAD_BYTES // 4
    assert fsdp["gathered"] == 0.75 * GRAD_BYTES  # no wrapping policy known: every parameter counted whole
    units = replace(probe, fsdp_gathered_bytes=GRAD_BYTES // 10)  # the root and the two largest units
    fsdp = cm.predict(gpu_plan(4, fsdp=True), units, LinkModel(0, 40 * GB), 80 * 2**30).memory_breakdown_bytes
    assert fsdp["gathered"] == 0.75 * GRAD_BYTES // 10  # beside the rank's own quarter, counted in params


def test_cpu_ranks_share_host_memory_and_cores():
    probe = make_probe(device="cpu", threads=1)
    plan = Plan(devices=4, accelerator="cpu", batch_size=64)
    pred = cm.predict(plan, probe, LinkModel.no_cost(), 400_000_000, cpu_cores=2)
    assert pred.memory_budget_bytes == 100_000_000
    assert pred.oversubscription == 2.0
    assert pred.compute_seconds == pytest.approx(2 * COMPUTE_SECONDS)
    assert pred.speedup == pytest.approx(2.0)  # four ranks at half speed
    measured = replace(probe, contention=2.5, contention_ranks=4)  # caches and memory shared too
    pred = cm.predict(plan, measured, LinkModel.no_cost(), 400_000_000, cpu_cores=2)
    assert pred.oversubscription == 2.5 and pred.compute_seconds == pytest.approx(2.5 * COMPUTE_SECONDS)
    assert any("4 ranks stepping at once each ran 2.50× slower" in note for note in pred.notes)
    other = cm.predict(replace(plan, devices=2), measured, LinkModel.no_cost(), 400_000_000, cpu_cores=2)
    assert other.oversubscription == 1.0  # measured for 4 ranks, not 2: the core count decides


def test_accumulation_divides_communication_per_sample():
    link = LinkModel(1e-4, 1 * GB)
    probe = make_probe()
    plain = cm.predict(gpu_plan(4), probe, link, 80 * 2**30)
    accumulated = cm.predict(gpu_plan(4, accumulate=4), probe, link, 80 * 2**30)
    assert plain.comm_seconds > 0
    assert accumulated.comm_seconds == pytest.approx(plain.comm_seconds)  # once per optimiser step
    assert accumulated.compute_seconds == pytest.approx(4 * plain.compute_seconds)
    per_sample = accumulated.comm_seconds / gpu_plan(4, accumulate=4).global_batch
    assert per_sample == pytest.approx(plain.comm_seconds / gpu_plan(4).global_batch / 4)
    assert accumulated.ecd > plain.ecd


def test_training_loop_cost_is_paid_every_micro_step_and_counts_against_speedup():
    probe, link = make_probe(device="cpu"), LinkModel.no_cost()
    plan = Plan(devices=2, accelerator="cpu", batch_size=64, accumulate=4)
    bare = cm.predict(plan, probe, link, 2**34, cpu_cores=2)
    looped = cm.predict(plan, probe, link, 2**34, cpu_cores=2, loop_seconds=3e-3, alone_loop_seconds=1e-3)
    # The synchronised last micro-step pays the two-rank loop; the three under no_sync, one rank's (on shared cores).
    assert looped.loop_seconds == pytest.approx(3e-3 + 3 * 1e-3)
    assert looped.step_seconds == pytest.approx(bare.step_seconds + 3e-3 + 3 * 1e-3)
    alone = 4 * (COMPUTE_SECONDS + 1e-3)  # one rank with the cores to itself pays its own, smaller loop
    assert looped.speedup == pytest.approx(2 * alone / looped.step_seconds)


def test_compressed_allreduce_prices_less_wire_plus_quantise_time():
    assert compressed_bytes(GRAD_BYTES, "int8") == pytest.approx(GRAD_BYTES / 4 + 4 * math.ceil(2_000_000 / 2048))
    assert compressed_bytes(GRAD_BYTES, "bf16") == GRAD_BYTES / 2
    link = LinkModel(0.0, 1 * GB)
    probe = make_probe(compress_seconds_per_byte=1e-11)
    comm = {c: cm.predict(gpu_plan(4, compression=c), probe, link, 80 * 2**30).comm_seconds for c in COMPRESSIONS}
    assert comm["int8"] < comm["bf16"] < comm["none"]
    # One 8 MB bucket, padded on 4 ranks (2M elements in 4 shards of 245 chunks of 2041): 27 + 2·4 + 2 launches
    launches = 37 * DEFAULT_LAUNCH_US * 1e-6
    assert comm["int8"] == pytest.approx(
        1.5 * compressed_bytes(GRAD_BYTES, "int8") / GB + 1e-11 * GRAD_BYTES + launches
    )
    defaulted = cm.predict(gpu_plan(4, compression="int8"), make_probe(), link, 80 * 2**30)
    assert any("default" in note for note in defaulted.notes)


def test_the_int8_hooks_launches_grow_with_the_ranks_as_its_kernel_count_and_vanish_when_launches_are_free(
    monkeypatch,
):
    from hslite.parallel.compression.hook import int8_hook
    from hslite.preflight_check.price.comm_cost import DDP_BUCKET_CAP_BYTES, int8_hook_seconds, int8_kernels_per_bucket

    assert [int8_kernels_per_bucket(4096, n) for n in (2, 4, 8)] == [31, 35, 43]  # 27 + 2·N: 4096 splits evenly
    assert int8_kernels_per_bucket(10_000, 3) == 27 + 2 * 3 + 2  # 3 shards of 3334: padding zeroed, last shard cut
    for elements, world in ((4096, 2), (4096, 4), (10_000, 3), (30_000, 8)):  # the count is what the hook runs
        assert _int8_hook_kernels(int8_hook, elements, world, monkeypatch) == int8_kernels_per_bucket(elements, world)
    work, launch = 1e-11, 5e-6
    grad_bytes = 2 * DDP_BUCKET_CAP_BYTES + 4 * 2**20  # two full buckets and a 4 MiB one
    priced = {n: int8_hook_seconds(grad_bytes, n, work, launch) for n in (2, 4, 8)}
    assert priced[4] - priced[2] == pytest.approx(3 * 2 * (4 - 2) * launch)  # 2 kernels per peer in each bucket
    assert priced[8] - priced[4] == pytest.approx(3 * 2 * (8 - 4) * launch)
    assert int8_hook_seconds(grad_bytes, 8, work, 0.0) == pytest.approx(work * grad_bytes)  # the measured work alone
    probe = make_probe(compress_seconds_per_byte=work)
    quantise = {
        n: cm.predict(gpu_plan(n, compression="int8"), probe, LinkModel(0.0, math.inf), 80 * 2**30).comm_seconds
        for n in (2, 8)
    }
    kernels = {n: int8_kernels_per_bucket(GRAD_BYTES // 4, n) for n in (2, 8)}
    assert quantise[2] == pytest.approx(work * GRAD_BYTES + kernels[2] * DEFAULT_LAUNCH_US * 1e-6)
    assert quantise[8] - quantise[2] == pytest.approx((kernels[8] - kernels[2]) * DEFAULT_LAUNCH_US * 1e-6)


def test_fsdp_moves_three_param_volumes_per_step():
    link = LinkModel(0.0, 40 * GB)
    pred = cm.predict(gpu_plan(4, fsdp=True), make_probe(), link, 80 * 2**30)
    assert pred.comm_seconds == pytest.approx(3 * 0.75 * GRAD_BYTES / (40 * GB))
    accumulated = cm.predict(gpu_plan(4, fsdp=True, accumulate=2), make_probe(), link, 80 * 2**30)
    assert accumulated.comm_seconds == pytest.approx(2 * pred.comm_seconds)  # gathers and reduce-scatters each time


def test_channel_groups_split_tokenizer_and_add_token_traffic():
    probe = make_probe(chag_fraction=0.5, tokenizer_activation_fraction=0.5, group_token_bytes_per_sample=10_000)
    link = LinkModel(0.0, 40 * GB)
    pred = cm.predict(gpu_plan(4, chag=4), probe, link, 80 * 2**30)
    # The tokenizer splits by bands, the rest by samples: a quarter of both (batch 64 in slices of 16).
    assert pred.compute_seconds == pytest.approx(COMPUTE_SECONDS / 4)
    tokens = 64 * 10_000 / 4  # a rank's exchange writes its slice's tokens of every group (and the gradient back)
    assert pred.chag_bytes_per_step == 2 * tokens
    # DDP's all-reduce spans the 4 chag ranks (each holds a share of one gradient), the exchange runs twice.
    assert pred.comm_seconds == pytest.approx(2 * 0.75 * GRAD_BYTES / (40 * GB) + 2 * 0.75 * tokens / (40 * GB))
    assert pred.memory_breakdown_bytes["activations"] == pytest.approx(64e6 / 4)
    uneven = cm.predict(gpu_plan(4, chag=4, batch_size=62), probe, link, 80 * 2**30)  # slices of 16, 16, 15, 15
    per_sample = COMPUTE_SECONDS / 64  # make_probe's compute is linear in the batch without a constant
    assert uneven.compute_seconds == pytest.approx(per_sample * 62 * (0.5 * 16 / 62 + 0.5 / 4))
    rotated = cm.predict(gpu_plan(1, rotation_groups=2), replace(probe, band_group_sizes=[25] * 8), link, 80 * 2**30)
    assert rotated.compute_seconds == pytest.approx(COMPUTE_SECONDS * (0.5 + 0.5 * 2 / 8))
    unknown = cm.predict(gpu_plan(4, chag=2), make_probe(), link, 80 * 2**30)
    assert any("not priced" in note for note in unknown.notes)


def test_the_most_loaded_rank_sets_the_tokenizer_share_when_groups_differ_in_size():
    # Indian-Pines-like groups aligned to VIS / NIR / SWIR-1 / SWIR-2: 33, 64, 47 and 56 of 200 bands.
    probe = make_probe(band_group_sizes=[33, 64, 47, 56])
    share = cm.tokenizer_share
    assert share(gpu_plan(4, chag=4), probe, 4) == pytest.approx(64 / 200)  # the NIR rank
    assert share(gpu_plan(2, chag=2), probe, 2) == pytest.approx(103 / 200)
    rotation = gpu_plan(1, rotation_groups=2)
    assert share(rotation, probe, 1) == pytest.approx(0.5)  # on average every group is active half the steps
    assert share(rotation, probe, 1, worst=True) == pytest.approx((64 + 56) / 200)  # the step memory must hold
    both = gpu_plan(2, chag=2, rotation_groups=2)
    assert share(both, probe, 2) == pytest.approx(103 / 2 / 200)
    assert share(both, probe, 2, worst=True) == pytest.approx(64 / 200)
    assert share(gpu_plan(4, chag=4), make_probe(), 4) == pytest.approx(1 / 4)  # sizes unknown: an even split


def test_overlap_hides_comm_only_beyond_the_last_ddp_bucket():
    big = make_probe(grad_bytes=100 * 2**20, param_bytes=100 * 2**20)
    link = LinkModel(0.0, 1 * GB, overlap=1.0)
    no_overlap = cm.predict(gpu_plan(4), big, LinkModel(0.0, 1 * GB), 80 * 2**30).comm_seconds
    with_overlap = cm.predict(gpu_plan(4), big, link, 80 * 2**30).comm_seconds
    assert with_overlap == pytest.approx(no_overlap - 0.75 * 2 * COMPUTE_SECONDS / 3)
    small = cm.predict(gpu_plan(4), make_probe(), link, 80 * 2**30)  # 8 MB: one bucket, nothing hides
    assert small.comm_seconds == pytest.approx(formulas.allreduce_seconds(GRAD_BYTES, 4, link))


def test_the_int8_hook_is_priced_with_no_overlap_as_its_collectives_are_synchronous():
    big = make_probe(grad_bytes=100 * 2**20, param_bytes=100 * 2**20, compress_seconds_per_byte=1e-11)
    links = {"hiding": LinkModel(0.0, 1 * GB, overlap=1.0), "bound": LinkModel(0.0, 1 * GB)}
    priced = {(c, name): cm.predict(gpu_plan(4, compression=c), big, link, 80 * 2**30)
              for c in ("int8", "bf16") for name, link in links.items()}  # fmt: skip
    # The int8 hook exchanges each bucket inside the hook, so backward waits for it; torch's bf16 doesn't.
    assert priced["int8", "hiding"].comm_seconds == pytest.approx(priced["int8", "bound"].comm_seconds)
    assert any("no overlap" in note for note in priced["int8", "hiding"].notes)
    assert priced["bf16", "hiding"].comm_seconds < priced["bf16", "bound"].comm_seconds


def _int8_hook_kernels(hook, elements: int, world: int, monkeypatch) -> int:
    """Ops that launch a kernel in `hook`'s second call on a bucket, as rank 0 of `world` (collectives: one each)."""
    import torch
    import torch.distributed as dist
    from _dist_scripts._ranks import FakeBucket
    from torch.utils._python_dispatch import TorchDispatchMode

    from hslite.parallel.compression.state import CompressionState

    class Launches(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            # views and allocations launch nothing, and neither does an op on an empty tensor (a bucket unpadded)
            if not func.is_view and "empty" not in func.__name__ and all(t.numel() for t in tensors):
                Launches.count += 1
            return func(*args, **(kwargs or {}))

    def all_to_all(output, send, group=None):
        output.copy_(send)  # every rank sent what this one did: one op, as the collective's one launch

    def all_gather(output, row, group=None):
        output.view(world, -1).copy_(row.expand(world, -1))

    stubs = {"get_world_size": lambda group=None: world, "get_rank": lambda group=None: 0,
             "all_to_all_single": all_to_all, "all_gather_single": all_gather,
             "all_gather_into_tensor": all_gather}  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(dist, name, stub, raising=False)
    parameter = torch.nn.Parameter(torch.zeros(elements))
    state = CompressionState()
    first, second = (FakeBucket(torch.randn(elements), [parameter]) for _ in range(2))
    hook(state, first)  # the first call keeps a residual; the second runs as every later step does
    with Launches():
        hook(state, second)
    return Launches.count


@pytest.mark.parametrize(
    ("link", "regime"),
    [
        (LinkModel(1e-6, 600 * GB), "compute-bound"),  # 0.05 ms of all-reduce against 8 ms of compute
        (LinkModel(1e-6, 1 * GB), "communication-bound"),  # 12 ms of bytes, 6 µs of latency
        (LinkModel(2e-3, 600 * GB), "latency-bound"),  # 6 ring steps of 2 ms, 0.05 ms of bytes
    ],
)
def test_every_plan_is_named_by_the_regime_that_bounds_it(link, regime):
    from hslite.preflight_check.price.regime import LEVERS

    pred = cm.predict(gpu_plan(4), make_probe(), link, 80 * 2**30)
    assert pred.regime == regime
    assert cm.predict(gpu_plan(1), make_probe(), link, 80 * 2**30).regime == "compute-bound"  # nothing to exchange
    verdict = run_preflight(
        gpu_plan(4), Sources(lambda plan: make_probe(), lambda plan: link, 80 * 2**30), Scope(amp=False)
    )
    assert {row["regime"] for row in verdict.rows if row["requested"]} == {regime}
    assert f"is {regime}: {LEVERS[regime]}" in " ".join(verdict.reasons)
