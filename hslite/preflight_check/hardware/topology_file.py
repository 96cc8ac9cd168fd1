"""`hslite topology measure`: this box's links measured and written as a topology profile a team can price from.

docs/design.md prices a topology with a bandwidth ratio and links calibrated with this cluster's measured ones. The file
is what `preflight.topology=PATH` reads: the ring all-reduce of `devices` ranks as this box runs it (gloo processes, or
NCCL on GPUs), fitted to latency + bytes / bandwidth over message sizes (`links.measure_links`), with the memory one
rank has, each figure's source naming the measurement. One node: the inter-node figures (and `nodes`) are written empty
for a team to fill from its own measurement of the network, with their source.
"""

from __future__ import annotations

import datetime
import platform
from pathlib import Path
from typing import Any

import yaml

from hslite.errors import ConfigError
from hslite.parallel.plan import Accelerator, Plan
from hslite.preflight_check.hardware.launcher_cuda import device_memory_bytes
from hslite.preflight_check.hardware.links import measure_links_for
from hslite.preflight_check.hardware.topology import PER_LAYER_CROSS_NODE_MAX_RATIO, load_topology


def measure_topology(devices: int, accelerator: Accelerator, *, fresh: bool = False) -> dict[str, Any]:
    """A one-node topology profile of this box's link for `devices` ranks, every figure with its source."""
    if devices < 2:
        raise ConfigError(f"measuring a link needs at least 2 ranks; got --devices {devices}.")
    link = measure_links_for(Plan(devices=devices, accelerator=accelerator), fresh=fresh)
    ranks = f"{devices} {'NCCL' if accelerator == 'gpu' else 'gloo'} ranks"
    where = f"`hslite topology measure` on {platform.node()}, {datetime.date.today().isoformat()}"
    fitted = f"{where}: ring all-reduce of {ranks}, latency + bytes / busbw fitted over {len(link.points)} sizes"
    memory = "free memory of the probed GPU" if accelerator == "gpu" else "this host's memory, shared by its ranks"
    return {
        "nodes": 1,
        "gpus_per_node": devices,
        "intra_gbps": round(link.bandwidth_bytes_per_second / 1e9, 4),
        "inter_gbps": None,
        "intra_latency_us": round(link.alpha_seconds * 1e6, 3),
        "inter_latency_us": None,
        "device_memory_gib": round(device_memory_bytes(accelerator) / 2**30, 2),
        "max_cross_node_ratio": PER_LAYER_CROSS_NODE_MAX_RATIO,
        "source": {
            "intra_gbps": fitted,
            "intra_latency_us": fitted,
            "device_memory_gib": f"{where}: {memory}",
            "max_cross_node_ratio": "the default threshold (docs/design.md); replace it with this cluster's",
        },
    }


def write_topology(profile: dict[str, Any], output: str) -> Path:
    """Write `profile` to `output` (*.yaml), refusing to overwrite, and read it back as `preflight.topology` would."""
    path = Path(output).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--output must name a .yaml file; got {output!r}.")
    if path.exists():
        raise ConfigError(f"{path} exists; name another file or remove it first (nothing was written).")
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# A topology profile for preflight.topology=PATH (hslite README, 'Before you scale').\n"
    path.write_text(header + yaml.safe_dump(profile, sort_keys=False, allow_unicode=True))
    load_topology(str(path))  # what was written is what the pre-flight reads
    return path
