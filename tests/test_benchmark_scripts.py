"""The benchmark scripts run end to end (the GPU smoke's CPU dry run is tests/test_gpu_smoke.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], tmp_path: Path, timeout_seconds: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    # Keep the probe and link caches of this machine out of the test: XDG_CACHE_HOME is where platformdirs looks.
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_seconds, check=False
    )


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return lines[-1] if lines else ""


@pytest.mark.slow
def test_preflight_fidelity_quick(tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/preflight_fidelity.py", "--quick"], tmp_path, timeout_seconds=150)
    last = _last_line(result)
    assert re.fullmatch(r"median relative error: \d+%", last), last
    assert re.search(r"^cnn1d-small 2×cpu dp2 b32 acc1 32-true .*(GO|NO-GO)\s+(yes|NO)$", result.stdout, re.M)


@pytest.mark.slow
@pytest.mark.distributed
def test_channel_groups_benchmark_small(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/channel_groups.py", "--batch", "8", "--patch", "3"]
    result = _run(command, tmp_path, timeout_seconds=400)
    last = _last_line(result)
    assert re.fullmatch(r"chag=4 activation memory: \d+% of chag=1", last), last
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s+[124]\s+\d", line)]
    assert [row[0] for row in rows] == ["1", "2", "4"]
    assert all(row[6] == row[7] for row in rows)  # predicted and measured all-gathered bytes agree


@pytest.mark.slow
def test_time_to_accuracy_quick(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/time_to_accuracy.py", "--recipes", "quickstart", "pavia_university_1gpu",
               "--max-epochs", "2"]  # fmt: skip
    result = _run(command, tmp_path, timeout_seconds=300)
    last = _last_line(result)
    assert re.fullmatch(r"worst margin over the better SVM: [+-]\d+\.\d\d OA points", last), last
    assert "skipped pavia_university_1gpu: PaviaU.mat is not under --data-root" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("synthetic_indian_pines")]
    assert [row[2] for row in rows] == ["hslite", "RBF-SVM", "RBF-SVM"]
    assert "capped at 2 epochs" in " ".join(rows[0])


@pytest.mark.slow
def test_allocator_benchmark_quick(tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/allocator.py", "--seconds", "0.05"], tmp_path, timeout_seconds=200)
    last = _last_line(result)
    assert re.fullmatch(r"kept / default at batch 2048, 9x9: \d+\.\d\dx", last), last
    assert len([line for line in result.stdout.splitlines() if re.match(r"^\s+[79]\s+\d+\s", line)]) == 8
