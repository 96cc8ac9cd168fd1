"""A run folder a person can trust: the README's `hslite fit` from an empty folder, evidence kept on failure and
interruption, checkpoints that always load, and a best checkpoint that does not stop at the first saturated epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hslite.cli import main
from hslite.run.checkpoints import BestCheckpoint, atomic_torch_save, load_weights

QUICK = [
    "data.scene=synthetic_tiny",
    "train.progress=false",
    "output.save_map=false",
    "preflight.probe_steps=2",
    "train.refit=false",
]  # best.ckpt is the best validation epoch's, not a refit's (tests/test_refit.py)


def _hslite() -> list[str]:
    """The console script the README runs, from the environment running the tests."""
    script = Path(sys.executable).with_name("hslite")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "hslite"]


def _loads(checkpoint: Path) -> bool:
    return bool(load_weights(checkpoint))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_main_job_runs_from_an_empty_folder_with_no_arguments(tmp_path):
    result = subprocess.run(_hslite() + ["fit"], cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (run,) = (tmp_path / "runs" / "quickstart").iterdir()  # the default, relative output.root
    assert not run.name.endswith((".incomplete", ".failed"))
    for name in ("config.yaml", "split.npz", "metrics.json", "preflight.json", "confusion.png", "map.png"):
        assert (run / name).is_file(), name
    assert _loads(run / "checkpoints" / "best.ckpt")


def test_a_failure_after_training_keeps_the_evidence(tmp_path, monkeypatch, capsys):
    from hslite.run import outputs

    def broken_plot(*args, **kwargs):
        raise RuntimeError("the plotting backend fell over")

    monkeypatch.setattr(outputs, "plot_confusion", broken_plot)
    with pytest.raises(RuntimeError, match="plotting backend"):
        main(["fit", "recipe=quickstart", *QUICK, "train.max_epochs=2", f"output.root={tmp_path}"])
    (run,) = (tmp_path / "quickstart").iterdir()
    assert run.name.endswith(".failed")
    error = (run / "error.txt").read_text()
    assert error.startswith("RuntimeError: the plotting backend fell over") and "Traceback" in error  # a bug report
    assert (run / "config.yaml").is_file() and (run / "logs" / "metrics.csv").is_file()
    assert _loads(run / "checkpoints" / "best.ckpt") and _loads(run / "checkpoints" / "last.ckpt")
    assert not (run / "metrics.json").exists()  # nothing that did not finish looks finished
    assert str(run) in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("signum", "suffix", "exit_code"), [
    (signal.SIGINT, ".failed", 130), (signal.SIGTERM, ".failed", 143), (signal.SIGKILL, ".incomplete", -9),
])  # fmt: skip
def test_an_interrupted_fit_keeps_a_checkpoint_that_loads(tmp_path, signum, suffix, exit_code):
    command = _hslite() + ["fit", "recipe=quickstart", *QUICK, "train.max_epochs=100000", f"output.root={tmp_path}"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while not list(tmp_path.glob("quickstart/*/checkpoints/best.ckpt")) and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    time.sleep(0.5)  # a few more epochs: the signal may land anywhere in the loop, a checkpoint write included
    os.kill(process.pid, signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == exit_code, err[-3000:]
    (run,) = (tmp_path / "quickstart").iterdir()
    assert run.name.endswith(suffix)
    assert _loads(run / "checkpoints" / "best.ckpt")
    if signum != signal.SIGKILL:
        assert (run / "error.txt").read_text().startswith(f"interrupted by {signum.name}")
        assert _loads(run / "checkpoints" / "last.ckpt") and "Traceback" not in err


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    path = tmp_path / "best.ckpt"
    atomic_torch_save({"state_dict": {"w": torch.ones(3)}}, path)

    def dies_half_way(payload, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"state_dict": {"w": torch.zeros(3)}}, path)
    assert torch.equal(load_weights(path)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["best.ckpt"]  # no temporary file left behind


class _Strategy:
    @staticmethod
    def reduce_boolean_decision(decision: bool, all: bool = True) -> bool:
        return decision


class _Trainer:
    strategy = _Strategy()


def test_a_tie_on_validation_accuracy_goes_to_the_later_epoch(tmp_path):
    checkpoint = BestCheckpoint(tmp_path)
    checkpoint.best_k_models = {"best.ckpt": torch.tensor(0.98)}
    checkpoint.kth_best_model_path = "best.ckpt"
    trainer = _Trainer()
    assert checkpoint.check_monitor_top_k(trainer, torch.tensor(0.98))  # equal: the later epoch replaces it
    assert checkpoint.check_monitor_top_k(trainer, torch.tensor(0.99))
    assert not checkpoint.check_monitor_top_k(trainer, torch.tensor(0.97))


def test_the_best_checkpoint_is_the_last_epoch_of_those_with_the_best_accuracy(tmp_path):
    import csv

    # synthetic_tiny is easy: validation OA saturates within a few epochs, and later epochs tie with it.
    assert main(["fit", "recipe=quickstart", *QUICK, "train.max_epochs=8", f"output.root={tmp_path}"]) == 0
    (run,) = (tmp_path / "quickstart").iterdir()
    rows = [row for row in csv.DictReader((run / "logs" / "metrics.csv").open()) if row.get("val/OA")]
    accuracy = {int(row["epoch"]): float(row["val/OA"]) for row in rows}
    best = max(accuracy.values())
    expected_epoch = max(epoch for epoch, value in accuracy.items() if value == best)
    saved = torch.load(run / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=True)
    assert saved["epoch"] == expected_epoch


def test_a_run_folder_is_renamed_when_done_and_keeps_a_users_error_without_a_traceback(tmp_path):
    from hslite.errors import DataError
    from hslite.run.folder import RunFolder

    with RunFolder(tmp_path) as done:
        assert done.path.name.endswith(".incomplete") and done.path.is_dir()
    assert done.path.is_dir() and "." not in done.path.name
    with pytest.raises(DataError), RunFolder(tmp_path) as failed:
        raise DataError("the cube has NaNs in band 7")
    assert failed.path.name.endswith(".failed") and failed.path != done.path
    assert (failed.path / "error.txt").read_text() == "DataError: the cube has NaNs in band 7\n\n"


def test_a_signal_is_an_interruption_even_when_it_surfaces_as_another_error(tmp_path):
    from hslite.run.folder import RunFolder, RunInterrupted

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as caught, RunFolder(tmp_path) as run:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        except KeyboardInterrupt:  # what torch.save's C++ writer turns a KeyboardInterrupt raised inside it into
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None
    assert caught.value.exit_code == 143
    assert (run.path / "error.txt").read_text().startswith("interrupted by SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is gone with the run folder


def test_a_limited_test_pass_still_maps_the_whole_scene(tmp_path):
    args = ["fit", "recipe=quickstart", *QUICK, "output.save_map=true", "data.eval_batch_size=64"]
    assert main([*args, "train.max_epochs=1", "train.limit_test_batches=2", f"output.root={tmp_path}"]) == 0
    (run,) = (tmp_path / "quickstart").iterdir()
    metrics = json.loads((run / "metrics.json").read_text())
    assert (run / "map.png").is_file() and (run / "prediction.tif").is_file()
    assert sum(map(sum, metrics["confusion_matrix"])) == 128  # two test batches scored, the whole scene mapped


@pytest.mark.parametrize(("save_map", "limit", "passes"), [
    (True, "1.0", [("scene", {})]),  # one pass: the test pixels are scored from the map
    (True, "2", [("test", {"limit_predict_batches": 2}), ("scene", {})]),  # the map stays whole
    (False, "1.0", [("test", {"limit_predict_batches": None})]),
    (False, "0.5", [("test", {"limit_predict_batches": 0.5})]),
])  # fmt: skip
def test_one_inference_pass_serves_the_test_and_the_map_only_when_both_cover_the_whole_scene(
    monkeypatch, save_map, limit, passes
):
    from types import SimpleNamespace

    import numpy as np

    from hslite.recipe.config import load_config
    from hslite.run import evaluate

    ran = []

    def predict(plan, task, loader, samples, **limits):
        ran.append((loader, limits))
        assert samples == (4 if loader == "scene" else 2)  # the scene's pixels, the test pixels
        return np.array([0, 1, 2, 3]) if loader == "scene" else np.array([1, 2])

    monkeypatch.setattr(evaluate, "_predict", predict)
    datamodule = SimpleNamespace(
        scene=SimpleNamespace(gt=np.array([[1, 2], [3, 0]])),
        split=SimpleNamespace(test=np.array([[0, 1], [1, 0]])),  # the map's 2nd and 3rd pixels: classes 1 and 2
        test_dataloader=lambda: "test",
        predict_dataloader=lambda: "scene",
    )
    cfg = load_config("quickstart", [f"output.save_map={save_map}", f"train.limit_test_batches={limit}"])
    scored, predicted = evaluate.predictions(cfg, None, datamodule, None)
    assert ran == passes
    assert scored.tolist() == [1, 2]
    assert (predicted.tolist() if save_map else predicted) == ([0, 1, 2, 3] if save_map else None)


def test_a_fit_derives_its_plan_from_the_config_once(tmp_path, monkeypatch):
    import sys

    from hslite.recipe import build

    derived = []
    original = build.plan_from_config

    def counted(cfg):
        derived.append(cfg.recipe)
        return original(cfg)

    # build and every module that imported it by name; a module imported later binds build's, patched.
    for module in [m for m in list(sys.modules.values()) if getattr(m, "plan_from_config", None) is original]:
        monkeypatch.setattr(module, "plan_from_config", counted)
    assert main(["fit", "recipe=quickstart", *QUICK, "train.max_epochs=1", f"output.root={tmp_path}"]) == 0
    assert derived == ["quickstart"]
