"""The scripts in examples/ run as a user runs them (CI runs this file with the slow tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from quick_fit import NO_PREFLIGHT, QUICK_FIT

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_own_model_example_trains_and_maps(tmp_path):
    script = REPO / "examples" / "own_model" / "train.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(script), *QUICK_FIT, NO_PREFLIGHT, "output.root=runs"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OA " in done.stdout and "best weights: " in done.stdout and "map of 576 pixels in " in done.stdout
    assert any((tmp_path / "runs" / "quickstart").glob("*/predict/*/prediction.tif"))


def _own_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = REPO / "examples" / "own_script" / "train.py"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, str(script), "--epochs", "1", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_own_script_example_asks_the_preflight_and_trains_through_the_gate_on_two_processes(tmp_path):
    done = _own_script(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "pre-flight: " in out and "for 2×cpu dp2 b64 acc1 32-true, predicted step " in out
    assert "SpectralCNN's own training_step and configure_optimizers" in out
    assert "gate on the launched ranks: " in out and "measured step " in out and "validation accuracy " in out


@pytest.mark.slow
def test_own_script_example_refuses_a_no_go_plan_on_every_rank_before_training(tmp_path):
    # No two-process plan reaches E = 2, so the verdict is NO-GO whatever this box measures
    done = _own_script(tmp_path, "--enforce", "--min-efficiency", "2")
    assert done.returncode != 0
    assert done.stderr.count("PreflightRefused: NO-GO for 2×cpu dp2 b64 acc1 32-true") == 2, done.stderr[-3000:]
    assert "Better: 1×cpu" in done.stderr and "validation accuracy" not in done.stdout
