"""Bad input, refused cleanly: every wrong command line, recipe, data file, checkpoint and plan ends the same way.

Each row of the matrix runs one command that cannot succeed and proves four things about how it stops: a non-zero
exit code (the one hslite documents where it documents one: 2 for usage, 1 for data), a message on stderr that names
what was wrong, no traceback, and nothing half-written: no run folder for `fit`, no output folder for `predict`, the
run handed to `predict` or `resume=` byte for byte as it was, and no code run from a file (a recipe or checkpoint
that tries to run a command would leave a `pwned` file). A few rows run again through the real console script,
because the in-process `main` cannot show what the interpreter prints on the way out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fixtures_data as fx
import numpy as np
import pytest
from quick_fit import NO_PREFLIGHT, QUICK_FIT

from hslite.cli import main

# One fast fit of the default recipe (quickstart): the synthetic 24×24×32 scene, the 1-D CNN on single pixels, one
# epoch, no pre-flight probes. No recipe= here: the first recipe= on a command line wins, and cases name their own.
QUICK = [*QUICK_FIT, NO_PREFLIGHT]
GARBAGE = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
CUBE = fx.tiny_cube(12, 10, 6)
LABELS = fx.tiny_labels(12, 10, num_classes=3)
OWN = ["data.scene=cube.npy", "data.labels=gt.npy"]
GOOD_OWN = {"cube.npy": CUBE, "gt.npy": LABELS}
MARKER = "pwned"  # what a file that manages to run a command creates in the case's folder
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
AS_ROOT = pytest.mark.skipif(ROOT, reason="root ignores directory permissions")


# ------------------------------------------------------------------------------------------------ file makers
def _save_split(shape: tuple[int, int]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        from hslite.datasets.splits import make_split

        gt = fx.tiny_labels(*shape, num_classes=4)
        make_split(gt, "stratified", train_fraction=0.3, val_fraction=0.2, seed=0).save(path)

    return write


def _truncated_split(path: Path) -> None:
    from hslite.datasets.scenes.registry import load_scene
    from hslite.datasets.splits import make_split

    make_split(load_scene("synthetic_tiny", seed=0).gt, "stratified").save(path)
    fx.truncate(path)


def _truncated(array: np.ndarray) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        np.save(path, array)
        fx.truncate(path)

    return write


def _with(array: np.ndarray, index: tuple[int, ...], value: float) -> np.ndarray:
    changed = array.astype(np.float32)
    changed[index] = value
    return changed


def _locked_folder(path: Path) -> None:
    path.mkdir()
    path.chmod(0o500)


def _torch_file(payload: Callable[[], Any]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        import torch

        torch.save(payload(), path)

    return write


def _foreign_weights() -> dict:
    import torch

    return {"state_dict": {"model.weight": torch.zeros(3)}}


class _RunsACommand:
    """A pickle that calls os.system when unpickled: what a hostile checkpoint would hold."""

    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def _write(folder: Path, files: dict[str, Any]) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, np.ndarray):
            np.save(path, content)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            content(path)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------------------------------------- the runner
@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """The case's own folder as the working directory, with the user cache redirected into it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    yield tmp_path
    for folder in (tmp_path, *tmp_path.rglob("*")):
        if folder.is_dir() and not folder.is_symlink():
            folder.chmod(0o700)  # a locked folder would stop pytest from cleaning up


def _run(argv: list[str], capsys) -> tuple[int | None, str, str]:
    """Exit code, stdout + stderr, and stderr of `hslite ARGV` in this process; an escaped exception is a traceback."""
    escaped = ""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors leave this way, as they do from the console script
        code = stop.code
    except Exception:  # whatever escapes main would reach the user as a traceback
        code, escaped = None, traceback.format_exc()
    captured = capsys.readouterr()
    return code, captured.out + captured.err + escaped, captured.err


