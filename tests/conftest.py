"""Shared fixtures: the real data folder (skipped when absent), a tiny synthetic scene and a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from hslite.process.caller_state import caller_state_kept

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The ../shared/data folder of real benchmark files; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real benchmark files not found at {SHARED_DATA} (../shared/data beside the repository)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_scene():
    """The registered 24x24x32, 4-class synthetic scene (seed 0)."""
    from hslite.datasets.scenes.registry import load_scene

    return load_scene("synthetic_tiny", seed=0)


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A private user cache (probes, links, loop cost), so a test measures instead of reading another run's figure."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # platformdirs' user cache dir on Linux
    return tmp_path


@pytest.fixture(autouse=True)
def process_state_of_its_own():
    """Every test starts from the process state the last one found: a test that runs the CLI in-process (`main`)
    leaves what a CLI process keeps (TF32, threads, ...), which no later test should inherit."""
    with caller_state_kept():
        yield
