"""Refuse, before reading a pixel, a scene whose fit would not fit in host memory, and say which settings would.

The estimate is this process's resident memory now (the interpreter, torch, Lightning) plus what a fit will hold of
the scene (`InputPlan.peak_bytes`: the padded input, the blocks being read, the per-pixel map arrays, the raw cube when
its reader holds it whole) plus `RUN_ALLOWANCE_BYTES` for the rest of the run. The budget is `data.host_memory_gb`
when set, else what the machine (or its cgroup) has available now plus what this process already holds. With
`data.gather_on_device` the padded input must also fit in the GPU's free memory.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from hslite.datasets.datamodule import HSIDataModule
from hslite.datasets.input_plan import InputPlan
from hslite.errors import ConfigError
from hslite.recipe.schema import Config

GB = 1e9
# What a fit holds beyond its imports and the scene: the Trainer, the model, batches, map.png's figure. A choice
# above what benchmarks/scene_scaling.py measures for the 1 and 2 GB cubes (the peak RSS of fit less the parts
# above), leaving room for a larger model.
RUN_ALLOWANCE_BYTES = int(0.25 * GB)


def resident_bytes() -> int:
    """Resident memory of this process now (its peak so far where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_bytes() -> int | None:
    """Memory the machine can still give this process: MemAvailable, less where a cgroup v2 limit binds, else None."""
    found = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        found.append(int(meminfo["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        own = Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip()  # cgroup v2: "0::/path"
        group = Path("/sys/fs/cgroup") / own.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((group / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        pass
    return min(found) if found else None


def need_bytes(plan: InputPlan, held: int) -> int:
    """Peak host bytes of a fit of `plan` by a process that already holds `held`."""
    return held + sum(plan.peak_bytes().values()) + RUN_ALLOWANCE_BYTES


def check_host_memory(cfg: Config, datamodule: HSIDataModule) -> None:
    """Raise a ConfigError (one sentence: estimate, budget, the settings that fit) when a fit would not fit."""
    d = cfg.data
    plan = datamodule.input_plan()
    held = resident_bytes()
    if d.host_memory_gb:
        budget, whose = int(d.host_memory_gb * GB), f"data.host_memory_gb={d.host_memory_gb:g} allows"
    else:
        free = available_bytes()
        if free is None:
            return  # nothing to compare with: the run goes ahead, as before this check existed
        budget, whose = free + held, "this machine has available"
    parts = plan.peak_bytes()
    need = need_bytes(plan, held)
    rows, cols, bands = plan.shape
    if need > budget:
        held_part = f"{held / GB:.2f} GB this process holds already, {RUN_ALLOWANCE_BYTES / GB:.2f} GB for the run"
        raw = f", {parts['raw'] / GB:.2f} GB of raw cube read whole" if parts["raw"] else ""
        raise ConfigError(
            f"data.scene={d.scene} ({rows}×{cols}×{bands}, {4 * rows * cols * bands / GB:.2f} GB as float32) needs "
            f"about {need / GB:.2f} GB of host memory to fit with {plan.input_bands} bands in and "
            f"data.patch_size={plan.patch_size} ({parts['input'] / GB:.2f} GB of padded input, "
            f"{parts['blocks'] / GB:.2f} GB of blocks being read, {parts['map'] / GB:.2f} GB for the map{raw}, "
            f"{held_part}), more than the {budget / GB:.2f} GB {whose}: {_what_fits(plan, held, budget, d.scene)}."
        )
    _check_device_memory(d.gather_on_device, parts["input"])


def _what_fits(plan: InputPlan, held: int, budget: int, scene: str) -> str:
    """The settings that would fit `budget`, as a clause of the refusal."""
    fixes = []
    bands = plan.input_bands - 1
    while bands >= 1 and need_bytes(plan.with_input(input_bands=bands), held) > budget:
        bands = bands * 9 // 10 if bands > 10 else bands - 1  # a few dozen tries, not one per band
    if bands >= 1:
        fixes.append(f"data.pca_components={bands} (or at most {bands} bands kept, with data.remove_bands)")
    patch = plan.patch_size - 2
    while patch >= 1 and need_bytes(plan.with_input(patch_size=patch), held) > budget:
        patch -= 2
    if patch >= 1:
        fixes.append(f"data.patch_size={patch}")
    if not plan.on_disk and need_bytes(plan.with_input(on_disk=True), held) <= budget:
        fixes.append("data.on_disk=true (the labelled pixels' patches held, the scene mapped a block at a time)")
    if plan.resident and Path(scene.split(":")[0]).suffix:
        fixes.append("the cube saved as .npy, ENVI or GeoTIFF (read a block at a time, not whole)")
    fixes.append("more memory (data.host_memory_gb says how much this run may use)")
    return "set " + ", or ".join(fixes)


def _check_device_memory(gather_on_device: bool, input_bytes: int) -> None:
    """Refuse a device-resident input larger than the GPU's free memory (the GPU check runs only where one is)."""
    import torch

    if not gather_on_device or not torch.cuda.is_available():
        return
    free, _ = torch.cuda.mem_get_info()
    if input_bytes > free:
        raise ConfigError(
            f"data.gather_on_device=true puts the {input_bytes / GB:.2f} GB padded input on the GPU, which has "
            f"{free / GB:.2f} GB free: set data.gather_on_device=false (batches are gathered on the host), or fewer "
            "bands in (data.pca_components)."
        )
