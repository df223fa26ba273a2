"""A checkpoint directory's manifest: every file's size and checksum, written last at save, checked
before a resume, so that a truncated, corrupted or incomplete checkpoint is found instead of loaded.

``write_manifest(directory)`` records each file (``blake2b`` of its bytes, or only sizes with
``checksums=False``: a save then reads nothing back) into ``MANIFEST_FILE``;
``manifest_problem(directory)`` re-reads them and returns what differs (a missing, resized or
changed file, an extra one), or None. Files are hashed by a thread pool (hashlib releases the GIL),
so a checkpoint is read at about the disk's speed.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST_FILE = "megarl_manifest.json"


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def _record(directory: Path, names: list[str], checksums: bool) -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda name: _digest(directory / name), names)) if checksums else [None] * len(names)
    return {name: {"size": (directory / name).stat().st_size, **({"blake2b": d} if d else {})}
            for name, d in zip(names, digests)}


def write_manifest(directory: str | os.PathLike, checksums: bool = True) -> dict:
    """Record every file under ``directory`` in its ``MANIFEST_FILE``; returns the manifest."""
    directory = Path(directory)
    manifest = {"files": _record(directory, _files(directory), checksums)}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def manifest_problem(directory: str | os.PathLike) -> str | None:
    """What differs between ``directory`` and its manifest (the first problem found), None if
    nothing: no manifest, a file missing, of another size or checksum, or not in the manifest."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return f"it has no {MANIFEST_FILE} (written last at save: the save did not finish)"
    try:
        recorded = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"its {MANIFEST_FILE} is unreadable ({exc})"
    present = set(_files(directory))
    for name in sorted(set(recorded) - present):
        return f"{name} is missing"
    for name in sorted(present - set(recorded)):
        return f"{name} was not written by the save"
    for name, entry in recorded.items():
        size = (directory / name).stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} when saved (truncated or overwritten)"
    checked = [name for name, entry in recorded.items() if "blake2b" in entry]
    actual = _record(directory, checked, checksums=True)
    for name in checked:
        if actual[name]["blake2b"] != recorded[name]["blake2b"]:
            return f"{name} does not match its checksum at save (corrupted)"
    return None
