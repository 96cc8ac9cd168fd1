"""Machine profiles for devices and nodes that are not visible here: links, device memory, a source per figure.

Multi-node and absent-GPU plans are priced from these (a multi-node plan is launched with torchrun or srun on every
node, `parallel/launched.py`). Profiles are YAML files, read with `yaml.safe_load`: bundled ones in `topologies/` by
name, or a team's own by path (`hslite topology measure` writes one from this box's measured links: docs/design.md,
mapping across a topology).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from hslite.errors import ConfigError
from hslite.parallel.plan import Plan
from hslite.preflight_check.hardware.bundled import bundled_names, read_bundled
from hslite.preflight_check.measurements import LinkModel

# R = B_intra / B_inter below which a flat layout is kept: per-layer collectives (channel groups, FSDP) may span
# nodes, since splitting them into intra- and inter-node phases gains little. From here up they stay inside a node
# and only data parallelism crosses (docs/design.md, mapping across a topology): a profile's `max_cross_node_ratio`.
PER_LAYER_CROSS_NODE_MAX_RATIO = 4.0


@dataclass(frozen=True)
class Topology:
    """A machine profile: nodes × GPUs, intra- and inter-node links, device memory, and the source of each figure."""

    name: str
    nodes: int
    gpus_per_node: int
    intra_gbps: float | None  # GB/s all-reduce busbw inside a node; None when nodes hold one GPU
    inter_gbps: float | None  # GB/s busbw across nodes; None for a single node
    intra_latency_us: float | None
    inter_latency_us: float | None
    device_memory_gib: float
    source: dict[str, str]  # one citation per figure
    overlap: float = 0.0  # DDP overlap assumed for these links; 0 is the no-overlap bound
    # R from which per-layer communication stays inside a node: 4, or this cluster's calibrated figure
    max_cross_node_ratio: float = PER_LAYER_CROSS_NODE_MAX_RATIO
    measured: bool = False  # measured on a launched job's own ranks (`job_links`), not read from a profile
    # with `measured`: the training loop's cost per micro-step timed with the job's own ranks (`loop_cost`)
    job_loop_seconds: float | None = None

    @property
    def device_memory_bytes(self) -> int:
        """Memory of one device."""
        return int(self.device_memory_gib * 2**30)

    @property
    def layout(self) -> tuple[int, int]:
        """(nodes, devices per node)."""
        return self.nodes, self.gpus_per_node

    @property
    def bandwidth_ratio(self) -> float:
        """R = B_intra / B_inter (docs/design.md, mapping); infinite on one node, 1 with one GPU a node (flat)."""
        if self.inter_gbps is None:
            return math.inf
        return 1.0 if self.intra_gbps is None else self.intra_gbps / self.inter_gbps

    @property
    def per_layer_across_nodes(self) -> bool:
        """Whether per-layer collectives (channel groups, FSDP) may span nodes: R below `max_cross_node_ratio`."""
        return self.bandwidth_ratio < self.max_cross_node_ratio

    def describe_links(self) -> str:
        """The links and R in a line: "inside a node 9.1 GB/s, 41 µs; across nodes 2.3 GB/s, 120 µs; R = 4.0 ..."."""
        parts = [
            f"{where} {gbps:.3g} GB/s, {latency:.3g} µs"
            for where, gbps, latency in (
                ("inside a node", self.intra_gbps, self.intra_latency_us),
                ("across nodes", self.inter_gbps, self.inter_latency_us),
            )
            if gbps is not None and latency is not None
        ]
        ratio = "" if math.isinf(self.bandwidth_ratio) else f"; R = {self.bandwidth_ratio:.2g}"
        return (
            "; ".join(parts) + ratio + f" (per-layer communication crosses nodes below {self.max_cross_node_ratio:g})"
        )

    def _link(self, gbps: float | None, latency_us: float | None, where: str) -> LinkModel:
        if gbps is None or latency_us is None:
            raise ConfigError(f"topology {self.name!r} has no {where} link; use a profile that lists {where}_gbps.")
        return LinkModel(latency_us * 1e-6, gbps * 1e9, self.overlap, f"topology {self.name}: {where}-node")

    def _check(self, plan: Plan) -> None:
        if plan.devices > self.gpus_per_node or plan.num_nodes > self.nodes:
            raise ConfigError(
                f"plan {plan.describe()} needs {plan.devices} devices × {plan.num_nodes} nodes but topology "
                f"{self.name!r} has {self.gpus_per_node} × {self.nodes}; lower devices/num_nodes or pick another."
            )

    def link_for(self, plan: Plan) -> LinkModel:
        """The gradient all-reduce link (every rank): intra-node when the plan fits in one node, else inter-node."""
        self._check(plan)
        if plan.world_size <= 1:
            return LinkModel.no_cost()
        if plan.num_nodes == 1:
            return self._link(self.intra_gbps, self.intra_latency_us, "intra")
        return self._link(self.inter_gbps, self.inter_latency_us, "inter")

    def node_link_for(self, plan: Plan) -> LinkModel:
        """The link of per-layer groups the mapping keeps inside a node: channel groups, a hybrid FSDP shard group.

        Intra-node while the group fits in a node; a channel group that does not crosses on the inter-node link.
        """
        self._check(plan)
        if plan.fsdp and plan.hybrid_shard:
            return (
                self._link(self.intra_gbps, self.intra_latency_us, "intra") if plan.devices > 1 else LinkModel.no_cost()
            )
        if plan.chag <= 1:
            return LinkModel.no_cost()
        if plan.chag <= plan.devices and plan.devices % plan.chag == 0:
            return self._link(self.intra_gbps, self.intra_latency_us, "intra")
        return self._link(self.inter_gbps, self.inter_latency_us, "inter")

    def mapping_refusal(self, plan: Plan) -> str | None:
        """Why `plan` breaks the mapping rule (docs/design.md), or None: per-layer communication across a slow link.

        Channel groups are consecutive ranks, so they stay inside a node when `chag` divides the devices per node;
        FSDP shards over every rank unless hybrid (inside each node). Either crosses nodes only while R is below
        `max_cross_node_ratio`.
        """
        chag_crosses = plan.chag_enabled and plan.num_nodes > 1 and plan.devices % plan.chag != 0
        fsdp_crosses = plan.fsdp and plan.num_nodes > 1 and not plan.hybrid_shard
        if not (chag_crosses or fsdp_crosses) or self.per_layer_across_nodes:
            return None
        what = "its channel groups" if chag_crosses else "FSDP's gathers and reduce-scatters"
        inside = (
            f"parallel.chag dividing parallel.devices={plan.devices}"
            if chag_crosses
            else "parallel.hybrid_shard=true: FSDP inside each node, one replica per node"
        )
        return (
            f"{plan.describe()} sends {what} across nodes, on a link {self.bandwidth_ratio:.1f}× slower than inside a "
            f"node (R = B_intra / B_inter ≥ {self.max_cross_node_ratio:g}, the topology's max_cross_node_ratio): "
            f"keep per-layer communication inside a node ({inside}) and data parallelism across nodes"
        )


def list_topologies() -> list[str]:
    """Names of the bundled topology profiles."""
    return bundled_names("topologies")


def max_cross_node_ratio(topology: str | None) -> float:
    """The bandwidth-ratio threshold of the mapping rule: `preflight.topology`'s (a team's calibration), else 4."""
    return load_topology(topology).max_cross_node_ratio if topology else PER_LAYER_CROSS_NODE_MAX_RATIO


def load_topology(name: str) -> Topology:
    """A bundled profile by name, or a profile file by path (`*.yaml`/`*.yml`), read with yaml.safe_load.

    An unknown name raises ConfigError listing the known ones; a file that does not exist, is not a mapping or
    lacks a figure's source says so.
    """
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"topology file {str(path)!r} does not exist; `hslite topology measure --output "
                              f"{name}` writes one from this box's links, or name a bundled profile "
                              f"({', '.join(list_topologies())}).")  # fmt: skip
        return _topology(path.stem, yaml.safe_load(path.read_text()), f"topology file {path}")
    return _topology(name, read_bundled("topologies", name, "topology"), f"topology file {name}.yaml")


def _topology(name: str, data: object, where: str) -> Topology:
    figures = ("intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us", "device_memory_gib")
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of {', '.join(figures)} and their sources; got {data!r}.")
    measured_only = sorted({"name", "measured", "job_loop_seconds"} & data.keys())
    if measured_only:
        raise ConfigError(
            f"{where} sets {', '.join(measured_only)}, which only a launched job's own measurement sets; remove them."
        )
    try:
        topology = Topology(name=name, **data)
    except TypeError as err:
        raise ConfigError(f"{where} is malformed ({err}); expected keys {figures}.") from err
    uncited = [f for f in figures if getattr(topology, f) is not None and f not in topology.source]
    if uncited:
        raise ConfigError(f"{where} gives {', '.join(uncited)} without a source; cite each figure.")
    return topology
