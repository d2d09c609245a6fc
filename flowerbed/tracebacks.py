"""A run's console shows each failure's tracebacks as one line; its log keeps the full text.

A client that raises under the simulation engine makes Ray and Flower print about 70 lines
(Ray's chain, then Flower's worker's traceback of the same failure), and a ServerApp that stops
prints its own. On the console they bury the round's progress. :class:`Folder` replaces each
run of traceback lines with one line per failure: the exception that says most (the last in its
chain that is not Flower's ``ClientAppException`` wrapper), the deepest frame in flowerbed's own
code (else the deepest), and the log file with the whole text. Only lines shaped like a
traceback are folded: anything else ends the fold and is shown, and a fold that names no
exception is shown as it came.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # flwr's and Ray's colour codes
TRACEBACK = "Traceback (most recent call last):"
FAILED_MESSAGE = "An exception was raised when processing a message"  # Flower's Ray backend
RAY_CHAIN = "ray::"  # Ray's header of a failed actor call's traceback
STARTS = (TRACEBACK, FAILED_MESSAGE, RAY_CHAIN)
WRAPPER_TEXT = "Exception ClientAppException occurred"  # Flower's wrapper's text: the original's message
CLIENTAPP_TEXT = "ClientAppException occurred. Message: "  # Flower's wrapper's text, then the original's
# lines inside a traceback that are not indented and not an exception's message: the headers of
# its parts (and an exception group's margins); INSIDE adds Flower's wrapper's text
_NOT_MESSAGE = (TRACEBACK, "The above exception", "During handling", RAY_CHAIN, "+", "|")
INSIDE = (*_NOT_MESSAGE, WRAPPER_TEXT)
_RECORD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")  # a log record's first line
_EXCEPTION = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*(?:\([\w.]+\))?)(?::\s?(.*))?$")  # Ray: Error(Cause)
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)(?:, in (\S+))?')
_ACTOR = re.compile(r"^\(\w+ pid=\d+")  # Ray's prefix of an actor's output line
_SEPARATOR = re.compile(r"^\s*[|]?\s*\+[-+]")  # "  +-+---- 1 ----", "    +---- 2 ----"
_GROUP = re.compile(r"^\s*[|+](?:-+[+-]*)?\s?")  # an exception group's margin
MAX_MESSAGE = 200


def _ungroup(line: str) -> str:
    """A line without an exception group's margin; a group's separator line as a blank one."""
    return "" if _SEPARATOR.match(line) else _GROUP.sub("", line)


def short_path(path: str) -> str:
    """Installed packages' files from site-packages; flowerbed's from the package (the
    SuperLink runs an installed copy of the app: ``.../apps/flowerbed.flowerbed.0.1.0.<hash>/
    flowerbed/...``); others in full."""
    if "/site-packages/" in path:
        return path[path.rindex("/site-packages/") + len("/site-packages/"):]
    return path[path.rindex("/flowerbed/") + 1:] if "/flowerbed/" in path else path


def ours(path: str) -> bool:
    """A frame in flowerbed's code (not a package installed in a venv inside a flowerbed clone)."""
    return "/flowerbed/" in path and ("/site-packages/" not in path or "/site-packages/flowerbed/" in path)


def failures(lines: list[str], pending: Counter[str]) -> list[tuple[str, bool, int]] | None:
    """Each failure in a traceback block's (colourless) lines, in order: (its summary
    ``<exception>: <message> (at <file>:<line> in <function>)``, whether a ClientApp raised it,
    how many times); None where no exception could be read. The block is split into log
    records: after Ray's record of a failed ClientApp (``ray::...`` and its chain) Flower's
    worker logs the same failure again (its own traceback, then Ray's chain once more), perhaps
    in a later block: ``pending`` counts those still to come by text, and they are not counted
    again."""
    records: list[list[str]] = []
    for line in lines:
        if _RECORD.match(line) or not records:
            records.append([])
        records[-1].append(_ungroup(line))
    found: dict[str, list] = {}  # a failure's message text -> [summary, client, count]
    read = False
    for record in records:
        chain = _chain(record)
        if not chain:
            continue
        read = True
        kind, text, frames = says_most(chain)
        key = original_text(text) if wrapper(kind) else text
        ray = RAY_CHAIN in record[0]
        if not ray and pending[key] > 0:  # Flower's worker's record of a failure Ray's named
            pending[key] -= 1
            continue
        pending[key] += ray
        if wrapper(kind):  # nothing but Flower's wrapper: its text is the original's
            kind, text, frames = "", key, []  # (and its frames are Flower's)
        summary = f"{kind}: {text}" if kind and text else kind or text
        if len(summary) > MAX_MESSAGE:
            summary = summary[:MAX_MESSAGE - 1] + "…"
        if frames:
            path, lineno, func = ([f for f in frames if ours(f[0])] or frames)[-1]
            summary += f" (at {short_path(path)}:{lineno}{f' in {func}' if func else ''})"
        client = ray or any(FAILED_MESSAGE in ln for ln in record) or any(wrapper(c[0]) for c in chain)
        if key in found:
            found[key][2] += 1
        else:
            found[key] = [summary, client, 1]
    return [tuple(v) for v in found.values()] if read else None


def wrapper(kind: str) -> bool:
    """Flower's ClientAppException (or Ray's RayTaskError(ClientAppException)), whose text
    ends in the original exception's."""
    return "ClientAppException" in kind


def original_text(text: str) -> str:
    """The original exception's text inside Flower's wrapper's (all of it where there is none)."""
    return text.partition(CLIENTAPP_TEXT)[2] or text


