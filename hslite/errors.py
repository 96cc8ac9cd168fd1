"""Errors a person reads: each says what was wrong, the value seen and what to do.

hslite reads .npy/.npz with `allow_pickle=False` and torch files with `weights_only=True`: loading never runs code
from a file. When numpy or torch refuse one, their messages advise loading it unsafely, which hslite never passes on:
a reader says `unreadable(err)` and then what the file should have been; only other faults (a truncated file, a
missing array) are quoted.
"""

from __future__ import annotations

import pickle


class HSLiteError(Exception):
    """Base of every error hslite reports to a user without a traceback."""

    exit_code = 1


class ConfigError(HSLiteError):
    """A recipe, override or command line that cannot be used as given (usage error)."""

    exit_code = 2


class DataError(HSLiteError):
    """A scene file that is missing, corrupt or inconsistent, or a preprocessing request it cannot satisfy."""

    exit_code = 1


class ModelError(HSLiteError):
    """A model name or size that does not exist, or sizes that do not fit the data."""

    exit_code = 2


# Words of those refusals (numpy 2.x: "contains pickled (object) data", "Object arrays cannot be loaded when ...",
# "Python objects in dtype"; torch 2.6+: "Weights only load failed ... weights_only ..."). Any message holding one is
# never quoted, so no advice to load unsafely reaches a user even if a library rewords the rest.
PICKLE_WORDS = ("pickle", "python objects", "object arrays", "weights only", "weights_only")


def refused_as_pickled(err: BaseException) -> bool:
    """True when numpy or torch refused a file as pickled Python objects (or as no file of theirs at all).

    numpy takes any file that is neither .npy nor .npz for a pickle, and torch's safe unpickler refuses random bytes
    like a forbidden class, so this is also how a file of another kind fails.
    """
    # An OSError's text names the file, whose own name may hold one of the words: only its reason is looked at.
    text = (err.strerror if isinstance(err, OSError) and err.strerror else str(err)).lower()
    return isinstance(err, pickle.UnpicklingError) or any(word in text for word in PICKLE_WORDS)


def unreadable(err: BaseException) -> tuple[str, BaseException | None]:
    """Why a file a library refused cannot be used, in hslite's words, and the error to chain it to.

    A refusal as pickled objects is said as such and chained to nothing, so its library's advice (to load the file
    unsafely) shows neither in the message nor in a traceback; any other fault is quoted by its first line.
    """
    if refused_as_pickled(err):
        return "it holds Python objects (or is no such file at all), which hslite never writes and will not load", None
    return f"it cannot be read ({first_line(err)})", err


def first_line(err: BaseException) -> str:
    """`err`'s type and the first line of its text, to quote a fault that `refused_as_pickled` says is not pickled."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
