"""benchmarks/gpu_smoke.py: its CPU dry run passes every check it can run and says why it skips the CUDA ones; the
wheel folder is matched to its requirements."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"


def _smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_folder_is_matched_to_the_requirements(tmp_path, monkeypatch):
    smoke = _smoke_module()
    monkeypatch.setattr(smoke, "WHEELS", tmp_path)
    required = smoke.required_wheels()
    assert "rasterio==1.4.4" in required and "spectral==0.25" in required and "setuptools==84.2.1" in required
    (tmp_path / "click_plugins-1.1.1.2-py2.py3-none-any.whl").touch()  # "-" in the name becomes "_" in the file
    (tmp_path / "rasterio-1.4.4-cp312-cp312-manylinux_2_28_x86_64.whl").touch()
    (tmp_path / "rasterio-1.4.3-cp312-cp312-manylinux_2_28_x86_64.whl").touch()  # another version does not count
    found, missing = smoke.find_wheels()
    assert sorted(path.name for path in found) == [
        "click_plugins-1.1.1.2-py2.py3-none-any.whl",
        "rasterio-1.4.4-cp312-cp312-manylinux_2_28_x86_64.whl",
    ]
    assert len(missing) == len(required) - 2 and "omegaconf==2.4.0" in missing


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_the_dry_run_passes_and_says_why_it_skips(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHONUNBUFFERED="1")
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # this machine's probe and link caches stay out of it
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=360, check=False)  # fmt: skip
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-4000:]}\n{result.stderr[-2000:]}"
    summary = re.fullmatch(r"SUMMARY pass=(\d+) fail=0 skip=(\d+)", output.strip().splitlines()[-1])
    assert summary, output[-3000:]
    assert int(summary[1]) >= 25, output  # every section ran: a's 10 collectives, b's 8 fits, c, d, e
    statuses = {name: status for status, name in re.findall(r"^(PASS|FAIL|SKIP) (\S+): ", output, re.M)}
    for name in ("a.all_reduce_avg", "a.cpu_all_reduce_max", "b.resume", "b.fsdp2_ws1", "c.int8_hook",
                 "c.token_exchange", "e.fp32"):  # fmt: skip
        assert statuses.get(name) == "PASS", (name, output)
    skips = dict(re.findall(r"^SKIP (\S+): (.*)$", output, re.M))
    for name in ("env.gpu", "d.gpu_paths", "e.hybridsn_fit"):  # need CUDA, or minutes on a CPU
        assert len(skips.get(name, "")) > 30, (name, skips)  # skipped, with the reason in words
    out = tmp_path / "out"
    assert {"smoke.log", "summary.txt", "results.json", "confusion.png"} <= {p.name for p in out.iterdir()}
    assert len(list(out.iterdir())) <= 8
