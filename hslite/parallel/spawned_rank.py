"""How a spawned rank ends once its work is handed back: at once, without the interpreter's exit."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def end_finished_rank() -> NoReturn:
    """End a spawned rank whose work and last collective are done, its output flushed, without interpreter exit.

    A finished spawned rank aborted at interpreter exit in CI ("terminate called without an active exception",
    SIGABRT) once gloo's threads outlived the group's destroy (pytorch/pytorch#179291, strategies.DestroyedAtExit):
    FSDP's ranks, and the ranks that measure links. What the rank hands back must be written (a queue, a file) first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
