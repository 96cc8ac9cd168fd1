"""Verdict: an unprofitable CPU plan is NO-GO with reasons, one device is GO, a plan that does not fit is NO-GO."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import torch
from rich.console import Console
from torch import nn

from hslite.errors import ConfigError
from hslite.parallel.box import threads_per_process
from hslite.parallel.plan import Plan
from hslite.preflight_check.decide.check_plans import Scope, Sources, run_preflight
from hslite.preflight_check.decide.verdict import IMPLAUSIBLE_CPU_EFFICIENCY, decide
from hslite.preflight_check.hardware.links import measure_links_for
from hslite.preflight_check.hardware.topology import load_topology
from hslite.preflight_check.measure.probe import ProbeOptions, ProbeTarget, probe_for_plans, probe_model
from hslite.preflight_check.measurements import LinkModel, ProbeResult
from hslite.preflight_check.price.candidates import candidate_plans
from hslite.preflight_check.price.costmodel import predict

GIB = 2**30
# What measure_links(4) returned for 4 gloo processes on this 2-core machine kind (alpha ~0.6 ms, ~1 GB/s).
GLOO_4_ON_2_CORES = LinkModel(6e-4, 1e9, 0.0, "measured gloo, 4 processes on 2 cores")


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 32), torch.randint(0, 8, (b,))


def synthetic_probe(plan: Plan, **overrides) -> ProbeResult:
    """A GPU-style probe: 10 ms of compute at b=64, 100 MB of fp32 parameters, 1 GB of activations."""
    fields = dict(
        forward_seconds=0.004, backward_seconds=0.006, optimizer_seconds=0.001, data_seconds=0.0,
        batch_size=plan.batch_size, precision=plan.precision, threads=1, device="cuda:0", param_count=25_000_000,
        param_bytes=100_000_000, grad_bytes=100_000_000, optimizer_bytes=200_000_000, activation_bytes=1_000_000_000,
        peak_bytes=1_400_000_000, compute_c0_seconds=0.0, compute_c1_seconds_per_sample=0.01 / plan.batch_size,
    )  # fmt: skip
    fields.update(overrides)
    return ProbeResult(**fields)


def cpu_probe_for(plan: Plan) -> ProbeResult:
    """Probes of a small MLP at b=32 with the threads each rank gets on 2 cores: a second thread barely helps."""
    threads = threads_per_process(plan, cores=2)
    compute_seconds = {1: 4.0e-4, 2: 3.2e-4}[threads]
    return synthetic_probe(
        plan, forward_seconds=compute_seconds / 3, backward_seconds=2 * compute_seconds / 3, optimizer_seconds=1e-4,
        threads=threads, device="cpu", param_count=2_600, param_bytes=10_400, grad_bytes=10_400,
        optimizer_bytes=20_800, activation_bytes=40_000, peak_bytes=81_600, compute_c0_seconds=compute_seconds / 4,
        compute_c1_seconds_per_sample=compute_seconds * 3 / 4 / plan.batch_size,
    )  # fmt: skip


def test_a_lone_cpu_rank_is_probed_at_the_largest_one_device_batch_and_the_ranks_at_theirs():
    probed: list[tuple[int, int]] = []

    def probe_for(plan: Plan) -> ProbeResult:
        probed.append((plan.devices, plan.batch_size))
        return cpu_probe_for(plan)

    run_preflight(
        Plan(devices=4, accelerator="cpu", batch_size=16),
        Sources(probe_for, lambda plan: GLOO_4_ON_2_CORES, 8 * GIB, cpu_cores=2),
    )
    # One device accumulates the 4 ranks' micro-batches: its biggest candidate is b64, not b16 extrapolated 4×.
    assert (1, 64) in probed and (4, 16) in probed and (2, 16) in probed and (1, 16) not in probed
    probed.clear()
    run_preflight(
        Plan(devices=1, accelerator="cpu", batch_size=16),
        Sources(probe_for, lambda plan: GLOO_4_ON_2_CORES, 8 * GIB, cpu_cores=2),
    )
    assert set(probed) == {(1, 16)}  # a one-device request is probed at its own batch (each precision)


def test_four_cpu_processes_on_two_cores_for_a_small_model_is_no_go():
    requested = Plan(devices=4, accelerator="cpu", batch_size=32)
    verdict = run_preflight(requested, Sources(cpu_probe_for, lambda plan: GLOO_4_ON_2_CORES, 8 * GIB, cpu_cores=2))
    assert not verdict.go and verdict.exit_code == 3
    assert verdict.efficiency < 0.5
    reason = verdict.reasons[0]
    assert "4 gloo processes share 2 cores" in reason and "predicted efficiency" in reason and "< 0.5" in reason
    assert "communication exposes" in reason
    assert verdict.best_passing is not None and verdict.best_passing.world_size == 1
    assert verdict.best_passing.global_batch == requested.global_batch  # 1 device + accumulation (or a bigger b)
    assert any(r.startswith("better plan: 1×cpu") for r in verdict.reasons)


@pytest.mark.timeout(120)
def test_loop_cost_is_measured_once_per_rank_count_and_priced_into_every_plan():
    requested = Plan(devices=4, accelerator="cpu", batch_size=32)
    asked: list[int] = []

    def loop_seconds_for(plan: Plan) -> float:
        asked.append(plan.devices)
        return 1e-3 * plan.devices

    def link_for(plan: Plan) -> LinkModel:
        return GLOO_4_ON_2_CORES

    bare = run_preflight(requested, Sources(cpu_probe_for, link_for, 8 * GIB, cpu_cores=2))
    looped = run_preflight(
        requested, Sources(cpu_probe_for, link_for, 8 * GIB, loop_seconds_for=loop_seconds_for, cpu_cores=2)
    )
    # Each rank count measured once, however many plans share it (3 ranks cannot split 4 micro-batches: not priced).
    assert sorted(asked) == sorted({plan.devices for plan in looped.predictions}) == [1, 2, 4]
    for plan, pred in looped.predictions.items():
        expected = 1e-3 * plan.devices + (plan.accumulate - 1) * pred.oversubscription * 1e-3
        assert pred.loop_seconds == pytest.approx(expected)
        assert pred.step_seconds == pytest.approx(bare.predictions[plan].step_seconds + expected)


def test_run_preflight_with_real_cpu_probes_reports_json_and_table():
    def probe_for(plan: Plan) -> ProbeResult:  # each rank probed with the threads it would get
        return probe_model(
            small_model,
            make_batch,
            ProbeTarget(
                batch_size=plan.batch_size, precision=plan.precision, threads=threads_per_process(plan, cores=2)
            ),
            ProbeOptions(warmup=1, steps=3),
        )

    requested = Plan(devices=4, accelerator="cpu", batch_size=32)
    verdict = run_preflight(requested, Sources(probe_for, lambda plan: GLOO_4_ON_2_CORES, 8 * GIB, cpu_cores=2))
    _assert_decision_follows_the_figures(verdict, requested)
    report = json.loads(json.dumps(verdict.to_dict()))
    assert report["requested"] == requested.describe() and report["decision"] == verdict.decision
    assert report["requested_prediction"] == verdict.predictions[requested].to_dict()  # JSON keeps every figure
    rows = report["rows"]
    assert rows[0]["plan"] == verdict.best_passing.describe()  # ranked: the fastest passing plan first
    passing = [row["samples_per_second"] for row in rows if row["passes"]]
    assert passing == sorted(passing, reverse=True) and all(r["passes"] for r in rows[: len(passing)])
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(verdict.render_table())
    text = console.export_text()
    assert "◀ requested" in text and "★" in text


def _assert_decision_follows_the_figures(verdict, requested: Plan) -> None:
    """Real probes decide either way with this box's load; what must hold is that E and the decision come from them.

    E is recomputed from the priced plans (the fastest fitting single device is the reference), so a verdict that
    read the wrong prediction, the wrong reference or the wrong threshold fails here whichever way it went.
    """
    singles = [pred for plan, pred in verdict.predictions.items() if plan.world_size == 1 and pred.fits_memory]
    efficiency = verdict.predictions[requested].ecd / max(pred.ecd for pred in singles)
    assert verdict.efficiency == pytest.approx(efficiency)
    go = verdict.predictions[requested].fits_memory and efficiency >= verdict.min_efficiency
    assert (verdict.go, verdict.exit_code) == (go, 0 if go else 3)
    assert any("implausible" in reason for reason in verdict.reasons) == (efficiency > IMPLAUSIBLE_CPU_EFFICIENCY)


def test_single_device_plan_is_go_when_it_fits():
    requested = Plan(devices=1, accelerator="gpu", batch_size=64)
    probe = synthetic_probe(requested)
    prediction = predict(requested, probe, LinkModel.no_cost(), 80 * GIB)
    verdict = decide(requested, {requested: prediction})
    assert verdict.go and verdict.efficiency == pytest.approx(1.0)
    assert "always GO" in verdict.reasons[0]
    assert verdict.best_single == requested == verdict.best_passing
    assert verdict.better_plan is None and verdict.to_dict()["better_plan"] is None  # nothing to run instead


def _states_dominate(plan: Plan) -> ProbeResult:  # parameters + optimiser state: 3.2 GB of the 3.4 GB
    return synthetic_probe(plan, param_bytes=800_000_000, grad_bytes=800_000_000, optimizer_bytes=1_600_000_000,
                           activation_bytes=100_000_000, peak_bytes=3_300_000_000)  # fmt: skip


def test_plan_that_does_not_fit_is_no_go_and_fsdp_is_the_alternative():
    requested = Plan(devices=8, accelerator="gpu", batch_size=64)
    verdict = run_preflight(
        requested, Sources(_states_dominate, device_memory_bytes=2 * GIB, topology=load_topology("nvlink_8"))
    )
    assert not verdict.go
    assert "per device but only 2.00 GiB" in verdict.reasons[0] and "FSDP" in verdict.reasons[0]
    # One device cannot fit it, so E is measured against the fewest devices that can, not a device that cannot
    reference = verdict.best_single
    assert reference.fsdp and verdict.predictions[reference].fits_memory
    fitting = [p for p, pred in verdict.predictions.items() if pred.fits_memory]
    assert reference.world_size == min(p.world_size for p in fitting) > 1
    assert any(f"E is measured against {reference.describe()}" in r for r in verdict.reasons)
    assert verdict.rows[0]["passes"] and {row["plan"]: row["efficiency"] for row in verdict.rows}[
        reference.describe()] == 1.0  # fmt: skip
    assert verdict.best_passing is not None and verdict.best_passing.fsdp
    assert verdict.predictions[verdict.best_passing].fits_memory
    assert verdict.better_plan == verdict.best_passing
    assert verdict.to_dict()["better_plan"] == verdict.best_passing.describe()


def test_activation_bound_plan_is_no_go_with_accumulation_alternative():
    requested = Plan(devices=2, accelerator="gpu", batch_size=64)
    verdict = run_preflight(requested, Sources(synthetic_probe, lambda plan: LinkModel(1e-6, 300e9), 0.9 * GIB))
    assert not verdict.go and "activations dominate" in verdict.reasons[0]
    best = verdict.best_passing
    assert best is not None and best.batch_size < 64 and best.accumulate > 1
    assert best.global_batch == requested.global_batch


def test_fast_link_multi_device_plan_is_go():
    requested = Plan(devices=8, accelerator="gpu", batch_size=64)
    verdict = run_preflight(requested, Sources(synthetic_probe, topology=load_topology("nvlink_8")))
    assert verdict.go and verdict.efficiency >= 0.5 and "≥ 0.5" in verdict.reasons[0]


def test_candidates_propose_channel_groups_only_for_band_group_models():
    requested = Plan(devices=4, accelerator="gpu", batch_size=64)
    plans = candidate_plans(requested, 4, chag_supported=True)
    assert plans and not any(p.fsdp or p.rotation_enabled for p in plans)  # FSDP only when asked or forced
    assert any(p.chag_enabled for p in plans)  # channel groups train, so they are proposed for band-group models
    assert not any(p.chag_enabled for p in candidate_plans(requested, 4, chag_supported=False))
    single = candidate_plans(requested.with_(devices=1, accumulate=4), 1, amp=False)
    assert {p.precision for p in single} == {"32-true"} and all(p.world_size == 1 for p in single)


def test_candidates_cover_single_amp_accumulation_dp_compression_fsdp_and_chag():
    requested = Plan(devices=4, accelerator="gpu", batch_size=64)
    plans = candidate_plans(requested, 4, chag_supported=True, include_fsdp=True)
    assert requested in plans and len(plans) == len(set(plans))
    assert all(p.global_batch == requested.global_batch for p in plans)
    described = {p.describe() for p in plans}
    assert {"1×gpu dp1 b64 acc4 32-true", "1×gpu dp1 b64 acc4 bf16-mixed", "1×gpu dp1 b256 acc1 32-true"} <= described
    assert "2×gpu dp2 b64 acc2 32-true" in described
    assert {
        "4×gpu dp4 b64 acc1 32-true int8",
        "4×gpu dp4 b64 acc1 32-true bf16",
        "4×gpu dp4 b64 acc1 32-true fsdp",
    } <= described
    assert "4×gpu dp2 chag2 b64 acc2 32-true" in described
    assert not any(p.fsdp for p in candidate_plans(requested, 4))
    # A rotating model cannot be sharded (Plan refuses it): no FSDP layout, and no error (compare asks with FSDP on)
    rotating = candidate_plans(requested.with_(rotation_groups=2), 4, chag_supported=True, include_fsdp=True)
    assert rotating and not any(p.fsdp for p in rotating)


def test_decide_needs_the_requested_prediction():
    requested = Plan(devices=2, accelerator="gpu")
    single = Plan(devices=1, accelerator="gpu")
    with pytest.raises(ConfigError, match="no prediction for the requested plan"):
        decide(requested, {single: predict(single, synthetic_probe(single), LinkModel.no_cost(), GIB)})
    with pytest.raises(ConfigError, match="single-device"):
        decide(requested, {requested: predict(requested, replace(synthetic_probe(requested)), LinkModel(0, 1e9), GIB)})


def test_two_nodes_on_a_slow_network_lose_to_one_nvlink_node():
    requested = Plan(devices=8, num_nodes=2, accelerator="gpu", batch_size=64)
    topology = load_topology("nvlink_8_100gbe_2nodes")
    verdict = run_preflight(requested, Sources(synthetic_probe, topology=topology))
    assert not verdict.go and "communication exposes" in verdict.reasons[0]
    one_node = requested.with_(num_nodes=1, accumulate=2)  # same global batch on NVLink only
    assert verdict.predictions[one_node].ecd / verdict.predictions[verdict.best_single].ecd >= 0.5
    # Compressing the gradients is what makes the slow network pay: the same two nodes with int8 are the fastest plan,
    # ahead of bf16 (half the bytes of fp32, twice int8's).
    assert verdict.best_passing == requested.with_(compression="int8")
    int8, bf16 = (verdict.predictions[requested.with_(compression=c)] for c in ("int8", "bf16"))
    assert int8.samples_per_second > bf16.samples_per_second > verdict.predictions[requested].samples_per_second
    fsdp = [  # the mapping rule: per-layer traffic stays inside a node
        p
        for p in candidate_plans(
            requested, 8, include_fsdp=True, per_layer_across_nodes=topology.per_layer_across_nodes
        )
        if p.fsdp
    ]
    # per-layer traffic is kept off the 34× slower link: FSDP over every rank only inside a node; across nodes it
    # shards inside each node (hybrid) and all-reduces one shard per node across
    assert fsdp and all(p.num_nodes == 1 or p.hybrid_shard for p in fsdp)
    assert any(p.num_nodes == 2 and p.hybrid_shard for p in fsdp)


def test_hybrid_sharding_keeps_fsdp_inside_a_node_and_prices_one_shard_all_reduce_across() -> None:
    topology = load_topology("nvlink_8_100gbe_2nodes")
    fsdp = Plan(devices=8, num_nodes=2, accelerator="gpu", batch_size=64, fsdp=True)
    hsdp = fsdp.with_(hybrid_shard=True)
    assert hsdp.describe() == "16×gpu dp16 b64 acc1 32-true hsdp" and hsdp.shard_ranks == 8 and fsdp.shard_ranks == 16
    assert "parallel.fsdp=true parallel.hybrid_shard=true" in hsdp.overrides()
    assert topology.mapping_refusal(hsdp) is None and "parallel.hybrid_shard=true" in topology.mapping_refusal(fsdp)
    assert topology.node_link_for(hsdp).bandwidth_bytes_per_second == 370e9  # the shard group's link: NVLink
    verdict = run_preflight(fsdp, Sources(synthetic_probe, topology=topology))
    priced = verdict.predictions
    assert priced[hsdp].comm_seconds < priced[fsdp].comm_seconds  # gathers on NVLink, one 1/8 shard over 100GbE
    sizes = synthetic_probe(fsdp)
    gathered = sizes.param_count * 4  # fp32 parameters, gathered twice; fp32 gradients reduce-scattered
    inside = 7 / 8 * (2 * gathered + sizes.grad_bytes)
    across = 2 * 1 / 2 * sizes.grad_bytes / 8  # the all-reduce of each rank's 1/8 gradient shard over 2 replicas
    assert priced[hsdp].grad_bytes_per_step == pytest.approx(inside + across)
    assert priced[hsdp].per_device_peak_bytes > priced[fsdp].per_device_peak_bytes  # 8 shards, not 16
    with pytest.raises(ConfigError, match="hybrid_shard is how FSDP shards across nodes"):
        Plan(devices=8, num_nodes=2, hybrid_shard=True)


@pytest.mark.parametrize(
    "layout, sent",
    [({"fsdp": True}, "FSDP's gathers and reduce-scatters"), ({"devices": 6, "chag": 4}, "its channel groups")],
    ids=["fsdp-across-nodes", "chag-across-nodes"],
)
def test_per_layer_communication_across_a_slow_inter_node_link_is_refused_with_the_rule(layout, sent):
    # R = 370 / 11 ≈ 34 ≥ 4: the mapping rule keeps FSDP and channel groups inside a node, whatever they cost
    requested = Plan(devices=8, num_nodes=2, accelerator="gpu", batch_size=64).with_(**layout)
    verdict = run_preflight(requested, Sources(synthetic_probe, topology=load_topology("nvlink_8_100gbe_2nodes")))
    assert verdict.go is False
    (refusal,) = [r for r in verdict.reasons if "across nodes, on a link" in r]
    assert f"sends {sent} across nodes, on a link 33.6× slower than inside a node" in refusal
    assert "max_cross_node_ratio" in refusal
    assert verdict.better_plan is not None and verdict.predictions[verdict.better_plan].mapping_refusal is None
    refused = [row for row in verdict.rows if row["mapping_refusal"]]
    assert refused and not any(row["passes"] for row in refused)


def test_superlinear_cpu_efficiency_is_called_out_as_a_disturbed_probe():
    def disturbed_probe_for(plan: Plan) -> ProbeResult:  # the 2-thread probe ran while something else used the cores
        probe = cpu_probe_for(plan)
        if probe.threads == 1:
            return probe
        times = ("forward_seconds", "backward_seconds", "compute_c0_seconds", "compute_c1_seconds_per_sample")
        return replace(probe, **{name: 30 * getattr(probe, name) for name in times})

    requested = Plan(devices=2, accelerator="cpu", batch_size=32)
    verdict = run_preflight(
        requested, Sources(disturbed_probe_for, lambda plan: LinkModel(1e-6, 1e10), 8 * GIB, cpu_cores=2)
    )
    assert verdict.efficiency > 1.2 and any("implausible" in reason for reason in verdict.reasons)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_end_to_end_with_real_probes_and_a_real_two_process_link(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    requested = Plan(devices=2, accelerator="cpu", batch_size=16)
    probe_for = probe_for_plans(small_model, make_batch, ProbeOptions(cache_key="small-mlp", warmup=1, steps=2))
    verdict = run_preflight(requested, Sources(probe_for, measure_links_for, 4 * GIB))
    _assert_decision_follows_the_figures(verdict, requested)
    assert Plan(accelerator="cpu", batch_size=16, accumulate=2) in verdict.predictions  # one device, same batch
    priced = verdict.to_dict()["requested_prediction"]
    # Plain DDP on CPU is timed with its 2 ranks stepping together: its all-reduce is inside the measured step
    assert priced["comm_seconds"] == 0 and priced["compute_seconds"] > 0 and priced["per_device_peak_bytes"] > 0
    assert any("2 ranks stepping together" in note for note in priced["notes"])
    assert priced["loop_seconds"] == 0  # no loop measurement was handed in
    compressed = verdict.predictions[requested.with_(compression="bf16")]
    assert compressed.comm_seconds > 0  # priced from its parts: the measured link


def test_channel_group_candidates_divide_the_models_band_groups():

    requested = Plan(devices=8, accelerator="gpu", batch_size=32)
    chags = {p.chag for p in candidate_plans(requested, 8, chag_supported=True, band_groups=4)}
    assert chags == {1, 2, 4}  # 8 ranks cannot split 4 groups: never priced
    assert {p.chag for p in candidate_plans(requested, 8, chag_supported=True)} == {1, 2, 4, 8}


def test_p_star_per_link_is_reported_beside_the_verdict(capsys):
    from hslite.preflight_check.decide.report import print_verdict

    requested = Plan(devices=8, accelerator="gpu", batch_size=64)
    verdict = run_preflight(requested, Sources(synthetic_probe, topology=load_topology("nvlink_8")))
    report = verdict.to_dict()["critical_params"]
    rows = {row["link"]: row for row in report["links"]}
    assert list(rows)[0] == "topology nvlink_8, as requested" and "pcie4_8 (inside a node)" in rows
    assert report["world_size"] == 8 and report["model_params"] == synthetic_probe(requested).param_count
    assert verdict.go and rows["topology nvlink_8, as requested"]["pays_for_this_model"]  # the two agree
    for row in rows.values():  # each row's side of P* is what its figures say
        assert row["pays_for_this_model"] == (
            row["pays"] == "always" or (row["pays"] == "above" and report["model_params"] >= row["p_star"])
            or (row["pays"] == "below" and report["model_params"] <= row["p_star"]))  # fmt: skip
    print_verdict(verdict)
    assert "P* per link" in capsys.readouterr().out


def test_channel_group_plans_are_priced_against_plain_dp_at_the_same_global_batch():
    def grouped(plan: Plan) -> ProbeResult:  # most of the compute and activations in the per-group work
        return synthetic_probe(plan, chag_fraction=0.8, tokenizer_activation_fraction=0.8,
                               group_token_bytes_per_sample=4 * 64 * 4, band_group_sizes=[50] * 4)  # fmt: skip

    requested = Plan(devices=4, accelerator="gpu", batch_size=64, chag=2)
    verdict = run_preflight(
        requested,
        Sources(grouped, topology=load_topology("nvlink_8")),
        Scope(chag_supported=True, band_groups=4, amp=False),
    )
    rows = {row["plan"]: row for row in verdict.rows}
    row = rows[requested.describe()]
    base = Plan(devices=4, accelerator="gpu", batch_size=32)  # the pair's 64 shared samples, split over 4 DP ranks
    assert row["plain_dp"] == base.describe() and base.global_batch == requested.global_batch
    ours, theirs = verdict.predictions[requested], verdict.predictions[base]
    assert row["benefit_ratio"] == pytest.approx((theirs.comm_seconds - ours.comm_seconds) / ours.compute_seconds)
    assert row["step_gain"] == pytest.approx(1 - ours.step_seconds / theirs.step_seconds)
    assert row["clears_chag_rule"] == (row["step_gain"] > 0.05)
    assert any("the design's 5% rule" in reason for reason in verdict.reasons)
    assert all(r["benefit_ratio"] is None for r in verdict.rows if "chag" not in r["plan"])


def test_a_plan_that_does_not_fit_is_offered_accumulation_down_to_one_sample():
    requested = Plan(devices=2, accelerator="gpu", batch_size=64)
    assert min(p.batch_size for p in candidate_plans(requested, 2)) == 16  # a quarter, when it fits
    deep = candidate_plans(requested, 2, down_to_one=True)
    assert {p.batch_size for p in deep if p.world_size == 2} == {64, 32, 16, 8, 4, 2, 1}
    assert all(p.global_batch == requested.global_batch for p in deep)


def test_p_star_of_a_one_device_request_is_on_this_boxs_link_for_two():
    link = LinkModel(1e-4, 10e9)
    verdict = run_preflight(
        Plan(accelerator="gpu", batch_size=64),
        Sources(synthetic_probe, lambda plan: link, 80 * 2**30),
        Scope(max_devices=2),
        0.5,
    )
    report = verdict.critical_params
    first = report["links"][0]
    assert first["link"] == "this box (2 ranks, measured)" and first["alpha_seconds"] == link.alpha_seconds
    assert report["world_size"] == 2 and report["batch_size"] == 32  # the global batch of 64 over 2 ranks


def test_p_star_on_this_box_takes_the_loop_its_plans_are_priced_with():
    from hslite.preflight_check.price.formulas import critical_params, ring_allreduce_terms

    link, requested = LinkModel(1e-4, 100e9), Plan(devices=2, accelerator="gpu", batch_size=64)
    free = run_preflight(requested, Sources(synthetic_probe, lambda plan: link, 80 * GIB), Scope(), 0.5)
    assert free.go and free.critical_params["links"][0]["pays_for_this_model"]
    # Two ranks' loop costs 2 × 12 ms beyond one rank's 1 ms per step: more than the model's 10 ms step, so DP cannot
    # pay, and P* must not say it does beside a NO-GO plan table.
    loops = {1: 1e-3, 2: 25e-3}
    verdict = run_preflight(
        requested,
        Sources(synthetic_probe, lambda plan: link, 80 * GIB, loop_seconds_for=lambda plan: loops[plan.devices]),
        Scope(),
        0.5,
    )
    report = verdict.critical_params
    here = report["links"][0]
    assert not verdict.go and here["link"] == "this box (2 ranks, measured), as requested"
    assert not here["pays_for_this_model"] and here["added_loop_seconds"] == pytest.approx(24e-3)
    assert report["loop_seconds"] == 1e-3
    # The P* formula with the loop in its terms: c0 + L1 fixed compute, alpha + (L_N − L1) fixed communication.
    probe = synthetic_probe(requested)
    alpha, beta = ring_allreduce_terms(link, 2, probe.grad_bytes / probe.param_count)
    expected = critical_params(probe.compute_c0_seconds + 1e-3, report["c1_seconds_per_param_sample"], 64,
                               alpha + here["added_loop_seconds"], beta, r_target=here["r_target"])  # fmt: skip
    assert (here["p_star"], here["pays"]) == (expected.params, expected.pays)
    # A bundled topology's GPUs are not here: priced with one local rank's loop, their ranks add none of it.
    assert all(row["added_loop_seconds"] == 0 for row in report["links"][1:])


def test_a_plan_is_checked_when_it_is_made_and_when_it_is_changed():
    with pytest.raises(ConfigError, match=r"devices\(3\) × num_nodes\(1\) = 3 is not divisible by chag\(2\)"):
        Plan(devices=3, chag=2)
    with pytest.raises(ConfigError, match="precision must be one of 32-true, bf16-mixed, 16-mixed, got 'fp8'"):
        Plan().with_(precision="fp8")
    with pytest.raises(ConfigError, match="compression and fsdp cannot be combined"):
        Plan(devices=2).with_(compression="int8", fsdp=True)