def says_most(chain: list[tuple]) -> tuple:
    """The exception of a chain that says most: the last that is not Flower's wrapper."""
    return next((c for c in reversed(chain) if not wrapper(c[0])), chain[-1])


def _chain(record: list[str]) -> list[tuple[str, str, list[tuple[str, str, str | None]]]]:
    """A record's exceptions in the order printed (the cause first), each with its frames and
    its whole text (the lines of a multi-line message joined by " | ")."""
    chain, frames, after_code = [], [], False
    for i, line in enumerate(record):
        if m := _FRAME.match(line):
            frames.append(m.groups())
            after_code = True
        elif after_code and not line[:1].isspace() and (m := _EXCEPTION.match(line)):
            parts = [(m.group(2) or "").strip()]
            for more in record[i + 1:]:  # the message's further lines (ClientAppException's text)
                if (not more.strip() or _FRAME.match(more) or more.startswith(_NOT_MESSAGE)
                        or _ACTOR.match(more)):
                    break
                parts.append(more.strip())
            chain.append((m.group(1), " | ".join(p for p in parts if p), frames))
            frames, after_code = [], False
        elif not line.strip() or not line[:1].isspace():
            after_code = False
    return chain


def exception_of(text: str) -> tuple[str, str] | None:
    """(type, message) of the exception that says most in a traceback's text (the last of its
    chain that is not Flower's wrapper), or None where it names none."""
    chain = _chain([_ungroup(line) for line in text.splitlines()])
    if not chain:
        return None
    kind, message, _ = says_most(chain)
    return kind, message


class Folder:
    """Feed it a run's output lines; it returns the lines to show: each traceback block as one
    line per failure naming ``log_file``, everything else as it came."""

    def __init__(self, log_file: Path):
        self.log_file = log_file
        self.block: list[str] | None = None  # colourless
        self.raw: list[str] = []  # as they came, for a block that names no failure
        self.prefix = ""
        self.pending: Counter[str] = Counter()  # failures whose worker's record is still to come
        self.in_message = False  # just after an exception's line: its message may go on
        self.maybe: list[tuple[str, str]] = []  # lines held (colourless, as they came): see _verdict

    def feed(self, line: str) -> list[str]:
        text = ANSI.sub("", line).rstrip("\n")
        shown: list[str] = []
        if self.block is not None:
            verdict = self._verdict(text)
            if verdict == "keep":  # (with the lines held before it)
                self._take_held()
                self.block.append(text)
                self.raw.append(line)
                return []
            if verdict == "hold":
                self.maybe.append((text, line))
                return []
            shown = self.flush()
        starts = next((s for s in STARTS if s in text), None)
        if starts and (_RECORD.match(text) or text.startswith(TRACEBACK)):
            self.block, self.raw, self.in_message = [text], [line], False
            at = line.find(starts)
            self.prefix = line[:at] if _RECORD.match(text) and at > 0 else "  "
            return shown
        return [*shown, line]

    def _verdict(self, text: str) -> str:
        """What a line does to the open block: "keep" (it belongs to it), "hold" (it may be an
        exception's further message lines: kept if the traceback goes on after them, else shown
        as they came) or "end"."""
        if _RECORD.match(text):  # another part of the failure, unless lines are held that are
            self.in_message = False  # not the repeat of a message the block holds
            return "keep" if any(s in text for s in STARTS) and (not self.maybe or self._repeats()) else "end"
        if _ACTOR.match(text):  # a Ray actor's own output: never part of a traceback
            return "end"
        if self.maybe:
            if self.maybe[-1][0].strip():
                return "hold"
            if text.startswith(INSIDE) and not text.startswith((TRACEBACK, RAY_CHAIN)):
                self.in_message = False  # "<message>\n\nThe above exception ...": the chain goes on
                return "keep"
            return "hold" if not text.strip() else "end"
        if not text.strip():
            self.in_message = False
            return "keep"
        if text[:1].isspace() or text.startswith(INSIDE):
            self.in_message = self.in_message and not _FRAME.match(text)  # (a frame: a new traceback)
            return "keep"
        if self.in_message:
            return "hold"
        self.in_message = bool(_EXCEPTION.match(text)) and self._after_code()
        return "keep" if self.in_message else "end"

    def _take_held(self) -> None:
        """The lines held belong to the block."""
        self.block += [t for t, _ in self.maybe]
        self.raw += [line for _, line in self.maybe]
        self.maybe = []

    def _repeats(self) -> bool:
        """Whether the held lines follow Flower's wrapper's text and repeat lines of the block:
        the rest of a multi-line message the original exception's traceback showed."""
        return bool(self.block) and self.block[-1].startswith(WRAPPER_TEXT) and all(
            t in self.block for t, _ in self.maybe if t.strip())

    def _after_code(self) -> bool:
        last = self.block[-1] if self.block else ""
        return last[:1].isspace() and bool(last.strip())  # a frame, its code or its carets

    def flush(self) -> list[str]:
        """The lines for the block still open (at the end of the output, or when stopped)."""
        if self.block is None:
            return []
        if self._repeats():  # (the end of Flower's wrapper's text)
            self._take_held()
        block, raw, self.block, self.raw = self.block, self.raw, None, []
        held, self.maybe = [line for _, line in self.maybe], []
        found = failures(block, self.pending)
        if found is None:  # nothing read: shown as it came
            return raw + held
        return [f"{self.prefix}[{_who(client, n)}{summary}; the traceback is in {self.log_file}]\n"
                for summary, client, n in found] + held


def _who(client: bool, n: int) -> str:
    """How a folded line opens: who raised, how many times."""
    if client:
        return "a ClientApp raised " if n == 1 else f"{n} ClientApps raised "
    return "" if n == 1 else f"{n}x "
