"""Fetch scene files: where each comes from (`RemoteFile`), download, sha256 verification and the checksum cache.

A missing file is downloaded only when allowed, to a temporary file moved into place once it verifies; every failure a
user can cause becomes a `DataError` that names the file and says what to do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hslite.cache import read_cache, write_cache
from hslite.errors import DataError

log = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 1 << 20
_DOWNLOAD_TIMEOUT_SECONDS = 60


@dataclass(frozen=True)
class RemoteFile:
    """One file of a scene as distributed: its original name, download URL (None = local only) and digest."""

    name: str
    url: str | None
    sha256: str | None
    size_bytes: int | None


def ensure_file(remote: RemoteFile, folder: Path, download: bool) -> Path:
    """Return the path of `remote` inside `folder`, downloading it when missing and allowed; verify its sha256.

    A verified checksum is cached in the user cache directory (never beside the file: a data folder may be
    read-only or shared), keyed on the file's resolved path, size and mtime, so big files are hashed once and a moved
    or changed file is hashed again. Downloads go to a temporary file in the same folder and are moved into place
    only after they verify (atomic).
    """
    folder = Path(folder)
    path = folder / remote.name
    if path.is_file():
        _verify(path, remote)
        return path
    where = f"put it at {path}, or point data.root at a folder that holds {folder.name}/{remote.name}"
    if remote.url is None:
        raise DataError(
            f"{remote.name} is missing and has no public download URL; obtain it as described in data/README.md and "
            f"{where}."
        )
    if not download:
        raise DataError(
            f"{remote.name} is missing. Download it from {remote.url} and {where}; or set data.download=true "
            "(download=True) to fetch it automatically."
        )
    _download(remote, path)
    return path


def _verify(path: Path, remote: RemoteFile) -> None:
    size_bytes = path.stat().st_size
    fix = f"Delete it and download it again from {remote.url}" if remote.url else "Replace it with a good copy"
    if remote.size_bytes is not None and size_bytes != remote.size_bytes:
        raise DataError(
            f"{path} is {size_bytes} bytes but {remote.name} should be {remote.size_bytes} bytes; it is truncated or "
            f"a different file. {fix}."
        )
    if remote.sha256 is None:
        return
    digest = _cached_sha256(path) or _hash_and_cache(path)
    if digest != remote.sha256:
        raise DataError(
            f"{path} has sha256 {digest} but {remote.name} should have {remote.sha256}; the file is corrupt or a "
            f"different version. {fix}."
        )


def _checksum_key(path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _cached_sha256(path: Path) -> str | None:
    cached = read_cache("sha256", _checksum_key(path))
    return None if cached is None else str(cached["sha256"])


def _hash_and_cache(path: Path, digest: str | None = None) -> str:
    digest = digest or sha256_file(path)
    try:
        write_cache("sha256", _checksum_key(path), {"sha256": digest})
    except OSError:
        log.debug("cannot cache the checksum of %s (cache folder not writable); it will be hashed again", path)
    return digest


def sha256_file(path: Path) -> str:
    """Return the hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _download(remote: RemoteFile, path: Path) -> None:
    assert remote.url is not None  # ensure_file only downloads files that have a URL
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{remote.name}.", suffix=".part")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    log.info("downloading %s to %s", remote.url, path)
    try:
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(remote.url, timeout=_DOWNLOAD_TIMEOUT_SECONDS) as r:
            while chunk := r.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        size_bytes = tmp.stat().st_size
        if remote.size_bytes is not None and size_bytes != remote.size_bytes:
            raise DataError(
                f"Downloading {remote.url} gave {size_bytes} bytes, not the {remote.size_bytes} expected for "
                f"{remote.name}; nothing was saved. Try again, or download it by hand to {path}."
            )
        if remote.sha256 is not None and digest.hexdigest() != remote.sha256:
            raise DataError(
                f"Downloading {remote.url} gave sha256 {digest.hexdigest()}, not the {remote.sha256} expected for "
                f"{remote.name}; nothing was saved. The server may serve a different version: download it by hand, "
                f"check it, and put it at {path}."
            )
        os.replace(tmp, path)
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise DataError(
            f"Could not download {remote.name} from {remote.url} ({err}). If this machine is offline, download it "
            f"elsewhere and put it at {path}."
        ) from err
    finally:
        tmp.unlink(missing_ok=True)
    if remote.sha256 is not None:
        _hash_and_cache(path, digest.hexdigest())
