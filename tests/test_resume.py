"""Resume, determinism, output errors and concurrent runs: a stopped run continues to the metrics of one that never
stopped, a checkpoint or override of another config is refused with the fields that differ, and two runs never
collide."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hslite.cli import main
from hslite.errors import DataError
from hslite.recipe.config import load_config
from hslite.run.checkpoints import load_weights
from hslite.run.resume import check_checkpoint_config, flat_config
from hslite.run.training_state import TrainingState

# Small batches, flips and a 3x3 patch: every epoch draws a shuffle and flips that a resume must reproduce.
QUICK = ["recipe=quickstart", "data.scene=synthetic_tiny", "train.progress=false", "output.save_map=false",
         "preflight.enabled=false", "train.deterministic=true", "train.max_epochs=6", "data.batch_size=8",
         "data.augment=true", "data.patch_size=3"]  # fmt: skip
SCORES = ("OA", "AA", "kappa", "per_class_accuracy", "confusion_matrix", "epochs", "optimizer_steps", "train_samples")


def _runs(root: Path) -> list[Path]:
    return sorted((root / "quickstart").iterdir())


def _scores(run: Path) -> dict:
    """The run's test scores and its final weights, as bytes: equal means bitwise equal."""
    metrics = json.loads((run / "metrics.json").read_text())
    weights = load_weights(run / "checkpoints" / "last.ckpt")
    return {**{key: metrics[key] for key in SCORES}, **{k: v.numpy().tobytes() for k, v in weights.items()}}


def _crash_at_epoch(monkeypatch: pytest.MonkeyPatch, epoch: int) -> None:
    def crash(self, trainer, pl_module):
        if trainer.current_epoch + 1 == epoch:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(TrainingState, "on_train_epoch_start", crash, raising=False)