def _assert_refused(
    argv: list[str], result: tuple, code: int | None, words: tuple[str, ...], untouched: list[Path], folder: Path
) -> None:
    got, everything, err = result
    command = "hslite " + " ".join(argv)
    assert "Traceback" not in everything, f"{command} printed a traceback:\n{everything[-3000:]}"
    assert got not in (0, None), f"{command} exited {got}:\n{everything[-2000:]}"
    if code is not None:
        assert got == code, f"{command} exited {got}, expected {code}:\n{err[-2000:]}"
    assert "hslite: error:" in err, f"{command} gave no error line:\n{everything[-2000:]}"
    missing = [word for word in words if word not in err]
    assert not missing, f"{command}: the message does not name {missing}:\n{err[-2000:]}"
    for path in untouched:
        left = sorted(str(p.relative_to(folder)) for p in path.rglob("*")) if path.is_dir() else []
        assert not left, f"{command} left {left} behind"
    assert not (folder / MARKER).exists(), f"{command} ran a command from its input"


# ------------------------------------------------------------------- fit: keys, values, recipes, plans, data, output
# (overrides after QUICK; files to write in the case's folder; exit code, None where any non-zero one will do; words
# the message must hold)
FIT_CASES = [
    # command line
    pytest.param(["recipe=quickstrat"], {}, 2, ("unknown recipe 'quickstrat'", "quickstart"), id="unknown-recipe"),
    pytest.param(["train.max_epoch=5"], {}, 2, ("'train.max_epoch'", "train.max_epochs"), id="unknown-key"),
    pytest.param(["optim.lr=0.1"], {}, 2, ("'optim.lr'",), id="unknown-section"),
    pytest.param(["train.max_epochs=abc"], {}, 2, ("train.max_epochs", "abc"), id="int-given-text"),
    pytest.param(["data.augment=maybe"], {}, 2, ("data.augment", "maybe"), id="bool-given-text"),
    pytest.param(["data.patch_size=0"], {}, 2, ("data.patch_size=0 is out of range",), id="patch-size-zero"),
    pytest.param(["data.patch_size=-3"], {}, 2, ("data.patch_size=-3 is out of range",), id="patch-size-negative"),
    pytest.param(["data.patch_size=4"], {}, 2, ("data.patch_size=4 is out of range",), id="patch-size-even"),
    pytest.param(["train.lr=0"], {}, 2, ("train.lr=0", "out of range"), id="lr-zero"),
    pytest.param(
        ["data.train_fraction=0.6", "data.val_fraction=0.5"], {}, 2, ("leaves no test pixels",), id="fractions-sum-1"
    ),
    pytest.param(["parallel.plan=fastest"], {}, 2, ("parallel.plan", "'fastest'"), id="unknown-plan-mode"),
    pytest.param(["model.name=os.system"], {}, 2, ("Unknown model 'os.system'", "cnn1d"), id="model-python-path"),
    pytest.param(["model.size=huge"], {}, 2, ("Unknown size 'huge'",), id="unknown-model-size"),
    pytest.param(["data.split=random"], {}, None, ("'random'", "stratified"), id="unknown-split-kind"),
    pytest.param(["data.normalisation=minmax"], {}, None, ("'minmax'", "zscore"), id="unknown-normalisation"),
    # recipe files of one's own
    pytest.param(["recipe=absent.yaml"], {}, 2, ("absent.yaml", "does not exist"), id="recipe-file-absent"),
    pytest.param(
        ["recipe=evil.yaml"],
        {"evil.yaml": f'data:\n  scene: !!python/object/apply:os.system ["touch {MARKER}"]\n'},
        2,
        ("evil.yaml", "not valid YAML"),
        id="recipe-python-tag",
    ),
    pytest.param(
        ["recipe=linear.yaml"],
        {"linear.yaml": "model:\n  name: torch.nn.Linear\n"},
        2,
        ("Unknown model 'torch.nn.Linear'",),
        id="recipe-model-python-path",
    ),
    pytest.param(
        ["recipe=list.yaml"], {"list.yaml": "- data\n- model\n"}, 2, ("list.yaml", "mapping"), id="recipe-is-a-list"
    ),
    pytest.param(
        ["recipe=broken.yaml"],
        {"broken.yaml": "data:\n  scene: [synthetic_tiny\nmodel: {name: cnn1d\n"},
        2,
        ("broken.yaml", "not valid YAML"),
        id="recipe-bad-syntax",
    ),
    pytest.param(
        ["recipe=typo.yaml"],
        {"typo.yaml": "train:\n  max_epoch: 5\n"},
        2,
        ("typo.yaml", "train.max_epoch", "train.max_epochs"),
        id="recipe-unknown-key",
    ),
    pytest.param(
        ["recipe=flat.yaml"], {"flat.yaml": "data: 5\n"}, 2, ("flat.yaml", "'data'"), id="recipe-section-not-a-mapping"
    ),
    # plans
    pytest.param(
        ["parallel.accelerator=gpu", "parallel.devices=2"],
        {},
        2,
        ("parallel.devices=2", "GPUs"),
        id="more-gpus-than-the-box",
    ),
    pytest.param(["parallel.num_nodes=2"], {}, 2, ("2 nodes", "one box"), id="several-nodes"),
    pytest.param(
        ["parallel.devices=2", "parallel.chag=3"], {}, 2, ("not divisible by chag(3)",), id="chag-not-dividing-devices"
    ),
    pytest.param(
        ["model.name=channel_vit", "model.band_groups=3", "parallel.devices=2", "parallel.chag=2"],
        {},
        2,
        ("parallel.chag=2 must divide the model's 3 band groups",),
        id="chag-not-dividing-band-groups",
    ),
    pytest.param(
        ["parallel.devices=2", "parallel.chag=2"], {}, 2, ("parallel.chag=2", "channel_vit"), id="chag-without-groups"
    ),
    pytest.param(
        ["parallel.rotation_groups=4"],
        {},
        2,
        ("parallel.rotation_groups=4 must be between 1 and 3",),
        id="rotation-as-many-as-groups",
    ),
    pytest.param(
        ["parallel.devices=2", "parallel.chag=2", "parallel.fsdp=true", "model.name=channel_vit"],
        {},
        2,
        ("fsdp cannot be combined with chag",),
        id="fsdp-with-chag",
    ),
    pytest.param(
        ["parallel.devices=2", "parallel.compression=int8", "parallel.fsdp=true"],
        {},
        2,
        ("compression and fsdp cannot be combined",),
        id="fsdp-with-compression",
    ),
    pytest.param(
        ["data.gather_on_device=true", "parallel.accelerator=cpu"],
        {},
        2,
        ("data.gather_on_device=true keeps the cube in GPU memory", "parallel.accelerator=gpu"),
        id="gather-on-device-on-cpu",
    ),
    pytest.param(
        ["parallel.devices=2", "parallel.fsdp=true", "parallel.precision=16-mixed"],
        {},
        2,
        ("fsdp cannot train in precision 16-mixed", "bf16-mixed"),
        id="fsdp-with-fp16",
    ),
    pytest.param(["parallel.compression=zstd"], {}, 2, ("compression must be one of", "'zstd'"), id="compression"),
    pytest.param(["parallel.precision=fp8"], {}, 2, ("precision must be one of", "'fp8'"), id="unknown-precision"),
    pytest.param(["parallel.accelerator=tpu"], {}, 2, ("accelerator", "'tpu'"), id="unknown-accelerator"),
    # data files
    pytest.param(["data.scene=nowhere"], {}, 1, ("Unknown scene 'nowhere'",), id="unknown-scene-name"),
    pytest.param(
        ["data.scene=absent/cube.npy", "data.labels=gt.npy"],
        {"gt.npy": LABELS},
        1,
        ("absent/cube.npy (data.scene) does not exist",),
        id="cube-absent",
    ),
    pytest.param(OWN, {**GOOD_OWN, "cube.npy": GARBAGE}, 1, ("cube.npy", "could not be read"), id="cube-npy-garbage"),
    pytest.param(
        OWN,
        {**GOOD_OWN, "cube.npy": _truncated(CUBE)},
        1,
        ("cube.npy", "truncated"),
        id="cube-npy-truncated",
    ),
    pytest.param(
        ["data.scene=cube.mat", "data.labels=gt.npy"],
        {"cube.mat": GARBAGE, "gt.npy": LABELS},
        1,
        ("cube.mat", "could not be read as a MATLAB file"),
        id="cube-mat-garbage",
    ),
    pytest.param(OWN, {**GOOD_OWN, "cube.npy": CUBE[None]}, 1, ("cube.npy", "(rows, cols, bands)"), id="cube-4d"),
    pytest.param(
        OWN, {**GOOD_OWN, "gt.npy": LABELS[:11]}, 1, ("(11, 10) label map", "(12, 10)"), id="cube-labels-shape-mismatch"
    ),
    pytest.param(
        OWN,
        {**GOOD_OWN, "cube.npy": _with(CUBE, (2, 3, 1), np.inf)},
        1,
        ("NaN/Inf", "(2, 3, 1)"),
        id="cube-with-inf",
    ),
    pytest.param(
        OWN, {**GOOD_OWN, "cube.npy": _with(CUBE, (5, 0, 4), np.nan)}, 1, ("NaN/Inf", "(5, 0, 4)"), id="cube-with-nan"
    ),
    pytest.param(
        ["data.scene=cube.npy", "data.labels=absent.npy"],
        {"cube.npy": CUBE},
        1,
        ("absent.npy (data.labels) does not exist",),
        id="labels-absent",
    ),
    pytest.param(
        ["data.scene=cube.npy", "data.labels=gt.tif"],
        {"cube.npy": CUBE, "gt.tif": GARBAGE},
        1,
        ("gt.tif", "could not be read as a raster"),
        id="labels-tif-garbage",
    ),
    pytest.param(
        OWN, {**GOOD_OWN, "gt.npy": (LABELS > 0).astype(np.uint8)}, 1, ("gt.npy", "at least 2"), id="labels-one-class"
    ),
    pytest.param(
        ["data.split_file=other.npz"],
        {"other.npz": _save_split((40, 40))},
        1,
        ("other.npz", "outside the (24, 24) scene", "another scene"),
        id="split-from-another-scene",
    ),
    pytest.param(
        ["data.split_file=cut.npz"], {"cut.npz": _truncated_split}, 1, ("cut.npz", "not a split file"), id="split-cut"
    ),
    pytest.param(
        ["data.split_file=junk.npz"], {"junk.npz": GARBAGE}, 1, ("junk.npz", "not a split file"), id="split-garbage"
    ),
    pytest.param(["data.split_file=absent.npz"], {}, 1, ("absent.npz", "does not exist"), id="split-absent"),
    # where the run folder would go
    pytest.param(["output.root=taken.txt"], {"taken.txt": "a file\n"}, 1, ("taken.txt",), id="output-root-is-a-file"),
    pytest.param(
        ["output.root=locked/runs"],
        {"locked": _locked_folder},
        1,
        ("locked/runs",),
        id="output-root-unwritable",
        marks=AS_ROOT,
    ),
]


