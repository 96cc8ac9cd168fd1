"""Files numpy or torch refuse as pickled Python objects, told apart so that hslite says what is wrong in its words.

hslite reads .npy/.npz with `allow_pickle=False` and torch files with `weights_only=True`: loading never runs code
from a file. When they refuse one, numpy's and torch's messages advise loading it unsafely, which hslite never passes
on. A reader asks `refused_as_pickled(err)` and then says what the file should have been; only other faults (a
truncated file, a missing array) are quoted, with `first_line`.
"""

from __future__ import annotations

import pickle

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


def first_line(err: BaseException) -> str:
    """`err`'s type and the first line of its text, to quote a fault that `refused_as_pickled` says is not pickled."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