def _reads_of(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Every opening of a file called `name` for reading from here on: builtins' open (torch.load), io's (pathlib)."""
    reads: list[str] = []
    real_open = io.open

    def counting(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name == name and "r" in mode:
            reads.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return reads


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert main(["fit", *QUICK, f"output.root={root}"]) == 0
    (run,) = _runs(root)
    return _scores(run)


@pytest.mark.slow
def test_the_same_seed_gives_bitwise_identical_metrics(tmp_path, uninterrupted):
    assert main(["fit", *QUICK, f"output.root={tmp_path}"]) == 0
    (run,) = _runs(tmp_path)
    assert _scores(run) == uninterrupted


def test_a_resumed_run_ends_with_the_metrics_of_an_uninterrupted_one(tmp_path, monkeypatch, uninterrupted, capsys):
    _crash_at_epoch(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(["fit", *QUICK, f"output.root={tmp_path}"])
    monkeypatch.undo()
    (failed,) = _runs(tmp_path)
    assert failed.name.endswith(".failed")
    reads = _reads_of(monkeypatch, "last.ckpt")
    assert main(["fit", "resume=last", *QUICK, f"output.root={tmp_path}"]) == 0
    monkeypatch.undo()
    assert len(reads) == 1, f"last.ckpt was read {len(reads)} times to resume: {reads}"  # checked, then restored
    (run,) = _runs(tmp_path)  # the same folder, finished
    assert run.name == failed.name.removesuffix(".failed")
    assert _scores(run) == uninterrupted
    (resumed,) = json.loads((run / "metrics.json").read_text())["resumed"]
    assert resumed["after"] == "RuntimeError: simulated crash"
    assert not (run / "error.txt").exists() and json.loads((run / "resumed.json").read_text()) == [resumed]


@pytest.mark.slow
def test_resume_refuses_overrides_that_change_the_run(tmp_path, monkeypatch, capsys):
    _crash_at_epoch(monkeypatch, 3)
    with pytest.raises(RuntimeError):
        main(["fit", *QUICK, f"output.root={tmp_path}"])
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["fit", "resume=last", *QUICK, "train.lr=0.1", f"output.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "train.lr: 0.003 -> 0.1" in err and "Traceback" not in err
    (run,) = _runs(tmp_path)
    assert run.name.endswith(".failed")  # untouched
    # A harmless override (the progress bar) is accepted, and the run folder can be named directly.
    assert main(["fit", f"resume={run}", "train.progress=false"]) == 0


@pytest.mark.slow
def test_a_checkpoint_of_another_config_is_refused_with_the_fields_that_differ(tmp_path, monkeypatch, capsys):
    _crash_at_epoch(monkeypatch, 3)
    for lr in ("0.003", "0.01"):
        with pytest.raises(RuntimeError):
            main(["fit", *QUICK, f"train.lr={lr}", f"output.root={tmp_path}"])
    monkeypatch.undo()
    first, second = _runs(tmp_path)
    (second / "checkpoints" / "last.ckpt").write_bytes((first / "checkpoints" / "last.ckpt").read_bytes())
    capsys.readouterr()
    assert main(["fit", f"resume={second}"]) != 0
    err = capsys.readouterr().err
    assert "written for another config" in err and "train.lr" in err and "Traceback" not in err


def test_a_setting_added_since_the_checkpoint_compares_as_its_default(tmp_path):
    cfg = load_config("quickstart")
    older = {k: v for k, v in flat_config(cfg).items() if k != "model.window_mean"}  # written before the setting
    check_checkpoint_config({"hslite": {"config": older}}, cfg, tmp_path / "last.ckpt")
    cfg.model.window_mean = True  # a run that sets it differs from one written before it existed
    with pytest.raises(DataError, match="model.window_mean: False -> True"):
        check_checkpoint_config({"hslite": {"config": older}}, cfg, tmp_path / "last.ckpt")


def test_resume_of_a_corrupt_checkpoint_is_a_sentence(tmp_path, monkeypatch, capsys):
    _crash_at_epoch(monkeypatch, 3)
    with pytest.raises(RuntimeError):
        main(["fit", *QUICK, f"output.root={tmp_path}"])
    monkeypatch.undo()
    (run,) = _runs(tmp_path)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 not a checkpoint")
    capsys.readouterr()
    assert main(["fit", f"resume={run}"]) != 0
    err = capsys.readouterr().err
    assert "cannot be read" in err and "truncated, corrupt" in err and "Traceback" not in err


def test_resume_last_with_nothing_to_resume_says_so(tmp_path, capsys):
    assert main(["fit", "resume=last", *QUICK, f"output.root={tmp_path}"]) != 0
    assert "no stopped run of recipe 'quickstart'" in capsys.readouterr().err


def test_a_run_folder_in_use_cannot_be_resumed(tmp_path):
    from hslite.errors import HSLiteError
    from hslite.run.folder import RunFolder

    with RunFolder(tmp_path / "r") as live, pytest.raises(HSLiteError, match="in use by another hslite process"):
        RunFolder(tmp_path, resume=live.path).__enter__()


def test_a_full_disk_before_training_is_one_sentence_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    assert main(["fit", *QUICK, f"output.root={tmp_path}/runs"]) != 0
    err = capsys.readouterr().err
    assert "MiB free" in err and "output.root" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "quickstart").exists() or not _runs(tmp_path / "runs")


def test_a_disk_that_fills_during_the_run_is_one_sentence(tmp_path, monkeypatch, capsys):
    from hslite.run import checkpoints

    def full(payload, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoints, "atomic_torch_save", full)
    assert main(["fit", *QUICK, f"output.root={tmp_path}"]) != 0
    err = capsys.readouterr().err
    assert "the disk is full" in err and "Traceback" not in err
    (run,) = _runs(tmp_path)
    assert run.name.endswith(".failed")


@pytest.mark.slow
def test_two_runs_started_together_in_one_output_root_never_collide(tmp_path):
    command = [sys.executable, "-m", "hslite", "fit", *QUICK, "preflight.enabled=true", "output.root=runs"]
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # one fresh probe cache, shared
    runs = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]  # fmt: skip
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    first, second = _runs(tmp_path / "runs")
    assert first.name != second.name and not first.name.endswith((".failed", ".incomplete"))
    assert _scores(first) == _scores(second)  # the same seed, read from one cache each wrote
