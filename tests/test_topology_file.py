"""A team's own topology: measured on this box into a file, read by path, its bandwidth-ratio threshold its own."""

from __future__ import annotations

import pytest
import yaml

from hslite.cli import main
from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.preflight_check.hardware.topology import load_topology
from hslite.preflight_check.price.candidates import candidate_plans


def test_the_measure_command_writes_a_profile_the_preflight_reads(tmp_path, capsys):
    path = tmp_path / "box.yaml"
    assert main(["topology", "measure", "--devices", "2", "--accelerator", "cpu", "--output", str(path)]) == 0
    topology = load_topology(str(path))
    assert topology.name == "box" and topology.gpus_per_node == 2 and topology.nodes == 1
    assert topology.intra_gbps > 0 and topology.intra_latency_us >= 0 and topology.inter_gbps is None
    assert "gloo ranks" in topology.source["intra_gbps"] and topology.max_cross_node_ratio == 4.0
    assert f"preflight.topology={path}" in capsys.readouterr().out
    before = path.read_text()
    assert main(["topology", "measure", "--devices", "2", "--accelerator", "cpu", "--output", str(path)]) == 2
    assert "exists" in capsys.readouterr().err and path.read_text() == before  # nothing overwritten


def test_a_profile_file_is_read_by_path_and_bad_ones_are_named(tmp_path):
    bundled = load_topology("nvlink_8_100gbe_2nodes")
    profile = _as_file(bundled)
    (tmp_path / "ours.yaml").write_text(yaml.safe_dump(profile))
    ours = load_topology(str(tmp_path / "ours.yaml"))
    assert ours.name == "ours" and ours.bandwidth_ratio == bundled.bandwidth_ratio
    with pytest.raises(ConfigError, match="does not exist; `hslite topology measure"):
        load_topology(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_topology(str(tmp_path / "list.yaml"))
    del profile["source"]["inter_gbps"]
    (tmp_path / "uncited.yaml").write_text(yaml.safe_dump(profile))
    with pytest.raises(ConfigError, match="inter_gbps without a source"):
        load_topology(str(tmp_path / "uncited.yaml"))


def test_the_bandwidth_ratio_threshold_is_the_profiles_setting(tmp_path):
    bundled = load_topology("nvlink_8_100gbe_2nodes")  # R = 370 / 11 ≈ 34: per-layer traffic stays in a node
    requested = Plan(devices=8, num_nodes=2, accelerator="gpu", batch_size=32)

    def fsdp_across_nodes(across: bool) -> list[Plan]:
        plans = candidate_plans(requested, 8, include_fsdp=True, per_layer_across_nodes=across)
        return [p for p in plans if p.fsdp and p.num_nodes > 1 and not p.hybrid_shard]

    assert not bundled.per_layer_across_nodes and not fsdp_across_nodes(bundled.per_layer_across_nodes)
    assert "max_cross_node_ratio" in bundled.mapping_refusal(requested.with_(fsdp=True))
    profile = {**_as_file(bundled), "max_cross_node_ratio": 50.0}  # this cluster's calibration
    (tmp_path / "calibrated.yaml").write_text(yaml.safe_dump(profile))
    calibrated = load_topology(str(tmp_path / "calibrated.yaml"))
    assert calibrated.per_layer_across_nodes and fsdp_across_nodes(calibrated.per_layer_across_nodes)
    assert calibrated.mapping_refusal(requested.with_(fsdp=True)) is None


def _as_file(topology) -> dict:
    """A bundled profile as the mapping its file holds."""
    figures = ("nodes", "gpus_per_node", "intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us")
    return {**{key: getattr(topology, key) for key in figures}, "device_memory_gib": topology.device_memory_gib,
            "source": dict(topology.source)}  # fmt: skip


def test_a_profile_cannot_claim_to_be_a_launched_jobs_measurement(tmp_path):
    profile = {**_as_file(load_topology("ib_hdr")), "measured": True, "job_loop_seconds": 0.001}
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump(profile))
    with pytest.raises(ConfigError, match="sets job_loop_seconds, measured, which only a launched job"):
        load_topology(str(tmp_path / "claims.yaml"))
