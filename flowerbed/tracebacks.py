"""A run's console shows each traceback as one line; its log keeps the full text.

A client that raises under the simulation engine prints two tracebacks of about 35 lines each
(Ray's, then Flower's worker's), and a ServerApp that stops prints a third. On the console they
bury the round's progress. ``Folder`` replaces each run of them with one line: the first
exception (the cause, where exceptions are chained), the deepest frame in flowerbed's own code
(else the deepest frame), how many lines were folded, and the log file holding them.
"""

from __future__ import annotations

import re
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # flwr's and Ray's colour codes
# where a traceback starts: Python's header, and the Ray backend's line before each failed
# message's tracebacks (Ray's, then Flower's worker's: one block)
TRACEBACK = "Traceback (most recent call last):"
FAILED_MESSAGE = "An exception was raised when processing a message"
STARTS = (TRACEBACK, FAILED_MESSAGE)
_RECORD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")  # a new log record
_EXCEPTION = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)+|[A-Z]\w*(?:Error|Exception|Interrupt|Exit))(?:: ?(.*))?$")
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+), in (\S+)')
MAX_MESSAGE = 200


def short_path(path: str) -> str:
    """flowerbed's files from the package (the SuperLink runs an installed copy of the app:
    ``.flwr-home/.../apps/flowerbed.flowerbed.0.1.0.<hash>/flowerbed/...``), installed
    packages' from site-packages, others in full."""
    for marker in ("/flowerbed/", "/site-packages/"):
        if marker in path:
            at = path.rindex(marker)
            return path[at + 1:] if marker == "/flowerbed/" else path[at + len(marker):]
    return path


def summary(lines: list[str]) -> str:
    """``<exception>: <message> (at <file>:<line> in <function>)`` for a traceback's lines."""
    exc, at = None, None
    frames: list[tuple[str, str, str]] = []
    for i, line in enumerate(lines):
        if m := _FRAME.match(line):
            frames.append(m.groups())
        elif (m := _EXCEPTION.match(line)) and frames:
            message = (m.group(2) or "").strip()
            if not message and i + 1 < len(lines):  # flwr's ClientAppException: the text follows
                message = lines[i + 1].strip()
            exc = f"{m.group(1)}: {message}" if message else m.group(1)
            ours = [f for f in frames if "/flowerbed/" in f[0]]
            path, lineno, func = (ours or frames)[-1]
            at = f"{short_path(path)}:{lineno} in {func}"
            break
    if exc is None:
        return "a traceback"
    if len(exc) > MAX_MESSAGE:
        exc = exc[:MAX_MESSAGE - 1] + "…"
    return f"{exc} (at {at})"


class Folder:
    """Feed it a run's output lines; it returns the lines to show, with each traceback (or run
    of tracebacks with nothing else between them) as one line naming ``log_file``."""

    def __init__(self, log_file: Path):
        self.log_file = log_file
        self.block: list[str] | None = None
        self.prefix = ""

    def feed(self, line: str) -> list[str]:
        text = ANSI.sub("", line)
        shown: list[str] = []
        if self.block is not None:
            record = _RECORD.match(text)
            if not record or (FAILED_MESSAGE not in text and any(s in text for s in (TRACEBACK, "ray::"))):
                self.block.append(text.rstrip("\n"))
                return []
            shown = self.flush()
        if start := next((s for s in STARTS if s in text), None):
            self.block = [text.rstrip("\n")]
            at = line.find(start)
            self.prefix = line[:at] if at > 0 and _RECORD.match(text) else "  "
            return shown
        return [*shown, line]

    def flush(self) -> list[str]:
        """The folded line of a traceback still open (at the end of the output), if any."""
        if self.block is None:
            return []
        lines, self.block = self.block, None
        who = "a ClientApp raised " if FAILED_MESSAGE in lines[0] else ""
        return [f"{self.prefix}[{who}{summary(lines)}; its traceback ({len(lines)} lines) is in "
                f"{self.log_file}]\n"]