@pytest.mark.parametrize(("overrides", "files", "code", "words"), FIT_CASES)
def test_fit_refuses_before_any_run_folder(overrides, files, code, words, sandbox, capsys):
    if "parallel.accelerator=gpu" in overrides and _gpus() >= 2:
        pytest.skip("this box has the GPUs the case asks for")
    _write(sandbox, files)
    argv = ["fit", *QUICK, "output.root=runs", *overrides]
    _assert_refused(argv, _run(argv, capsys), code, words, [sandbox / "runs"], sandbox)


# --------------------------------------------------------------------------------------- the other commands
OTHER_CASES = [
    pytest.param(["fit", "stray"], {}, 2, ("expected key=value", "'stray'"), id="fit-word-without-equals"),
    pytest.param(["fit", "=5"], {}, 2, ("expected key=value", "'=5'"), id="fit-value-without-key"),
    pytest.param(["fit", "--epochs", "3"], {}, 2, ("--epochs",), id="fit-unknown-flag"),
    pytest.param(["models", "cnn1d"], {}, 2, ("cnn1d",), id="models-takes-no-arguments"),
    pytest.param(["preflight", "train.max_epoch=5"], {}, 2, ("'train.max_epoch'",), id="preflight-unknown-key"),
    pytest.param(
        ["preflight", "parallel.devices=2", "parallel.fsdp=true", "parallel.compression=bf16"],
        {},
        2,
        ("compression and fsdp cannot be combined",),
        id="preflight-bad-plan",
    ),
    pytest.param(["compare"], {}, 2, ("needs recipes=",), id="compare-without-recipes"),
    pytest.param(["compare", "recipes=nomatch_*"], {}, 2, ("no recipe matches 'nomatch_*'",), id="compare-no-match"),
    pytest.param(["compare", "recipes=quickstart", "steps=0"], {}, 2, ("steps", "'0'"), id="compare-zero-steps"),
    pytest.param(
        ["data", "info", "absent/cube.tif"], {}, 1, ("absent/cube.tif", "does not exist"), id="data-info-absent"
    ),
    pytest.param(["data", "info", "junk.tif"], {"junk.tif": GARBAGE}, 1, ("junk.tif",), id="data-info-garbage"),
    pytest.param(["data", "info", "nowhere"], {}, 1, ("Unknown scene 'nowhere'",), id="data-info-unknown-scene"),
    pytest.param(["data", "list", "data.rooot=x"], {}, None, ("data.rooot",), id="data-unknown-option"),
]


