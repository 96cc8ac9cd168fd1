"""The pre-flight check for a recipe: its model and patch shape, its Plan, this box's devices and links -> Verdict.

Needs no scene files: the patch shape comes from the scene registry (bands after removal or PCA), and the batches
the probe times are gathered by the real patch pipeline from a random cube of the scene's size, so data-loading
time is measured too. `hslite preflight` and `hslite fit` both call `preflight_check`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from hslite.config import Config
from hslite.datasets.patches import PatchGatherer
from hslite.datasets.preprocess import pad_reflect, select_bands
from hslite.datasets.scenes import get_scene_spec
from hslite.errors import HSLiteError
from hslite.models import get_model
from hslite.parallel.plan import Plan, plan_from_config, visible_devices
from hslite.preflight.links import list_topologies, load_topology, measure_links_for
from hslite.preflight.probe import probe_for_plans
from hslite.preflight.verdict import NO_GO_EXIT_CODE, Verdict, run_preflight

PROBE_CUBE_MAX_SIDE = 256  # the gather's cost depends on the batch, not the scene size: cap the random cube's side


class PreflightRefused(HSLiteError):
    """The plan cannot be shown to pay (NO-GO), or cannot be checked on this box."""

    exit_code = NO_GO_EXIT_CODE


def input_shape(cfg: Config) -> tuple[int, int, int]:
    """(bands the model sees, patch size, classes) from the registry, without reading the cube."""
    spec = get_scene_spec(cfg.data.scene)
    rows, cols, bands = spec.shape
    water = spec.water_bands if cfg.data.drop_water_bands else ()
    wavelengths = None if spec.wavelengths_nm is None else np.asarray(spec.wavelengths_nm)
    one_pixel = np.zeros((1, 1, bands), dtype=np.float32)
    removed = sorted(set(cfg.data.remove_bands) | set(water))
    kept_cube, _, _ = select_bands(one_pixel, wavelengths, removed, [tuple(r) for r in cfg.data.remove_ranges_nm])
    kept = kept_cube.shape[2]
    return (cfg.data.pca_components or kept), cfg.data.patch_size, len(spec.class_names)


def batch_maker(cfg: Config, bands: int, num_classes: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Batches of b patches gathered by the real pipeline from a random cube of the scene's size (capped)."""
    rows, cols, _ = get_scene_spec(cfg.data.scene).shape
    rows, cols = min(rows, PROBE_CUBE_MAX_SIDE), min(cols, PROBE_CUBE_MAX_SIDE)
    rng = np.random.default_rng(cfg.train.seed)
    cube = rng.standard_normal((rows, cols, bands), dtype=np.float32)
    gatherer = PatchGatherer(pad_reflect(cube, cfg.data.patch_size), cfg.data.patch_size)
    generator = torch.Generator().manual_seed(cfg.train.seed)

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        coords = torch.stack(
            (
                torch.randint(0, rows, (batch_size,), generator=generator),
                torch.randint(0, cols, (batch_size,), generator=generator),
            ),
            dim=1,
        )
        return gatherer.gather(coords), torch.randint(0, num_classes, (batch_size,), generator=generator)

    return make_batch


def _memory_bytes(accelerator: str) -> int:
    if accelerator == "gpu" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _unverifiable(plan: Plan, have: int) -> str | None:
    # CPU "devices" are processes: any count can be started and measured here (sharing cores is what is priced).
    if plan.num_nodes > 1:
        return f"the plan spans {plan.num_nodes} nodes and only this one is visible"
    if plan.accelerator == "gpu" and plan.devices > have:
        return f"the plan needs {plan.devices} GPUs per node but this box has {have} visible"
    return None


def preflight_check(cfg: Config, *, single_device_only: bool = False) -> Verdict:
    """Probe this box, measure its links (or read `preflight.topology`), price every candidate plan, decide.

    With `single_device_only` (a one-device fit), only single-device plans are priced: no processes are started.
    """
    plan = plan_from_config(cfg, check_visible=False)
    have = visible_devices(plan.accelerator)
    missing = _unverifiable(plan, have)
    notes: list[str] = []
    topology = None
    if cfg.preflight.topology:
        topology = load_topology(cfg.preflight.topology)
        notes.append(f"links and device memory from the topology profile {cfg.preflight.topology!r}")
    elif missing:
        raise PreflightRefused(
            f"cannot check {plan.describe()}: {missing}. To predict it from a profile of the intended machine, "
            f"add preflight.topology=NAME (one of: {', '.join(list_topologies())}); to check this box, "
            + (f"ask for at most {have} devices." if have else "use parallel.accelerator=cpu (gloo processes).")
        )

    bands, patch, classes = input_shape(cfg)
    model_name, size = cfg.model.name, cfg.model.size

    def model_factory() -> torch.nn.Module:
        return get_model(model_name, in_bands=bands, num_classes=classes, patch_size=patch, size=size)

    probe_kwargs: dict[str, Any] = {
        "cache_key": f"{model_name}-{size}-{bands}x{patch}x{patch}-c{classes}",
        "fresh": cfg.preflight.fresh,
        "steps": cfg.preflight.probe_steps,
        "measure_compression": plan.compression_enabled,
    }
    if model_name == "channel_vit":
        probe_kwargs["tokenizer_modules"] = ("tokenizer", "partial_aggregation")
    probe_for = probe_for_plans(model_factory, batch_maker(cfg, bands, classes), **probe_kwargs)
    if plan.accelerator == "gpu" and not torch.cuda.is_available():
        cpu_probe = probe_for
        probe_for = lambda p: cpu_probe(replace(p, accelerator="cpu", devices=1))  # noqa: E731
        notes.append("no GPU here: step times measured on this CPU stand in for the GPU's (ratios, not seconds)")

    def loop_seconds_for(p: Plan) -> float:
        from hslite.preflight.overhead import measure_step_overhead

        # Ranks this box cannot start (other nodes, absent GPUs) are priced with one local rank's loop.
        runnable = topology is None and (p.accelerator == "cpu" or p.devices <= have)
        ranks = p.devices if runnable and p.num_nodes == 1 else 1
        accelerator = p.accelerator if p.accelerator == "cpu" or have else "cpu"
        return measure_step_overhead(Plan(devices=ranks, accelerator=accelerator), classes, fresh=cfg.preflight.fresh)

    if topology is not None:
        notes.append("training-loop cost of several ranks not measurable here: one local rank's figure is used")
    verdict = run_preflight(
        plan,
        probe_for,
        None if topology else (lambda p: measure_links_for(p, fresh=cfg.preflight.fresh)),
        None if topology else _memory_bytes(plan.accelerator),
        cfg.preflight.min_efficiency,
        1 if single_device_only else (None if topology else max(plan.devices, min(have, 16))),
        topology=topology,
        chag_supported=model_name == "channel_vit",
        loop_seconds_for=loop_seconds_for,
    )
    verdict.reasons += notes
    return verdict
