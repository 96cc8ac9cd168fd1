"""The benchmark scripts run end to end (the GPU smoke's CPU dry run is tests/test_gpu_smoke.py)."""

from __future__ import annotations

import json
import os
import re
import statistics
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


def _compare_table(stdout: str) -> list[dict[str, str]]:
    """The rows of the table `hslite compare` prints (rich's box characters), as {column: cell}."""
    lines = stdout.splitlines()
    names = [cell.strip() for cell in next(line for line in lines if line.startswith("┃")).strip("┃").split("┃")]
    cells = [[cell.strip() for cell in line.strip("│").split("│")] for line in lines if line.startswith("│")]
    return [dict(zip(names, row, strict=True)) for row in cells]


@pytest.mark.slow
@pytest.mark.distributed
def test_preflight_fidelity_quick(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/preflight_fidelity.py", "--quick", "--keep", str(tmp_path / "keep")]
    last = _last_line(result := _run(command, tmp_path, timeout_seconds=500))
    summary = re.fullmatch(
        r"median prediction error: (\d+)%; verdict held on (\d+) of (\d+) multi-device rows \(GO iff measured E ≥ "
        r"([\d.]+)\)",
        last,
    )
    assert summary, last
    rows = _compare_table(result.stdout)
    matrix = [f"cnn1d-small {plan}" for plan in ("1×cpu dp1 b64 acc1 32-true", "1×cpu dp1 b16 acc4 32-true",
                                                 "2×cpu dp2 b32 acc1 32-true")]  # fmt: skip
    assert [row["row"] for row in rows[:3]] == matrix
    assert all(row["plan"] == row["row"].removeprefix("cnn1d-small ") for row in rows[:3])
    # The 2-process verdict priced its E against a best one-process plan, which this box's probe picks: a row of the
    # matrix, or else the reference row compare added to fit it.
    (folder,) = (tmp_path / "keep" / "compare").iterdir()
    best_single = json.loads((folder / "compare.json").read_text())["rows"][2]["best_single"]
    in_matrix = best_single in (row["plan"] for row in rows[:2])
    assert [(row["row"], row["plan"]) for row in rows[3:]] == ([] if in_matrix else [(f"{matrix[2]} (reference)",
                                                                                       best_single)])  # fmt: skip
    # E meas is each row's measured ECD over the best one-process row's; a verdict holds when GO ⇔ E ≥ threshold.
    singles = [row for row in rows if row["plan"].startswith("1×")]
    best_ecd, threshold = max(float(row["meas ECD"]) for row in singles), float(summary[4])
    several = [row for row in rows if row not in singles]
    for row in rows:
        efficiency = float(row["meas ECD"]) / best_ecd
        assert float(row["E meas"]) == pytest.approx(efficiency, abs=0.01)  # both printed to 4 and 2 figures
        if row in singles:
            assert row["holds"] == "—"  # GO by rule: nothing to check
        elif abs(efficiency - threshold) > 0.01:  # closer, the printed figures cannot say which side it fell on
            assert row["pre-flight"] in ("GO", "NO-GO")
            assert row["holds"] == ("yes" if (row["pre-flight"] == "GO") == (efficiency >= threshold) else "no")
    assert (int(summary[2]), int(summary[3])) == (sum(row["holds"] == "yes" for row in several), len(several))
    errors = [abs(int(row["error"].rstrip("%"))) for row in rows]
    assert abs(statistics.median(errors) - int(summary[1])) <= 1  # the median of rounded percentages


@pytest.mark.slow
@pytest.mark.distributed
def test_channel_groups_benchmark_small(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/channel_groups.py", "--batch", "8", "--patch", "3", "--chags", "2"]
    result = _run(command, tmp_path, timeout_seconds=540)  # two fits, each with its pre-flight
    last = _last_line(result)
    assert re.fullmatch(r"chag=2 activation memory: \d+% of chag=1", last), last
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s+[124]\s+\d", line)]
    assert [row[0] for row in rows] == ["1", "2"]
    for _, predicted, measured, error, *_ in rows:  # the error column is what the step columns beside it say
        assert abs(int(error.rstrip("%")) - 100 * (float(predicted) - float(measured)) / float(measured)) <= 2
    assert all(row[6] == row[7] for row in rows)  # predicted and measured all-gathered bytes agree


@pytest.mark.slow
def test_time_to_accuracy_quick(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/time_to_accuracy.py", "--recipes", "quickstart", "--seeds", "0", "1",
               "--max-epochs", "2"]  # fmt: skip
    result = _run(command, tmp_path, timeout_seconds=400)
    *_, worst, last = result.stdout.strip().splitlines()
    assert result.returncode == 0, result.stderr[-3000:]
    methods = ("hslite quickstart", "RBF-SVM pixels", "RBF-SVM pixels + window mean")
    per_seed: dict[str, list[float]] = {method: [] for method in methods}
    for line in result.stdout.splitlines():
        if match := re.match(r"  seed (\d) synthetic_indian_pines stratified (.+?): OA (\d+\.\d\d) %", line):
            per_seed[match[2]].append(float(match[3]))
    assert all(len(oa) == 2 for oa in per_seed.values()), per_seed
    table = {
        method: line for line in result.stdout.splitlines() for method in methods
        if line.startswith("synthetic_indian_pines") and line.split("stratified")[1].split("  ")[1].strip() == method
    }  # fmt: skip
    assert "capped at 2 epochs" in table["hslite quickstart"]
    means = {}
    for method, line in table.items():
        seeds, mean, _, spread, low = line.split(method)[1].split()[:5]
        assert int(seeds) == 2
        assert float(mean) == pytest.approx(statistics.fmean(per_seed[method]), abs=0.011)
        assert float(spread) == pytest.approx(statistics.stdev(per_seed[method]), abs=0.011)
        assert float(low) == min(per_seed[method])
        means[method] = float(mean)
    margin = means["hslite quickstart"] - max(means[m] for m in methods[1:])
    assert worst == f"stand-ins: worst margin over the better SVM: {margin:+.2f} OA points (means over 2 seeds)"
    assert last == f"stand-ins: recipes at or above the better SVM: {int(margin >= 0)} of 1"


@pytest.mark.slow
@pytest.mark.realdata
def test_time_to_accuracy_tables_real_scenes_apart(shared_data: Path, tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/time_to_accuracy.py", "--recipes", "quickstart", "indian_pines_1gpu",
               "--data-root", str(shared_data), "--max-epochs", "1", "--stand-ins-too"]  # fmt: skip
    result = _run(command, tmp_path, timeout_seconds=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    stand_ins, real, against = (
        out.index(f"\n{title}:\n") for title in ("stand-ins", "real scenes", "stand-in against real scene")
    )
    assert "\nindian_pines " in out[real:against] and "\nindian_pines " not in out[stand_ins:real]
    assert "synthetic_indian_pines" in out[stand_ins:real] and "synthetic_indian_pines" not in out[real:against]
    assert re.search(r"\nreal scenes: recipes at or above the better SVM: [01] of 1\n", out)
    # indian_pines_1gpu ran on both; the quickstart has no real scene to set beside its stand-in
    rows = [line.split() for line in out[against:].splitlines()[3:-1]]  # past the blank line, title and header
    assert [(row[0], row[1]) for row in rows] == [("indian_pines_1gpu", "stratified")] * 3
    for *_, real_oa, stand_in_oa, diff in rows:
        assert float(diff) == pytest.approx(float(stand_in_oa) - float(real_oa), abs=0.011)
    within = sum(abs(float(row[-1])) <= 3 for row in rows)
    assert out.strip().endswith(f"stand-ins within ±3 OA points of their real scene: {within} of 3")


@pytest.mark.slow
def test_allocator_benchmark_quick(tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/allocator.py", "--seconds", "0.05"], tmp_path, timeout_seconds=200)
    last = _last_line(result)
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s+[79]\s+\d+\s", line)]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(p, b) for p in (7, 9) for b in (64, 256, 1024, 2048)]
    for _, _, default, kept, ratio in rows:  # samples/s rounded to whole numbers, the ratio to 0.01
        assert float(ratio) == pytest.approx(float(kept) / float(default), abs=0.006 + 2 / float(default))
    assert last == f"kept / default at batch 2048, 9x9: {rows[-1][4]}x"  # the last row is 9x9 at batch 2048


@pytest.mark.slow
def test_framework_tax_quick(tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/framework_tax.py", "--quick"], tmp_path, timeout_seconds=300)
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^(cnn3d|cnn1d)\s+\d", line)]
    assert [row[0] for row in rows] == ["cnn3d", "cnn1d"]
    for _, ours, theirs, ratio, floor, floor_ratio in rows:  # milliseconds to 0.01, the ratios to 0.01
        assert float(ratio.rstrip("×")) == pytest.approx(float(ours) / float(theirs), abs=0.006 + 0.01 / float(theirs))
        assert float(floor_ratio.rstrip("×")) == pytest.approx(
            float(floor) / float(theirs), abs=0.006 + 0.01 / float(theirs)
        )
    phases = re.findall(r"^  (\w[\w -]*?)\s+(\d+\.\d)\s+(\d+\.\d)$", result.stdout, re.M)
    assert [name for name, *_ in phases] == ["imports", "data", "pre-flight", "refit", "evaluation", "map and files",
                                             "training", "other"]  # fmt: skip
    assert re.search(r"^outside training: \d+\.\d s \(first run; \d+\.\d s with the pre-flight's cache\)$",
                     result.stdout, re.M)  # fmt: skip
    model, _, _, ratio, *_ = max(rows, key=lambda row: float(row[3].rstrip("×")))
    assert _last_line(result) == f"hslite step / hand-written loop: worst {ratio} ({model})"


def test_scene_scaling_rows_are_each_figures_worst_run(tmp_path: Path, monkeypatch) -> None:
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("scene_scaling", ROOT / "benchmarks" / "scene_scaling.py")
    assert spec is not None and spec.loader is not None
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    cube, labels = tmp_path / "cube.npy", tmp_path / "gt.npy"
    runs = iter([
        {"fit_seconds": 9.0, "train_seconds": 1.0, "fit_rss": 2.0e9, "predict_seconds": 5.0, "predict_rss": 1.1e9},
        {"fit_seconds": 8.0, "train_seconds": 1.5, "fit_rss": 2.9e9, "predict_seconds": 6.0, "predict_rss": 1.0e9},
        {"fit_seconds": 8.5, "train_seconds": 1.2, "fit_rss": 2.1e9, "predict_seconds": 4.0, "predict_rss": 0.9e9},
    ])  # fmt: skip

    def written(size_gb, folder, args):
        cube.write_bytes(b"\0" * 2048)
        labels.write_bytes(b"\0")
        return cube, labels, 7

    monkeypatch.setattr(scaling, "write_cube", written)
    monkeypatch.setattr(scaling, "measure", lambda *_: next(runs))
    row = scaling.measure_worst(0.01, tmp_path, argparse.Namespace(repeat=3))
    assert row == {"cube_bytes": 2048.0, "side": 7, "fit_seconds": 9.0, "train_seconds": 1.5, "fit_rss": 2.9e9,
                   "predict_seconds": 6.0, "predict_rss": 1.1e9}  # fmt: skip
    assert not cube.exists() and not labels.exists()  # the cube is written once, measured three times, then removed


@pytest.mark.slow
def test_published_models_count_their_published_flops() -> None:
    """The what-if counter on the benchmark's models gives their published sizes and multiply-adds per 224² image."""
    import importlib.util

    import torch

    from hslite.preflight_check.measure.step_counts import count_step
    from hslite.preflight_check.measure.training_step import CLASSIFIER_STEP

    spec = importlib.util.spec_from_file_location("published_models", ROOT / "benchmarks" / "published_models.py")
    assert spec is not None and spec.loader is not None
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)

    def batch(b: int):
        return torch.zeros(b, 3, 224, 224), torch.zeros(b, dtype=torch.long)

    # ResNet-50 4.1 GMACs (He et al. 2016 give 3.8 x 10^9 FLOPs counting multiply-adds, without the v1.5 stride);
    # ViT-B/16 17.6 GMACs (timm's table); 25.56 M and 86.57 M parameters (timm's param_count)
    for name, gmacs, params in (("resnet50", 4.09, 25.557032), ("vit_base_patch16_224", 17.56, 86.567656)):
        counts = count_step(models.MODELS[name], batch, precision="32-true", step=CLASSIFIER_STEP)
        assert counts.forward_flops_per_sample / 2e9 == pytest.approx(gmacs, abs=0.01)
        # backward: twice the forward, less the first layer's input gradient, which nothing needs
        assert counts.backward_flops_per_sample == pytest.approx(2 * counts.forward_flops_per_sample, rel=0.02)
        assert sum(p.numel() for p in models.MODELS[name]().parameters()) / 1e6 == pytest.approx(params, abs=1e-6)


@pytest.mark.slow
def test_whatif_vs_published_prices_each_row(tmp_path: Path) -> None:
    from hslite.preflight_check.hardware.device_profile import CONV_EFFICIENCY, MEMORY_EFFICIENCY

    table = tmp_path / "rows.csv"
    table.write_text(
        "model,train_samples_per_sec,train_step_time_ms,train_batch_size,train_img_size,param_count_m\n"
        "resnet18,2764.22,184.877,512,224,11.69\nresnet50,826.06,618.983,512,224,25.56\n"
        "densenet121,730.11,348.758,256,224,7.98\nefficientnet_b0,1000.0,500.0,256,224,5.29\n"
    )
    result = _run([sys.executable, "benchmarks/whatif_vs_published.py", "--table", str(table)], tmp_path, 300)
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^(resnet|densenet)\w+\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["resnet18", "resnet50", "densenet121"]
    errors = []
    for _, _, _, published, predicted, error, _ in rows:
        # images/s are printed rounded to whole numbers, the error to a point
        assert int(error.rstrip("%")) == pytest.approx(100 * (float(predicted) / float(published) - 1), abs=1)
        errors.append(abs(int(error.rstrip("%"))))
    assert "efficientnet_b0          not written here: skipped" in result.stdout
    # The profile's efficiencies are the ones this table's two fitting rows give, to the printed digits
    fitted = re.search(r"^fitted on resnet50 and densenet121 of this table: e_conv (\S+), e_memory (\S+) \(",
                       result.stdout, re.M)  # fmt: skip
    assert fitted and (float(fitted[1]), float(fitted[2])) == (CONV_EFFICIENCY, MEMORY_EFFICIENCY)
    assert re.search(rf"^rows not fitted \(1\): median {errors[0]}%, worst {errors[0]}%$", result.stdout, re.M)
    median, worst = re.fullmatch(r"what-if vs published: median (\d+)%, worst (\d+)%", _last_line(result)).groups()
    assert abs(int(median) - statistics.median(errors)) <= 1 and abs(int(worst) - max(errors)) <= 1  # rounded apart