@pytest.mark.parametrize(("argv", "files", "code", "words"), OTHER_CASES)
def test_other_commands_refuse_without_a_traceback(argv, files, code, words, sandbox, capsys):
    _write(sandbox, files)
    argv = [*argv, "output.root=runs"] if argv[0] == "compare" else argv
    _assert_refused(argv, _run(argv, capsys), code, words, [sandbox / "runs"], sandbox)


# ------------------------------------------------------------------------------------ predict and resume
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One real quickstart run over synthetic_tiny (one epoch, with its map), to hand to predict and resume broken."""
    folder = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("XDG_CACHE_HOME", str(folder / ".cache"))
        code = main(["fit", *QUICK, "output.root=runs", "output.save_map=true"])
    assert code == 0
    (run,) = (folder / "runs" / "quickstart").iterdir()
    assert (run / "checkpoints" / "best.ckpt").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    return run


BEST, LAST = "checkpoints/best.ckpt", "checkpoints/last.ckpt"

# (the command, with {run} for a fresh copy of the finished run; files to break in that copy; files to write in the
# case's folder; exit code, None where any non-zero one will do; words the message must hold)
PREDICT_CASES = [
    pytest.param(["predict"], {}, {}, 2, ("needs run=RUN_DIR",), id="no-run"),
    pytest.param(["predict", "run=absent"], {}, {}, 1, ("absent does not exist", "run=DIR"), id="run-absent"),
    pytest.param(
        ["predict", "run=notarun"],
        {},
        {"notarun/notes.txt": "not a run\n"},
        1,
        ("notarun has no config.yaml",),
        id="not-a-run",
    ),
    pytest.param(["predict", "run={run}"], {BEST: GARBAGE}, {}, 1, ("best.ckpt",), id="checkpoint-garbage"),
    pytest.param(["predict", "run={run}"], {BEST: b""}, {}, 1, ("best.ckpt",), id="checkpoint-empty"),
    pytest.param(["predict", "run={run}"], {BEST: fx.truncate}, {}, 1, ("best.ckpt",), id="checkpoint-truncated"),
    pytest.param(
        ["predict", "run={run}"],
        {BEST: _torch_file(_foreign_weights)},
        {},
        1,
        ("best.ckpt", "does not hold this run's CNN3D", "Missing key(s)"),
        id="checkpoint-of-another-model",
    ),
    pytest.param(
        ["predict", "run={run}"],
        {BEST: _torch_file(lambda: {"epoch": 1})},
        {},
        1,
        ("best.ckpt",),
        id="checkpoint-no-state-dict",
    ),
    pytest.param(
        ["predict", "run={run}"],
        {BEST: _torch_file(lambda: {"state_dict": _RunsACommand()})},
        {},
        1,
        ("best.ckpt",),
        id="checkpoint-that-runs-code",
    ),
    pytest.param(
        ["predict", "run={run}"],
        {"preprocessing.npz": GARBAGE},
        {},
        1,
        ("preprocessing.npz",),
        id="preprocessing-garbage",
    ),
    pytest.param(
        ["predict", "run={run}"],
        {"config.yaml": "data: [unclosed\n"},
        {},
        None,
        ("config.yaml",),
        id="run-config-bad-yaml",
    ),
    pytest.param(
        ["predict", "run={run}", "cube=short.npy"],
        {},
        {"short.npy": np.zeros((24, 24, 30), dtype=np.float32)},
        1,
        ("short.npy has 30 bands", "32-band cube"),
        id="cube-wrong-band-count",
    ),
    pytest.param(
        ["predict", "run={run}", "cube=absent.npy"], {}, {}, 1, ("absent.npy (cube) does not exist",), id="cube-absent"
    ),
    pytest.param(
        ["predict", "run={run}", "cube=junk.npy"],
        {},
        {"junk.npy": GARBAGE},
        1,
        ("junk.npy", "could not be read"),
        id="cube-junk",
    ),
    pytest.param(["predict", "run={run}", "probabilities=maybe"], {}, {}, 2, ("probabilities", "maybe"), id="bad-bool"),
    pytest.param(["predict", "run={run}", "tile_rows=-1"], {}, {}, 2, ("tile_rows=-1",), id="negative-tile-rows"),
    pytest.param(
        ["predict", "run={run}", "output=taken.txt"],
        {},
        {"taken.txt": "a file\n"},
        1,
        ("taken.txt",),
        id="output-is-a-file",
    ),
    pytest.param(
        ["predict", "run={run}", "output=locked/maps"],
        {},
        {"locked": _locked_folder},
        1,
        ("locked/maps",),
        id="output-unwritable",
        marks=AS_ROOT,
    ),
]
RESUME_CASES = [
    pytest.param(["fit", "resume=absent"], {}, {}, 1, ("resume=absent", "not a run folder"), id="resume-absent"),
    pytest.param(["fit", "resume=last"], {}, {}, 1, ("resume=last", "no stopped run"), id="resume-last-none-stopped"),
    pytest.param(["fit", "resume={run}"], {}, {}, 1, ("is a finished run",), id="resume-finished-run"),
    pytest.param(
        ["fit", "resume={run}", "train.lr=0.5"], {}, {}, 2, ("resume=", "train.lr"), id="resume-changing-the-config"
    ),
    pytest.param(["fit", "resume={run}"], {LAST: GARBAGE}, {}, 1, ("last.ckpt",), id="resume-checkpoint-garbage"),
]


def _on_a_copy(command: list[str], damage: dict, files: dict, finished: Path, folder: Path) -> list[str]:
    run = shutil.copytree(finished, folder / "run", ignore=shutil.ignore_patterns("predict"))
    _write(run, damage)
    _write(folder, files)
    quiet = ["progress=false"] if command[0] == "predict" else []
    return [arg.format(run=run) for arg in command] + quiet


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.parametrize(("command", "damage", "files", "code", "words"), PREDICT_CASES + RESUME_CASES)
def test_predict_and_resume_leave_the_run_as_it_was(command, damage, files, code, words, finished_run, sandbox, capsys):
    argv = _on_a_copy(command, damage, files, finished_run, sandbox)
    before = _snapshot(sandbox / "run")
    untouched = [sandbox / "runs", sandbox / "notarun" / "predict", sandbox / "locked"]
    _assert_refused(argv, _run(argv, capsys), code, words, untouched, sandbox)
    assert _snapshot(sandbox / "run") == before, f"hslite {' '.join(argv)} changed the run it was given"
    assert not (sandbox / "taken.txt").is_dir()


# ------------------------------------------------------------------------------------- the real console script
def _case(table: list, case_id: str) -> tuple:
    return next(param.values for param in table if param.id == case_id)


@pytest.mark.parametrize(
    ("table", "case_id"),
    [(FIT_CASES, "recipe-python-tag"), (FIT_CASES, "cube-npy-garbage"), (PREDICT_CASES, "checkpoint-garbage")],
    ids=["fit-recipe-python-tag", "fit-cube-npy-garbage", "predict-checkpoint-garbage"],
)
def test_the_console_script_exits_without_a_traceback(table, case_id, sandbox, request):
    if table is PREDICT_CASES:
        command, damage, files, code, words = _case(table, case_id)
        argv = _on_a_copy(command, damage, files, request.getfixturevalue("finished_run"), sandbox)
        untouched = [sandbox / "run" / "predict"]
    else:
        overrides, files, code, words = _case(table, case_id)
        _write(sandbox, files)
        argv, untouched = ["fit", *QUICK, "output.root=runs", *overrides], [sandbox / "runs"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_CACHE_HOME": str(sandbox / ".cache")}
    done = subprocess.run(
        [sys.executable, "-m", "hslite", *argv], cwd=sandbox, env=env, capture_output=True, text=True, timeout=120
    )
    result = (done.returncode, done.stdout + done.stderr, done.stderr)
    _assert_refused(argv, result, code, words, untouched, sandbox)
