"""Output locations, checked before a command does any work: a run that cannot write its result
should fail in its first second, not after an hour of decoding."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dspark_jax.errors import UserError


def _check_writable_folder(folder: Path, option: str, path: Path) -> None:
    """Creates `folder` if needed and writes a scratch file into it: permissions, read-only
    filesystems and files standing where a folder belongs all show up here, whoever runs. The
    folders it had to create are removed again, so a command refused later (a bad mesh, a bad
    limit) leaves nothing behind; the command creates them when it writes its result."""
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == Path(p.anchor))
    if existing.exists() and not existing.is_dir():
        raise UserError(f"{option} {path}: {existing} is a file, not a folder")
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"{option} {path}: cannot write there ({e.strerror or e})") from None
    finally:
        for made in created:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """`path` as a Path, once a file can be written there."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path}: is a folder; give a file name")
    _check_writable_folder(path.parent, option, path)
    return path


def check_plot_file(path: str | os.PathLike, option: str = "--plot") -> Path:
    """`path` as a Path, once a file can be written there in a format matplotlib writes: it
    goes by the suffix, and a suffix it cannot write would fail only after the command's work
    was done (and its other outputs written)."""
    from matplotlib.figure import Figure  # only commands given a plot pay for the import

    path = check_output_file(path, option)
    formats = sorted(Figure().canvas.get_supported_filetypes())
    suffix = path.suffix[1:].lower()
    if suffix not in formats:
        found = f"the suffix .{suffix}" if suffix else "no suffix"
        raise UserError(
            f"{option} {path}: has {found}, which names no image format matplotlib writes; end "
            f"the name in one of {', '.join('.' + f for f in formats)} (e.g. .png)"
        )
    return path


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` name one file, however spelt (relative or absolute, through links;
    hard links included when both exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return Path(a).resolve() == Path(b).resolve()


def check_not_same_file(
    path: str | os.PathLike,
    option: str,
    other: str | os.PathLike,
    other_option: str,
    consequence: str,
) -> None:
    """Refuses an output `path` that names the file `other` (an input, or another output)
    names: writing it would destroy that file. `consequence` says what would happen."""
    if same_file(path, other):
        also = "" if str(path) == str(other) else f" {other}"
        raise UserError(
            f"{option} {path} is the {other_option} file{also}: {consequence}; give {option} "
            "another name"
        )


def check_output_folder(path: str | os.PathLike, option: str, *, created: bool = True) -> Path:
    """`path` as a Path, once files can be written into it. With `created` false the folder is
    written atomically later (as a renamed sibling), so only its parent is checked."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {path}: exists and is not a folder")
    if not created:
        # The result replaces the whole folder by a rename, which the system refuses for the
        # folder a process works in and its parents ("Device or resource busy").
        resolved, cwd = path.resolve(), Path.cwd().resolve()
        if resolved == cwd or resolved in cwd.parents:
            parent = "" if resolved == cwd else "a parent of "
            raise UserError(
                f"{option} {path}: is {parent}the working directory; the output replaces the "
                "whole folder, which cannot be done to the folder you are in: give a new folder "
                "(e.g. a subfolder)"
            )
    _check_writable_folder(path if created else path.parent, option, path)
    return path


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a hidden sibling of `path` to write the file to, renamed to `path` when the block
    ends and removed when it raises (Ctrl-C included): `path` is never half written, and an
    interrupted run leaves what was there before. The sibling keeps `path`'s suffix, so
    writers that go by it (matplotlib, numpy) write the same format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
