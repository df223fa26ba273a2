"""Publishing files and directories atomically: write under a temporary name beside the target,
then rename. A reader (or a resumed run) sees the complete target or nothing, never a half.

``atomic_file(target)``: a temporary file in the target's directory, fsynced and ``os.replace``d
over ``target`` on success, removed on failure. ``atomic_directory(target)``: a temporary
directory beside ``target``, renamed to it on success, deleted on failure; an existing
``target`` is refused. With ``partial=`` the temporary directory has that fixed name instead of a
random one, so the next attempt removes what a killed one left (a random name would stay forever).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from parallel.checkpoint.errors import CheckpointError


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in ``target``'s directory for the body to write the file at (by
    name: ``torch.save``, ``write_text``, ``open``). On success the file is fsynced and renamed
    over ``target`` (replacing an existing one); on failure it is removed and ``target`` is
    untouched. The parent directory is created if missing; the file gets the umask's permissions."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make the published file private
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)


def partial_dir(target: str | os.PathLike) -> Path:
    """The fixed temporary name beside ``target`` (``.NAME.partial``) for ``atomic_directory``'s
    ``partial``: a save killed half-way leaves it under a name the next attempt removes."""
    target = Path(target)
    return target.parent / f".{target.name}.partial"


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, partial: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside ``target``; rename it to ``target`` on success, delete
    it on failure. An existing ``target`` is refused (never overwritten half-way). ``partial``: a
    fixed name for the temporary directory (in ``target``'s directory), removed first if a killed
    attempt left it."""
    target = Path(target)
    if target.exists():
        raise CheckpointError(f"{target} already exists; choose a new output directory or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    if partial is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make the renamed directory private
    else:
        tmp = Path(partial)
        if tmp.parent.resolve() != target.parent.resolve():
            raise ValueError(f"partial directory {tmp} must be beside {target} (a rename does not cross directories)")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_directory(target.parent)
