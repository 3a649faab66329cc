"""The files commands write (plan files, exports, profiles, figures): the destination
checked before any work, so a bad `-o` costs nothing, and the bytes written aside and
renamed, so a crash or a full disk never leaves half a file or a stray `.tmp`."""

from __future__ import annotations

import os
from pathlib import Path

from costmodel.specs.loading import SpecError


def _tmp_of(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def check_writable(path: str | Path, field: str) -> None:
    """SpecError naming `field` unless a file can be written at `path` (its folder exists
    and is writable, the name is allowed, it is not a folder); nothing is left behind."""
    text = str(path)
    if not text.strip():
        raise SpecError(field, "expected a file path, got an empty one")
    target = Path(text)
    try:
        is_dir = target.is_dir()
    except (OSError, ValueError) as err:   # a name too long, a NUL byte
        raise SpecError(field, f"cannot write {text}: {getattr(err, 'strerror', None) or err}") from None
    if is_dir or text.endswith(os.sep) or not target.name or target.name in (".", ".."):
        raise SpecError(field, f"{text} is a folder: give a file path")
    tmp = _tmp_of(target)
    try:
        with open(tmp, "xb"):
            pass
    except FileExistsError:
        return   # a stale .tmp of ours: write_atomic replaces it
    except (OSError, ValueError) as err:
        raise SpecError(field, f"cannot write {text}: {getattr(err, 'strerror', None) or err}") from None
    tmp.unlink(missing_ok=True)


def check_folder(path: str | Path, field: str) -> None:
    """SpecError naming `field` unless files can be written in the folder `path`: it exists
    or can be made, and a probe file can be created in it. Folders made for the probe are
    removed again, so a refused or abandoned command leaves nothing behind. A probe, not
    `os.access`: as root, access says yes to /proc and read-only mounts."""
    text = str(path)
    if not text.strip():
        raise SpecError(field, "expected a folder path, got an empty one")
    folder = Path(text)
    try:
        exists = folder.exists()
        if exists and not folder.is_dir():
            raise SpecError(field, f"{text} is a file, not a folder")
        made = [p for p in [folder, *folder.absolute().parents] if not p.exists()] if not exists else []
    except (OSError, ValueError) as err:   # a name too long, a NUL byte
        raise SpecError(field, f"cannot use {text}: {getattr(err, 'strerror', None) or err}") from None
    probe = folder / ".shardwise-probe"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "xb"):
            pass
    except FileExistsError:
        pass
    except (OSError, ValueError) as err:
        raise SpecError(field, f"cannot write under {text}: {getattr(err, 'strerror', None) or err}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        for made_folder in made:   # deepest first
            try:
                made_folder.rmdir()
            except OSError:
                break


def write_atomic(path: str | Path, data: bytes | str, field: str) -> None:
    """Write aside, then rename; SpecError naming `field` if it cannot, nothing left."""
    target = Path(path)
    tmp = _tmp_of(target)
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        tmp.replace(target)
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise SpecError(field, f"cannot write {path}: {err.strerror or err}") from None
