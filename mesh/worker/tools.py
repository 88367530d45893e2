"""Real tools for workers, confined to the project directory.

Confinement rules (every path argument, every call):

* the path is relative: absolute paths, drive letters and ``~`` are refused;
* no component is ``..``, and no component is hidden (``.git``, ``.env``: secrets live there);
* the path, resolved with every symlink followed, lies inside the resolved root; a symlink
  (file or directory) that leads out is refused, one that stays inside is allowed;
* walks (``list_files`` with depth, ``grep`` on a folder) never follow symlinked folders.

A refused or malformed call raises :class:`ToolError`: the worker reports it to the model
as an error result, it does not fail the subtask. So does every file-system error a tool
meets (a symlink loop, permission denied, a file that vanished between the walk and the
read): each tool raises :class:`ToolError` and nothing else, and ``grep`` skips a file it
cannot read (counting it) instead of failing the search. A file is opened once, without
blocking (a FIFO swapped in is refused, not waited on), and its size and kind are taken
from that open file. Hard links placed in the project are read like any file: only someone
who can write the project can make one. Outputs are capped in characters here and in
tokens by the worker. (The project is assumed not to be rewritten while a tool runs;
a symlink swapped between the check and the read is outside this threat model.)
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread

from mesh.template.prefix import DEFAULT_EXCLUDED_DIRS
from mesh.worker.types import NO_HOPS, Hops

__all__ = ["DelegateTool", "ProjectTools", "ToolError", "ToolFn", "delegate_tool"]

ToolFn = Callable[[Mapping[str, Any]], Awaitable[str]]
T = TypeVar("T")


class ToolError(Exception):
    """A call the tool refuses (bad arguments, a path outside the project...)."""


def _arg(args: Mapping[str, Any], name: str, kind: type[T], default: T | None = None) -> T:
    value = args.get(name, default)
    if value is None:
        raise ToolError(f"missing argument {name!r}")
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ToolError(f"argument {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _check_args(args: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(args) - allowed
    if unknown:
        raise ToolError(f"unknown arguments {sorted(unknown)}; allowed: {sorted(allowed)}")


#: What the file system raises under a tool: OSError (permission, vanished, ELOOP...),
#: RuntimeError (pathlib's "Symlink loop from ..." before Python 3.13).
_FS_ERRORS = (OSError, RuntimeError)


def _fs_error_text(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


_Method = Callable[["ProjectTools", Mapping[str, Any]], str]


def _tool(fn: _Method) -> _Method:
    """A tool method that raises only :class:`ToolError`: any file-system error left
    becomes one (the worker reports it to the model; the subtask goes on)."""

    @functools.wraps(fn)
    def call(self: ProjectTools, args: Mapping[str, Any]) -> str:
        try:
            return fn(self, args)
        except _FS_ERRORS as exc:
            raise ToolError(f"{fn.__name__} failed: {_fs_error_text(exc)}") from None

    return call


def _cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [output truncated: {len(text) - limit} more characters]"


class ProjectTools:
    """``list_files``, ``read_file`` and ``grep`` over one project root (see module doc)."""

    def __init__(self, root: Path | str, *, max_output_chars: int = 16_000,
                 max_file_bytes: int = 1_048_576) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"project root {self.root} is not a directory")
        self.max_output_chars = max_output_chars
        self.max_file_bytes = max_file_bytes

    # ------------------------------------------------------------------ confinement

    def resolve(self, path: str) -> Path:
        """The real path of ``path`` inside the root, or :class:`ToolError`."""
        if not isinstance(path, str):
            raise ToolError(f"path must be a string, got {path!r}")
        if "\x00" in path:
            raise ToolError("path contains a NUL byte")
        text = path.strip() or "."
        posix = text.replace("\\", "/")
        if posix.startswith(("/", "~")) or (len(posix) > 1 and posix[1] == ":"):
            raise ToolError(f"{path!r}: paths must be relative to the project root")
        parts = [p for p in posix.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ToolError(f"{path!r}: '..' is not allowed")
        if any(p.startswith(".") for p in parts):
            raise ToolError(f"{path!r}: hidden files and folders are not available")
        try:
            real = self.root.joinpath(*parts).resolve(strict=True)
        except FileNotFoundError:
            raise ToolError(f"{path!r}: no such file or folder") from None
        except (OSError, RuntimeError) as exc:
            raise ToolError(f"{path!r}: cannot resolve ({exc})") from None
        if not real.is_relative_to(self.root):
            raise ToolError(f"{path!r}: leads outside the project (symlink)")
        if not self._is_visible(real):
            raise ToolError(f"{path!r}: leads to a hidden file or folder (symlink)")
        return real

    def _is_visible(self, real: Path) -> bool:
        """``real`` (symlinks resolved) is inside the root and not hidden there."""
        return real.is_relative_to(self.root) and not any(
            p.startswith(".") for p in real.relative_to(self.root).parts)

    def _rel(self, real: Path) -> str:
        return real.relative_to(self.root).as_posix()

    def _walk(self, top: Path, max_depth: int) -> list[tuple[Path, bool]]:
        """Entries under ``top`` (sorted, depth-limited), symlinked dirs not entered."""
        out: list[tuple[Path, bool]] = []
        base_depth = len(top.parts)
        for here, dirnames, filenames in os.walk(top, followlinks=False):
            depth = len(Path(here).parts) - base_depth
            keep = sorted(d for d in dirnames
                          if not d.startswith(".") and d not in DEFAULT_EXCLUDED_DIRS)
            dirnames[:] = [d for d in keep if not os.path.islink(os.path.join(here, d))]
            if depth + 1 >= max_depth:
                dirnames[:] = []
            out.extend((Path(here, d), True) for d in keep)
            out.extend((Path(here, f), False) for f in sorted(filenames) if not f.startswith("."))
        return sorted(out)

    # ------------------------------------------------------------------ tools

    @_tool
    def list_files(self, args: Mapping[str, Any]) -> str:
        _check_args(args, {"path", "depth"})
        top = self.resolve(_arg(args, "path", str, "."))
        depth = _arg(args, "depth", int, 2)
        if not 1 <= depth <= 6:
            raise ToolError("depth must be between 1 and 6")
        if not top.is_dir():
            raise ToolError(f"{args.get('path')!r} is not a folder")
        lines: list[str] = []
        for entry, is_dir in self._walk(top, depth):
            suffix = "@" if entry.is_symlink() else "/" if is_dir else ""
            lines.append(self._rel(entry) + suffix)
        return _cap("\n".join(lines) or "(empty folder)", self.max_output_chars)

    @_tool
    def read_file(self, args: Mapping[str, Any]) -> str:
        _check_args(args, {"path", "start", "lines"})
        real = self.resolve(_arg(args, "path", str))
        start = _arg(args, "start", int, 1)
        count = _arg(args, "lines", int, 200)
        if start < 1 or not 1 <= count <= 2000:
            raise ToolError("start must be >= 1 and lines between 1 and 2000")
        text = self._text(real)
        lines = text.splitlines()
        chosen = lines[start - 1 : start - 1 + count]
        body = "\n".join(f"{start + i}\t{line}" for i, line in enumerate(chosen))
        end = start + len(chosen) - 1
        footer = f"({self._rel(real)}: lines {start}-{end} of {len(lines)})"
        return _cap(body, self.max_output_chars) + "\n" + footer

    @_tool
    def grep(self, args: Mapping[str, Any]) -> str:
        _check_args(args, {"text", "path", "ignore_case", "max_matches"})
        needle = _arg(args, "text", str)
        if not needle:
            raise ToolError("text must not be empty")
        top = self.resolve(_arg(args, "path", str, "."))
        ignore_case = _arg(args, "ignore_case", bool, False)
        max_matches = _arg(args, "max_matches", int, 50)
        if not 1 <= max_matches <= 500:
            raise ToolError("max_matches must be between 1 and 500")
        wanted = needle.lower() if ignore_case else needle
        files = [top] if top.is_file() else [p for p, d in self._walk(top, 64) if not d]
        matches: list[str] = []
        searched = unreadable = 0
        for path in files:
            try:
                real = path.resolve(strict=True)
            except _FS_ERRORS:  # a symlink loop or dangling link, or gone since the walk
                unreadable += 1
                continue
            # A symlinked file in the walk is followed only to a visible file in the root.
            if not self._is_visible(real) or not real.is_file():
                continue
            try:
                text = self._text(real)
            except ToolError:
                continue  # binary, too large, unreadable or vanished: not searched
            searched += 1
            for no, line in enumerate(text.splitlines(), 1):
                if wanted in (line.lower() if ignore_case else line):
                    shown = line if len(line) <= 300 else line[:300] + "..."
                    matches.append(f"{self._rel(path)}:{no}: {shown}")
                    if len(matches) >= max_matches:
                        break
            if len(matches) >= max_matches:
                break
        skipped = (f"; {unreadable} skipped: symlink loop, dangling or vanished"
                   if unreadable else "")
        summary = f"({len(matches)} matches in {searched} files searched{skipped})"
        return _cap("\n".join([*matches, summary]), self.max_output_chars)

    def _text(self, real: Path) -> str:
        """The UTF-8 text of ``real``, or :class:`ToolError` (never an OSError)."""
        rel = self._rel(real)
        try:
            # Checked before opening: a device node or FIFO is never opened at all.
            if not real.is_file():
                raise ToolError(f"{rel!r} is not a file")
            # O_NONBLOCK: a FIFO put here opens at once (then is refused) instead of
            # hanging the thread; size and kind come from the open file, not a second stat.
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:
            raise ToolError(f"{rel!r}: no such file (it vanished)") from None
        except OSError as exc:
            raise ToolError(f"{rel!r}: cannot open ({_fs_error_text(exc)})") from None
        try:
            with os.fdopen(fd, "rb") as fh:
                info = os.fstat(fh.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise ToolError(f"{rel!r} is not a file")
                if info.st_size > self.max_file_bytes:
                    raise ToolError(f"{rel!r} is too large ({info.st_size} bytes)")
                data = fh.read(self.max_file_bytes + 1)
        except OSError as exc:
            raise ToolError(f"{rel!r}: cannot read ({_fs_error_text(exc)})") from None
        if len(data) > self.max_file_bytes:  # grew since the fstat
            raise ToolError(f"{rel!r} is too large (over {self.max_file_bytes} bytes)")
        if b"\x00" in data[:8192]:
            raise ToolError(f"{rel!r} is a binary file")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{rel!r} is not UTF-8 text") from None

    def as_tools(self) -> dict[str, ToolFn]:
        """The three tools as async callables (file I/O runs in a worker thread)."""
        return {name: functools.partial(anyio.to_thread.run_sync, getattr(self, name))
                for name in ("list_files", "read_file", "grep")}


class DelegateTool:
    """The ``delegate`` tool over ``send(peer, text, hops) -> answer`` (injected by the
    coordinator), for the subtask whose :class:`~mesh.worker.types.Hops` it carries:
    :meth:`for_hops` binds them (:class:`~mesh.worker.dispatch.DispatchWorker` does, per
    subtask), so the hop count reaches the peer as an argument, never through hidden state.
    Unbound (no hops yet) it calls ``send(peer, text)``, so a two-argument ``send`` works.

    A peer that fails (any exception from ``send``) is reported to the model as a tool
    error; cancellation still propagates.
    """

    def __init__(self, send: Callable[..., Awaitable[str]], hops: Hops = NO_HOPS) -> None:
        self.send = send
        self.hops = hops

    def for_hops(self, hops: Hops) -> DelegateTool:
        return DelegateTool(self.send, hops)

    async def __call__(self, args: Mapping[str, Any]) -> str:
        _check_args(args, {"peer", "text"})
        peer = _arg(args, "peer", str)
        text = _arg(args, "text", str)
        if not peer.strip() or not text.strip():
            raise ToolError("peer and text must not be empty")
        try:
            if self.hops == NO_HOPS:
                return await self.send(peer, text)
            return await self.send(peer, text, self.hops)
        except ToolError:
            raise
        except Exception as exc:
            raise ToolError(f"peer {peer!r} failed: {type(exc).__name__}: {exc}") from exc


def delegate_tool(send: Callable[..., Awaitable[str]]) -> DelegateTool:
    """The ``delegate`` tool (:class:`DelegateTool`) over ``send``, with no hops yet."""
    return DelegateTool(send)
