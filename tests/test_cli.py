"""The command line: fast help, exit codes, messages without tracebacks, and the quickstart end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hslite.cli import main

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "hslite", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_help_imports_no_torch_and_both_module_forms_run():
    result = run_cli("--help")
    assert result.returncode == 0 and "hslite fit" in result.stdout
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, hslite.cli; print('torch' in sys.modules, 'lightning' in sys.modules)"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.split() == ["False", "False"]  # what keeps --help instant
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    listed = [
        subprocess.run([sys.executable, "-m", module, "recipes"], env=env, capture_output=True, text=True, timeout=60)
        for module in ("hslite", "hslite.cli")  # torchrun's `-m hslite` form, and the module the console script runs
    ]
    assert [r.returncode for r in listed] == [0, 0] and listed[0].stdout == listed[1].stdout
    assert "quickstart" in listed[0].stdout


def test_recipes_lists_names(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "quickstart" in out and "salinas_a_1gpu" in out


def test_unknown_key_is_exit_2_without_traceback(capsys):
    assert main(["fit", "train.max_epoch=1"]) == 2
    err = capsys.readouterr().err
    assert "train.max_epochs" in err and "Traceback" not in err


def test_unknown_recipe_is_exit_2(capsys):
    assert main(["fit", "recipe=nope"]) == 2
    assert "quickstart" in capsys.readouterr().err


def test_too_many_devices_is_a_clear_error(capsys):
    code = main(["fit", "parallel.accelerator=cpu", "parallel.devices=4096"])
    assert code == 2
    assert "4096" in capsys.readouterr().err


def test_bad_argparse_usage_is_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_quickstart_end_to_end_in_a_subprocess(tmp_path):
    result = run_cli("fit", f"output.root={tmp_path}", "train.progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "quickstart").iterdir())
    assert len(runs) == 1 and not runs[0].name.endswith(".incomplete")
    run = runs[0]
    for name in ("config.yaml", "split.npz", "metrics.json", "confusion.png", "map.png", "prediction.tif"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "best.ckpt").is_file()
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["OA"] > 0.6, metrics["OA"]  # far above 1/16 chance: the synthetic scene is learnable
    assert "overall accuracy" in result.stdout
