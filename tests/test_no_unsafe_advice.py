"""No error advises loading a file unsafely: numpy's and torch's advice to unpickle is never written or passed on.

hslite loads .npy/.npz with allow_pickle=False and torch files with weights_only=True. The libraries' refusals advise
`allow_pickle=`, `pickle.load()` or `weights_only` set to False, which would run code from the file; each reader
says instead what the file should have been.
"""

from __future__ import annotations

import ast
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import hslite
from hslite.datasets.fitted import FittedPreprocessing
from hslite.datasets.scenes.io import open_cube, read_labels
from hslite.datasets.scenes.own_scene import read_wavelengths
from hslite.datasets.splits import Split
from hslite.errors import HSLiteError
from hslite.models import get_model
from hslite.models.pretrained import load_pretrained
from hslite.run.checkpoints import read_checkpoint

# The advice, as numpy ("the `allow_pickle=` keyword argument or `pickle.load()`") and torch ("Re-running `torch.load`
# with `weights_only` set to `False`") give it, and as code would spell it.
UNSAFE_ADVICE = re.compile(r"allow_pickle|weights_only\W{0,3}(=|set to)\W{0,3}false|pickle\.load", re.IGNORECASE)
PACKAGE = Path(hslite.__file__).parent


class Pickled:
    """An object a file could carry, whose loading would run code."""


def advising_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal and f-string part in `source` that names an unsafe load, docstrings aside.

    Every string, not only those written inside `raise`, `print`, `warnings.warn` or a logging call: a message is
    often built in a helper or a variable first. A keyword argument (`np.load(path, allow_pickle=False)`) is code, not
    a string, and is not looked at.
    """
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        if UNSAFE_ADVICE.search(node.value)
    ]


def test_the_scan_finds_advice_in_messages_and_not_in_keywords_or_docstrings():
    source = '''
"""Loaded with allow_pickle=False."""
import numpy as np
fix = "pass allow_pickle=True"
def read(path):
    """Never pickle.load."""
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        raise ValueError(f"{path}: ({err}) retry with weights_only=False") from err
print("or call pickle.load()")
'''
    assert sorted(line for line, _ in advising_strings(source)) == [4, 10, 11]


def test_no_string_in_hslite_advises_an_unsafe_load():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100  # the whole package, not an empty glob
    found = [
        f"{f.relative_to(PACKAGE)}:{line}: {text!r}" for f in files for line, text in advising_strings(f.read_text())
    ]
    assert not found, "\n".join(found)


def _split_with_an_object_array(path: Path) -> Path:
    np.savez(path, kind=np.array([{"kind": "stratified"}], dtype=object), seed=np.array(0),
             train=np.zeros((1, 2)), val=np.zeros((1, 2)), test=np.zeros((1, 2)))  # fmt: skip
    return path


def _pickle_named(path: Path) -> Path:
    path.write_bytes(pickle.dumps({"train": [[0, 0]]}))
    return path


def _object_npy(path: Path) -> Path:
    np.save(path, np.array([{"band": 1}], dtype=object), allow_pickle=True)
    return path


def _preprocessing_with_an_object_array(path: Path) -> Path:
    np.savez(path, meta=np.array([{"format": 1}], dtype=object), raw_bands=np.array(6))
    return path


def _torch_file_with_a_class(path: Path) -> Path:
    torch.save({"state_dict": {"model.fc.weight": Pickled()}, "epoch": 1}, path)
    return path


def _cnn3d_from(path: Path) -> None:
    load_pretrained(get_model("cnn3d", in_bands=10, num_classes=4, patch_size=5), path)


# (reader, file with pickled content, what the error must say the file should be)
READERS: dict[str, tuple[Callable[[Path], object], Callable[[Path], Path], str]] = {
    "split-object-array": (Split.load, _split_with_an_object_array, "not a split file written by Split.save"),
    "split-pickle": (Split.load, _pickle_named, "point data.split_file at a run's split.npz"),
    "preprocessing": (FittedPreprocessing.load, _preprocessing_with_an_object_array, "the preprocessing.npz that"),
    "checkpoint": (read_checkpoint, _torch_file_with_a_class, "not a checkpoint hslite wrote"),
    "pretrained": (_cnn3d_from, _torch_file_with_a_class, "save the network's state_dict() with torch.save"),
    "cube-npy": (open_cube, _object_npy, "save it as a plain numeric array"),
    "labels-npy": (read_labels, _object_npy, "save it as a plain numeric array"),
    "wavelengths-npy": (read_wavelengths, _object_npy, "give a numeric .npy array or a text file of numbers"),
}
SUFFIX = {"split-object-array": ".npz", "split-pickle": ".npz", "preprocessing": ".npz", "checkpoint": ".ckpt",
          "pretrained": ".pt"}  # fmt: skip


@pytest.mark.parametrize("case", READERS)
def test_a_file_of_pickled_objects_is_refused_in_hslites_words(tmp_path, case):
    read, write, should_be = READERS[case]
    path = write(tmp_path / f"file{SUFFIX.get(case, '.npy')}")
    with pytest.raises(HSLiteError) as err:
        read(path)
    shown: BaseException | None = err.value  # the message and every exception a traceback would print under it
    while shown is not None:
        assert not UNSAFE_ADVICE.search(str(shown)), f"{type(shown).__name__}: {shown}"
        assert "trust" not in str(shown)  # numpy's "If you trust the file", torch's "if you trust the source"
        shown = shown.__cause__ or (None if shown.__suppress_context__ else shown.__context__)
    assert str(path) in str(err.value) and should_be in str(err.value)


def test_other_faults_are_still_quoted_even_when_the_files_name_says_pickle(tmp_path):
    with pytest.raises(HSLiteError, match=r"cannot be read \(FileNotFoundError: \[Errno 2\].*not a split file"):
        Split.load(tmp_path / "pickled_split.npz")
    np.savez(tmp_path / "split.npz", kind=np.array("stratified"))
    with pytest.raises(HSLiteError, match=r"cannot be read \(KeyError: 'seed is not a file.*not a split file"):
        Split.load(tmp_path / "split.npz")
