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
