"""On a CUDA device: a one-device fit, every collective on CUDA tensors in hslite's mixed NCCL + gloo group, and a
model's training step without a host-device sync. Skipped, saying so, where torch sees no CUDA device;
benchmarks/gpu_smoke.py runs these paths and more on a GPU box."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from hslite.cli import main

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_one_device_fit_trains_on_cuda(tmp_path):
    overrides = ["recipe=quickstart", "data.scene=synthetic_tiny", "parallel.accelerator=gpu", "train.max_epochs=2",
                 "train.progress=false", "output.save_map=false", f"output.root={tmp_path}"]  # fmt: skip
    assert main(["fit", *overrides]) == 0
    (run,) = (tmp_path / "quickstart").iterdir()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["plan_that_ran"].startswith("1×gpu") and metrics["optimizer_steps"] == 2
    measured = json.loads((run / "preflight.json").read_text())["measured"]
    assert measured["step_seconds"] > 0 and measured["predicted_step_seconds"] > 0


@pytest.mark.distributed
def test_every_collective_on_cuda_tensors_in_the_mixed_group(tmp_path):
    # Section a of the smoke, in a process of its own: a process group, and NCCL's watchdog, stay out of pytest's.
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--section", "a", "--work", str(tmp_path),
               "--out", str(tmp_path)]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert not [line for line in lines if line.startswith("FAIL")], lines
    served = [line for line in lines if line.startswith("PASS a.all_reduce_sum")]
    assert served and "ProcessGroupNCCL" in served[0], lines
    assert any(line.startswith("PASS a.cpu_all_reduce_max") and "ProcessGroupGloo" in line for line in lines), lines


def test_a_model_training_step_makes_no_host_device_sync():
    from hslite.models import get_model
    from hslite.optim import adamw

    device = torch.device("cuda", 0)
    model = get_model("cnn3d", in_bands=20, num_classes=6, patch_size=7).to(device)
    optimizer = adamw(model.parameters())
    x = torch.randn(64, 20, 7, 7, device=device)
    y = torch.randint(0, 6, (64,), device=device)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step creates AdamW's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], f"{len(syncs)} host-device syncs in 3 steps, e.g. {syncs[:2]}"
