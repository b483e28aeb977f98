"""Which files a source reads: paths, globs, folders and URLs expanded into files.

:func:`expand_paths` turns the user's paths, globs and directories into a
sorted list of files, so shard ids are stable whatever order the user listed
them in. A path that exists is that file (or folder), even when its name
holds ``*``, ``?`` or ``[``; only a path that does not exist is a glob. A
file reached by two paths (``./a.jsonl``, a symlink, a hardlink) is listed
once, and a glob match that cannot be read (a dangling symlink: an unmounted
volume) is an error or, when asked, a counted skip; neither is ever silent.

A path is local (read with plain ``open``) or an fsspec URL (anything with
``"://"``).
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
import stat
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from zephon_torch._extras import require

__all__ = ["expand_paths", "is_url", "url_fs"]


def is_url(path: str) -> bool:
    """True if ``path`` names an fsspec URL (``"s3://..."``, ``"memory://..."``)."""
    return "://" in path


def url_fs(url: str) -> tuple[Any, str]:
    """``(filesystem, path)`` of an fsspec URL (imports fsspec on first use)."""
    fsspec = require("fsspec", f"reading the URL {url!r}")  # only URLs need it

    return fsspec.core.url_to_fs(url)


# ---------------------------------------------------------------- paths


def expand_paths(paths: Any, *, what: str, suffixes: Sequence[str] | None,
                 on_error: str = "raise",
                 skipped: list[tuple[str, str]] | None = None) -> list[str]:
    """Expand paths, globs and directories into a sorted list of distinct files.

    Args:
        paths: A path or a list of them; each may be a glob (``data/*.jsonl``),
            a directory (its files with a supported suffix) or an fsspec URL.
            An existing path is never a glob (see below).
        what: The source's name for messages (``"jsonl"``).
        suffixes: Supported lower-case suffixes, or None to accept any file.
        on_error: What to do with a glob match or directory entry that cannot
            be read (a dangling symlink, a symlink loop, a pipe): ``"raise"``,
            or ``"skip"`` it with a warning that counts and names them.
        skipped: If given, receives ``(path, reason)`` for each entry skipped.

    One file reached by several paths (``a.jsonl`` and ``./a.jsonl``, a
    symlink, a hardlink, a ``**`` glob through a symlinked folder) is kept
    once, under the path that sorts first, with a warning naming the others.

    A path that exists is taken literally before any glob expansion: file
    names may hold ``*``, ``?`` and ``[`` (``shard[1].jsonl`` is that file,
    never ``shard1.jsonl``). When such a path would, as a glob, also match
    other files, the existing one still wins and a warning names the others
    (``touch data/*.jsonl`` in a shell leaves a file named ``*.jsonl``). In
    a glob, the leading folders that exist under their own name are literal
    too (``run[1]/*.jsonl`` lists the folder ``run[1]``); a name after a
    wildcard is always a pattern (``glob.escape`` it to match it exactly).
    The same holds for URLs.

    Raises:
        ValueError: ``paths`` is empty or not made of strings, or a file has an
            unsupported suffix.
        FileNotFoundError: A path or glob matches no file, an explicit path
            is a dangling symlink or a symlink loop, or (``on_error="raise"``)
            a glob match or directory entry cannot be read.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    elif not isinstance(paths, Iterable):
        raise ValueError(
            f"{what}: paths must be a path, a glob or a list of them, got {paths!r}"
        )
    paths = list(paths)
    if not paths:
        raise ValueError(
            f"{what}: paths is empty; pass a file, a glob such as 'data/*.jsonl', "
            "or a list of them"
        )
    found: set[str] = set()
    unreadable: list[tuple[str, str]] = []
    notes: list[str] = []  # folders a ``**`` glob reached twice, or loops, not entered again
    for raw in paths:
        path = os.fspath(raw) if isinstance(raw, os.PathLike) else raw
        if not isinstance(path, str) or not path:
            raise ValueError(f"{what}: every path must be a non-empty string, got {raw!r}")
        if is_url(path):
            matches, bad = _expand_url(path, suffixes, notes), []
        else:
            matches, bad = _expand_local(path, suffixes, what, notes)
        if not matches:
            if bad:
                raise FileNotFoundError(f"{what}: {path!r} matches no readable file: "
                                        f"{_listing(bad)}; fix or remove them")
            hint = "" if is_url(path) else f" (relative paths start from {os.getcwd()!r})"
            raise FileNotFoundError(f"{what}: {path!r} matches no file{hint}; check the path")
        found.update(matches)
        unreadable.extend(p for p in bad if p not in unreadable)
    if unreadable:
        unreadable.sort()
        if on_error != "skip":
            raise FileNotFoundError(
                f"{what}: {len(unreadable)} path(s) matched by a glob or found in a folder "
                f"cannot be read: {_listing(unreadable)}; fix or remove them, or pass "
                "on_error='skip' to leave them out (counted, with a warning)"
            )
        warnings.warn(f"{what}: on_error='skip' leaves out {len(unreadable)} path(s) that "
                      f"cannot be read: {_listing(unreadable)}", RuntimeWarning, stacklevel=4)
        if skipped is not None:
            skipped.extend(unreadable)
    if notes:
        warnings.warn(f"{what}: {'; '.join(notes)}", RuntimeWarning, stacklevel=4)
    files = sorted(found)
    if suffixes is not None:
        for file in files:
            if not file.lower().endswith(tuple(suffixes)):
                raise ValueError(
                    f"{what}: {file!r} has an unsupported extension; supported: "
                    f"{', '.join(suffixes)}"
                )
    return _distinct_files(files, what)


def _listing(entries: Sequence[tuple[str, str]], limit: int = 5) -> str:
    """``'a' is ...; 'b' is ...`` for the first ``limit`` entries, then a count."""
    shown = "; ".join(f"{path!r} {why}" for path, why in entries[:limit])
    more = len(entries) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


def _has_magic(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _entry_problem(path: str) -> str | None:
    """Why a path that exists as a directory entry cannot be read as a file (None: it can).

    A directory is not a problem either (globs such as ``data/*`` match folders,
    which are not files to read); the caller filters them out.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop (following its links leads back to a link already seen)"
        if os.path.islink(path) and exc.errno == errno.ENOENT:
            return (f"is a symlink to {os.readlink(path)!r}, which does not exist (an "
                    "unmounted volume, a moved folder?)")
        return f"cannot be reached ({exc.strerror})"
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    return "is not a regular file (a pipe, a socket or a device)"


def _classify(candidates: Iterable[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Split directory entries into readable files and ``(path, why)`` for the others."""
    files: list[str] = []
    bad: list[tuple[str, str]] = []
    for path in candidates:
        if os.path.isfile(path):
            files.append(path)
        elif not os.path.isdir(path):
            problem = _entry_problem(path)
            if problem is not None:
                bad.append((path, problem))
    return files, bad


def _expand_local(path: str, suffixes: Sequence[str] | None, what: str,
                  notes: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Files a local path names, and the entries it names that cannot be read.

    An existing path is that path, even when it holds ``*``, ``?`` or ``[``
    (``shard[1].jsonl`` is a real name); only a path that does not exist is
    a glob. Its leading folders that exist under their own name (``run[1]``
    in ``run[1]/*.jsonl``) are taken literally too.
    """
    if _has_magic(path):
        if os.path.lexists(path):
            others = [m for m in _glob_local(path, []) if m != path]
            _note_literal(path, others, notes)
            return _expand_named(path, suffixes, what)
        pattern = _escape_existing_folders(path)
        return _classify(_glob_local(pattern, notes))
    return _expand_named(path, suffixes, what)


def _glob_local(pattern: str, notes: list[str]) -> list[str]:
    if "**" in pattern:
        return _recursive_glob(pattern, notes)
    return glob.glob(pattern)


def _note_literal(path: str, others: Sequence[str], notes: list[str]) -> None:
    """Note that ``path``, an existing name that reads as a glob, is taken as named."""
    if others:
        shown = ", ".join(repr(o) for o in sorted(others)[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        kind = "folder" if os.path.isdir(path) else "file"
        notes.append(f"{path!r} names an existing {kind} and is read as that {kind}; as a glob "
                     f"it would also match {shown}{more}, which "
                     f"{'is' if len(others) == 1 else 'are'} not read (list them too, or "
                     f"rename the {kind}, to read them)")


def _escape_existing_folders(pattern: str) -> str:
    """``pattern`` with its longest leading run of folders that exist escaped for glob."""
    parts = pattern.split(os.sep)
    for k in range(len(parts) - 1, 0, -1):
        prefix = os.sep.join(parts[:k])
        if prefix and _has_magic(prefix) and os.path.isdir(prefix):
            return os.sep.join([glob.escape(prefix), *parts[k:]])
    return pattern


def _expand_named(path: str, suffixes: Sequence[str] | None,
                  what: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Files a path that is not a glob names: itself, or a folder's files."""
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        entries = [os.path.join(path, n) for n in names if not n.startswith(".")]
        return _classify(f for f in entries if _suffix_ok(f, suffixes))
    if os.path.isfile(path):
        return [path], []
    if os.path.lexists(path):  # named explicitly: an error whatever on_error says
        problem = _entry_problem(path) or "is not a file"
        raise FileNotFoundError(f"{what}: {path!r} {problem}; check the path")
    return [], []


def _recursive_glob(pattern: str, notes: list[str]) -> list[str]:
    """What ``glob.glob(pattern, recursive=True)`` matches, without entering a folder twice.

    The standard library follows symlinked folders under ``**`` without
    remembering where it has been: a link back to a parent makes it list the
    same files under ever longer paths, without end. This walk matches the
    same names (``**`` is zero or more folders; names starting with ``.``
    match only a pattern part starting with ``.``), in sorted order, but
    enters each folder once per matching state: a folder reached again is
    skipped, with a note naming both paths, and a link back to a folder being
    walked (a loop) is not followed.
    """
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) - 1 and not _has_magic(parts[fixed]):
        fixed += 1
    root = os.sep.join(parts[:fixed])
    rest = [p for p in parts[fixed:] if p]  # "a//b" is "a/b"
    if root and not os.path.isdir(root):
        return []
    out: list[str] = []
    first_path: dict[tuple[Any, frozenset[int]], str] = {}

    def closure(states: Iterable[int]) -> frozenset[int]:
        seen = set()
        todo = list(states)
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            if i < len(rest) and rest[i] == "**":
                todo.append(i + 1)  # ``**`` may match no folder at all
        return frozenset(seen)

    def step(states: frozenset[int], name: str) -> frozenset[int]:
        hidden = name.startswith(".")
        nxt = []
        for i in states:
            if i >= len(rest):
                continue
            part = rest[i]
            if part == "**":
                if not hidden:
                    nxt.append(i)
            elif (not hidden or part.startswith(".")) and fnmatch.fnmatchcase(name, part):
                nxt.append(i + 1)
        return closure(nxt)

    def walk(folder: str, states: frozenset[int], ancestors: dict[Any, str]) -> None:
        try:
            st = os.stat(folder or os.curdir)
            names = sorted(os.listdir(folder or os.curdir))
        except OSError:
            return  # an unreadable folder matches nothing, as for glob.glob
        ident = (st.st_dev, st.st_ino)
        if ident in ancestors:
            notes.append(f"{folder!r} leads back to {ancestors[ident]!r} (a symlink loop); "
                         "it is not followed")
            return
        key = (ident, states)
        if key in first_path:
            notes.append(f"folder {folder!r} is the same as {first_path[key]!r} (reached by "
                         "two paths); its files are read once")
            return
        first_path[key] = folder
        ancestors = {**ancestors, ident: folder}
        for name in names:
            after = step(states, name)
            if not after:
                continue
            child = os.path.join(folder, name) if folder else name
            if len(rest) in after:
                out.append(child)
            if any(i < len(rest) for i in after) and os.path.isdir(child):
                walk(child, after, ancestors)

    walk(root, closure([0]), {})
    return out


def _expand_url(url: str, suffixes: Sequence[str] | None, notes: list[str]) -> list[str]:
    fs, path = url_fs(url)
    if _has_magic(path):
        if not fs.exists(path):
            return [fs.unstrip_protocol(m) for m in fs.glob(path) if fs.isfile(m)]
        # An existing object is that object, as for local paths.
        others = [fs.unstrip_protocol(m) for m in fs.glob(path)
                  if fs.isfile(m) and m.rstrip("/") != path.rstrip("/")]
        _note_literal(url, others, notes)
    if fs.isdir(path):
        entries = fs.ls(path, detail=True)
        return [fs.unstrip_protocol(e["name"]) for e in entries
                if e.get("type") == "file" and _suffix_ok(e["name"], suffixes)]
    return [url] if fs.exists(path) else []


def _suffix_ok(path: str, suffixes: Sequence[str] | None) -> bool:
    return suffixes is None or path.lower().endswith(tuple(suffixes))


def _identity(path: str) -> tuple[Any, ...]:
    """What makes two paths the same file: the normalised URL, or device and inode."""
    if is_url(path):
        fs, inner = url_fs(path)
        return ("url", fs.unstrip_protocol(inner))
    st = os.stat(path)
    if not st.st_ino:  # a filesystem without inode numbers: the resolved path
        return ("path", os.path.realpath(path))
    return ("inode", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _distinct_files(files: list[str], what: str) -> list[str]:
    """``files`` without those that are the same file as an earlier one (with a warning)."""
    first: dict[tuple[Any, ...], str] = {}
    kept: list[str] = []
    twins: list[tuple[str, str]] = []
    for path in files:
        ident = _identity(path)
        if ident in first:
            twins.append((path, f"is the same file as {first[ident]!r}"))
        else:
            first[ident] = path
            kept.append(path)
    if twins:
        warnings.warn(f"{what}: {len(twins)} file(s) are reached by two paths and are read "
                      f"once: {_listing(twins)}", RuntimeWarning, stacklevel=4)
    return kept
