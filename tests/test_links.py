"""Link models: the alpha/BW fit, topology profiles, and a real 2-process gloo measurement."""

from __future__ import annotations

import importlib
import math

import pytest

from hslite.errors import ConfigError, HSLiteError
from hslite.parallel.plan import Plan
from hslite.preflight_check.hardware.links import fit_link, measure_links
from hslite.preflight_check.hardware.topology import list_topologies, load_topology
from hslite.preflight_check.measurements import LinkModel

FIGURES = ("intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us", "device_memory_gib")


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fit_recovers_known_alpha_and_bandwidth_exactly(world_size):
    alpha, bw, n = 5e-5, 2.5e9, world_size
    points = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (4096, 65536, 1 << 20, 1 << 24)]
    fitted_alpha, fitted_bw = fit_link(points, world_size)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-9)
    assert fitted_bw == pytest.approx(bw, rel=1e-9)


def test_fit_never_returns_negative_latency_or_bandwidth():
    alpha, bw = fit_link([(1000, 1e-4), (2000, 1e-3), (4000, 3e-3)], 2)  # intercept < 0
    assert alpha == pytest.approx(1e-4 / 2) and bw > 0
    alpha, bw = fit_link([(1000, 2e-3), (1 << 20, 1e-3)], 4)  # flat: latency-bound, BW bounded from below
    assert alpha > 0 and bw > 0
    with pytest.raises(ConfigError, match="≥ 2 sizes"):
        fit_link([(1000, 1e-3)], 2)


def test_link_model_round_trips_through_json_dict():
    link = LinkModel(1e-5, 3e9, 0.25, "test", [(4096, 1e-4)])
    assert LinkModel.from_dict(link.to_dict()) == link
    free = LinkModel.no_cost()
    assert free.to_dict()["bandwidth_bytes_per_second"] is None
    assert math.isinf(LinkModel.from_dict(free.to_dict()).bandwidth_bytes_per_second)


def test_single_rank_needs_no_measurement():
    link = measure_links(1)
    assert link.alpha_seconds == 0.0 and math.isinf(link.bandwidth_bytes_per_second)


def test_every_topology_loads_and_cites_a_source_for_each_figure():
    names = list_topologies()
    expected = {"pcie4_8", "nvlink_8", "10gbe", "100gbe", "200gbe", "ib_hdr", "nvlink_8_ib_hdr_2nodes"}
    assert expected <= set(names)
    for name in names:
        topology = load_topology(name)
        for figure in FIGURES:
            if getattr(topology, figure) is not None:
                assert len(topology.source[figure]) > 20, (name, figure)
        assert topology.device_memory_bytes > 0


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(ConfigError, match="nvlink_8"):
        load_topology("nvlink_9")


def test_link_for_picks_intra_node_link_inside_a_node_and_inter_node_across():
    topology = load_topology("nvlink_8_100gbe_2nodes")
    inside = topology.link_for(Plan(devices=8, accelerator="gpu"))
    across = topology.link_for(Plan(devices=8, num_nodes=2, accelerator="gpu"))
    assert inside.bandwidth_bytes_per_second == 370e9
    assert across.bandwidth_bytes_per_second == 11e9
    assert topology.bandwidth_ratio == pytest.approx(370 / 11)
    # channel groups stay inside a node while data parallelism crosses
    chag_plan = Plan(devices=8, num_nodes=2, accelerator="gpu", chag=4)
    assert topology.node_link_for(chag_plan).bandwidth_bytes_per_second == 370e9
    assert topology.mapping_refusal(chag_plan) is None
    assert "FSDP's gathers and reduce-scatters across nodes" in topology.mapping_refusal(
        chag_plan.with_(chag=1, fsdp=True)
    )
    assert "channel groups across nodes" in topology.mapping_refusal(chag_plan.with_(devices=6, chag=4))
    assert topology.mapping_refusal(Plan(devices=8, accelerator="gpu", chag=4)) is None  # one node: nothing crosses
    assert load_topology("nvlink_8_ib_hdr_2nodes").mapping_refusal(chag_plan.with_(chag=1, fsdp=True)) is None  # R ≈ 2
    with pytest.raises(ConfigError, match="has 8 × 2"):
        topology.link_for(Plan(devices=16, accelerator="gpu"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_real_two_process_gloo_measurement_is_positive_and_cached(own_cache, monkeypatch):
    link = measure_links(2, backend="gloo", threads_per_process=1, repeats=3, timeout_seconds=45)
    assert link.alpha_seconds > 0 and 0 < link.bandwidth_bytes_per_second < math.inf
    assert 0.0 <= link.overlap <= 1.0 and len(link.points) >= 4
    monkeypatch.setattr(
        importlib.import_module("hslite.preflight_check.hardware.links").mp,
        "start_processes",
        lambda *a, **k: pytest.fail("a cache hit started ranks"),
    )
    assert measure_links(2, backend="gloo", threads_per_process=1, repeats=3) == link


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_measurement_that_overruns_its_timeout_stops_its_ranks_and_says_what_to_do(own_cache):
    with pytest.raises(HSLiteError, match="topology profile"):
        measure_links(2, timeout_seconds=0.5, fresh=True)
