"""A small JSON cache under the user cache dir, keyed by what was measured: probes, links, loop cost, checksums.

Shared by the pre-flight, the training-loop cost measurement in `parallel/` and the checksum verification of scene
files (whose folders may be read-only or shared, so nothing is cached beside them), so every record lives in one place.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import platformdirs

from hslite.atomic import atomic_write


def cache_file(kind: str, key: dict[str, Any]) -> Path:
    """Path of the JSON cache entry for one record: `<user cache>/hslite/records/<kind>-<hash of key>.json`."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(platformdirs.user_cache_dir("hslite")) / "records" / f"{kind}-{digest}.json"


def read_cache(kind: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached result stored under this exact key, or None when absent, unreadable or stored for another key."""
    path = cache_file(kind, key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry.get("result") if entry.get("key") == key else None


def write_cache(kind: str, key: dict[str, Any], result: dict[str, Any]) -> Path:
    """Store a result with its key (kept in the file so a hash collision can never return the wrong entry).

    The cache is shared by every run of the user, and runs started together write the same record: each writes its
    own temporary file (a fixed name had one run rename away the file another was about to rename, and that run
    died), and the rename means a reader never sees half an entry.
    """
    path = cache_file(kind, key)
    text = json.dumps({"key": key, "result": result}, indent=1).encode()
    atomic_write(path, lambda f: f.write(text))
    return path
