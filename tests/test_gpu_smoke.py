"""benchmarks/gpu_smoke.py: its steps fit its budget, most valuable first; too old a torch or Lightning stops it in one
sentence; its CPU dry run passes every check it can run and says why it skips the CUDA ones; the wheel folder is
matched to its requirements."""

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
FLOORS = ["torch>=2.6", "lightning>=2.6", "numpy>=1.24", 'pytest>=8; extra == "test"', 'torch>=9; extra == "dev"']


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


def test_the_steps_fit_the_budget_calibration_first():
    smoke = _smoke_module()
    lines, fits = smoke.budget_plan()
    total = smoke.INSTALL_SECONDS + sum(limit for _, limit, _ in smoke.SECTIONS.values())
    assert fits and total <= smoke.BUDGET_SECONDS
    assert list(smoke.SECTIONS)[:2] == ["e", "d"]  # the probe against the real step, then the data path against it
    assert len(lines) == 1 + len(smoke.SECTIONS) + 1 and lines[-1].endswith("budget: fits")


def test_steps_over_the_budget_stop_the_smoke_before_it_starts(tmp_path, monkeypatch, capsys):
    smoke = _smoke_module()
    module, limit, what = smoke.SECTIONS["e"]
    monkeypatch.setitem(smoke.SECTIONS, "e", (module, limit + smoke.BUDGET_SECONDS, what))
    monkeypatch.setattr(sys, "argv", ["gpu_smoke.py", "--dry-run", "--out", str(tmp_path / "out")])
    assert smoke.main() == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # nothing ran


def test_too_old_a_torch_or_lightning_is_named_in_one_sentence():
    gap = _smoke_module().version_gap
    assert gap(FLOORS, {"torch": "2.11.0+cu130", "lightning": "2.6.6"}) == ""  # extras' requirements do not count
    assert gap(FLOORS, {"torch": "2.7.0a0+gitabc", "lightning": "2.6.0"}) == ""  # a build ahead of a release will do
    sentence = gap(FLOORS, {"torch": "2.5.1+cu124", "lightning": None})
    assert sentence == (
        "this box has torch 2.5.1+cu124 and no lightning but hslite needs torch>=2.6 and lightning>=2.6: install "
        "that, then run the smoke again"
    )
    assert gap(FLOORS, {"torch": "2.6.0", "lightning": "2.5.5"}).startswith("this box has lightning 2.5.5 but ")


def test_the_summary_names_what_one_gpu_cannot_check():
    smoke = _smoke_module()
    checks = [
        ("PASS", "b.int8_round_trip", "bitwise the CPU's"),
        ("SKIP", "b.int8_nccl", f"{smoke.ONE_GPU}, and at world size 1 the hook sends nothing"),
        ("SKIP", "env.c_kernel", "not built"),
        ("SKIP", "c.nccl_two_ranks", f"{smoke.ONE_GPU} (NCCL refuses two ranks on one GPU)"),
    ]
    assert smoke.summary_line(checks) == (
        "SUMMARY pass=1 fail=0 skip=3; not checked: b.int8_nccl, c.nccl_two_ranks (a one-GPU box cannot run two "
        "NCCL ranks)"
    )
    assert smoke.summary_line(checks[:1]) == "SUMMARY pass=1 fail=0 skip=0"


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
    smoke = _smoke_module()
    for section, (_, limit, _) in smoke.SECTIONS.items():  # the plan, printed before anything runs
        assert re.search(rf"^  {section} +{limit} s  \S", output, re.M), (section, output[:2000])
    assert f"of the {smoke.BUDGET_SECONDS} s budget: fits" in output
    assert re.findall(r"^-- section (\w)", output, re.M) == list(smoke.SECTIONS)  # in the plan's order
    summary = re.fullmatch(r"SUMMARY pass=(\d+) fail=0 skip=(\d+)", output.strip().splitlines()[-1])
    assert summary, output[-3000:]
    assert int(summary[1]) >= 20, output  # every section ran: e, d, a's collectives, b's fits, c
    statuses = {name: status for status, name in re.findall(r"^(PASS|FAIL|SKIP) (\S+): ", output, re.M)}
    for name in ("env.versions", "e.fp32", "a.fence_group", "a.all_reduce_avg", "a.cpu_all_reduce_max",
                 "b.int8_round_trip", "b.resume", "b.ddp_int8_ws1", "b.fsdp2_ws1", "c.int8_hook",
                 "c.token_exchange"):  # fmt: skip
        assert statuses.get(name) == "PASS", (name, output)
    assert re.search(r"^PASS env.versions: .* the installed hslite's torch>=\S+, lightning>=\S+$", output, re.M)
    skips = dict(re.findall(r"^SKIP (\S+): (.*)$", output, re.M))
    for name in ("env.gpu", "d.gpu_paths", "e.hybridsn_fit", "a.bound_group", "b.int8_nccl"):  # need CUDA or NCCL
        assert len(skips.get(name, "")) > 30, (name, skips)  # skipped, with the reason in words
    out = tmp_path / "out"
    assert {"smoke.log", "summary.txt", "results.json", "confusion.png"} <= {p.name for p in out.iterdir()}
    assert len(list(out.iterdir())) <= 8
