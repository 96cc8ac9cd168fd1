"""What the launching process asks of CUDA before any rank starts: the ranks' free memory and the GPUs it may touch.

The launcher probes one GPU (`probe.PROBE_DEVICE`) and trains on none but that one; asking anything of another GPU
creates a CUDA context there, which this process would then hold, beside that GPU's rank, for the whole run.
"""

from __future__ import annotations

import os

import torch

from hslite.parallel.plan import Plan
from hslite.preflight_check.measure.probe import PROBE_DEVICE


def device_memory_bytes(accelerator: str) -> int:
    """One device's memory budget: what the probed GPU has free, or this host's memory for CPU processes.

    Free, not total, on a GPU: other processes' allocations, the CUDA context this launching process keeps there
    while the ranks train and the libraries its probe loaded are not the ranks' to use. Read after the
    probe (`run_preflight` calls it when the first plan is priced) and after the probe has handed its cached blocks
    back (`probe_model`), because the ranks start after the probe: what is free then is their budget. Only the
    probed GPU is asked, since asking another creates a CUDA context there; with nothing else running on the others
    it is the tightest, the launcher's context sitting on it alone. Not in this figure: the CUDA context each
    spawned rank creates on its own GPU (a one-device plan trains in this process, whose context is already out).
    """
    if accelerator == "gpu" and torch.cuda.is_available():
        free_bytes, _ = torch.cuda.mem_get_info(PROBE_DEVICE)
        return int(free_bytes)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def forked_cuda_devices(plan: Plan, from_profile: bool) -> list[torch.device]:
    """The CUDA devices whose generators a pre-flight gives back: the probed GPU, or the current one, or none.

    The probed GPU when the check runs there; else the current device where CUDA is already up, as the probe's
    seeding reaches every CUDA generator; else none. Reading a GPU's generator creates a CUDA context on it that
    this launching process then holds for the whole run, before a rank has started: forking every device cost that
    on each GPU. Other GPUs only ever run spawned ranks, which seed their own generators.
    """
    if not torch.cuda.is_available():
        return []
    if plan.accelerator == "gpu" and not from_profile:  # the probe runs there
        return [torch.device(PROBE_DEVICE)]
    return [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_initialized() else []
