"""The run directory: config.json, metrics.jsonl (a line per round), summary.json, accuracy.png."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import glob
import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("flowerbed")


def _clean(v: Any) -> Any:
    """JSON-safe values: NaN/inf become null, numpy scalars become Python numbers."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, str | bytes):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_atomic(path: Path, write: Callable[[BinaryIO], object], exclusive: bool = False) -> None:
    """``write`` to ``path`` so that a crash, a kill or a power loss mid-write leaves the
    previous file intact and a reader in another process finds the whole file or none: into a
    temporary file of its own (:func:`own_temporary`), flushed to disk, renamed. The temporary
    files of earlier writers of ``path`` on this host that were killed mid-write (each as large
    as the file) are removed. ``exclusive``: ``path`` is written only if it does not exist, else
    FileExistsError (of two writers at once, exactly one wins)."""
    tmp = own_temporary(path, ".tmp")
    try:  # (not mkstemp: its files are 0600, and a run's are read by other users and containers)
        with open(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:  # a hard link fails where the name exists; a rename would replace it
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    remove_dead_temporaries(path, ".tmp", Path.unlink)


def own_temporary(path: Path, suffix: str) -> Path:
    """A hidden name beside ``path`` for this host's and process's work in progress on it:
    ``.<name>.<host>.<pid>.<8 hex><suffix>`` (unique to the call)."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")


#: a temporary of a process gone from this host's view is removed once it is this old: containers
#: that share a host name (host networking) do not see each other's processes
STALE_AFTER_S = 3600.0


def remove_dead_temporaries(path: Path, suffix: str, remove: Callable[[Path], object]) -> None:
    """``remove`` each :func:`own_temporary` of ``path`` whose process on this host is gone (a
    kill mid-write) and that has not changed for :data:`STALE_AFTER_S`; another host's may be
    live, and are left."""
    from flowerbed.engine import _alive

    here = f".{path.name}.{socket.gethostname()}."
    for stale in path.parent.glob(f"{glob.escape(here)}*{glob.escape(suffix)}"):
        # (<pid>.tmp: flowerbed's former name; a host named <this host>.<more> does not match)
        m = re.fullmatch(r"(\d{1,9})(\.[0-9a-f]{8})?" + re.escape(suffix), stale.name[len(here):])
        with contextlib.suppress(OSError):
            if m and not _alive(int(m[1])) and time.time() - stale.stat().st_mtime > STALE_AFTER_S:
                remove(stale)


def _link_new(tmp: Path, path: Path) -> None:
    """``tmp`` renamed to ``path`` unless ``path`` exists (FileExistsError): by a hard link, or,
    on a file system without them (some network and FUSE mounts), by a check and a rename under
    a lock beside it."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise  # (a full disk, an I/O error: not a file system without links)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # (released with the file, also by a kill)
            except OSError as e:
                log.warning("%s: neither hard links nor locks here (%s); two writers at the same "
                            "instant could both write it", path, e)
            if path.exists():
                raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
            os.replace(tmp, path)
    else:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`write_atomic` of a text (summary.json's mere presence says "finished", so an empty
    one after a power loss would stop a resume)."""
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that a crash mid-write leaves the previous file intact."""
    write_text_atomic(path, json.dumps(_clean(data), indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object; {} where it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunDir:
    """Owns ``<output-dir>/<run-name>/``; every write is immediate, nothing is only printed."""

    def __init__(self, output_dir: str, run_name: str, config: dict[str, Any],
                 resume_round: int | None = None) -> None:
        """A new run directory, or (``resume_round``) an existing one continued after that round.

        A new run never overwrites a directory that already holds a run's metrics. A resumed
        one keeps its rows up to ``resume_round``; the rows after it (written after the last
        checkpoint, so they will be recomputed) are kept in ``metrics.before-resume-<n>.jsonl``.
        """
        self.path = Path(output_dir).expanduser().resolve() / run_name
        self.metrics_path = self.path / "metrics.jsonl"
        self.config = config  # what config.json holds (run id and resumes added): its plot says what ran
        self.rows: list[dict[str, Any]] = []
        self._writer = contextlib.ExitStack()  # this ServerApp's, until close()
        if resume_round is None:
            refuse_existing(self.path)
            make_folder(self.path)
        try:
            self._writer.enter_context(held(self.path / WRITER_LOCK, writer_refusal(self.path)))
            self._open(config, resume_round)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Lets another ServerApp write this run (a resume); the process's end does it too."""
        self._writer.close()

    def _open(self, config: dict[str, Any], resume_round: int | None) -> None:
        """The metrics (emptied, or cut back to ``resume_round``) and config.json."""
        if resume_round is None:
            self.metrics_path.write_text("")
            self.run_id: str | None = uuid.uuid4().hex[:10]  # this run's, wherever it is moved
        else:
            self.rows = self._keep_rows(resume_round)
            if (self.path / "summary.json").exists():  # extended: only a new summary says "done"
                os.replace(self.path / "summary.json", self._before_resume("summary.json"))
            earlier = read_json(self.path / "config.json")
            self.run_id = earlier.get("run-id")  # None for runs made before run ids
            config = {**config, "resumed-after-rounds": [
                *earlier.get("resumed-after-rounds", []), resume_round]}
        if self.run_id:
            config = {**config, "run-id": self.run_id}
        self.config = config
        write_json_atomic(self.path / "config.json", config)
        # a resumed run's wall time includes the rounds it keeps (their "seconds")
        self.started = time.time() - sum(r.get("seconds") or 0 for r in self.rows)

    def update_config(self, changes: dict[str, Any]) -> None:
        """config.json with ``changes``: what the run learns after its start (the data of a
        node that joined late)."""
        self.config = {**self.config, **changes}
        write_json_atomic(self.path / "config.json", self.config)

    def _keep_rows(self, resume_round: int) -> list[dict[str, Any]]:
        text = self.metrics_path.read_text() if self.metrics_path.exists() else ""
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the crash
                break
        kept = [r for r in rows if r.get("round", 0) <= resume_round]
        if len(kept) != len(text.splitlines()):
            self._before_resume("metrics.jsonl").write_text(text)
        write_text_atomic(self.metrics_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        return kept

    def _before_resume(self, name: str) -> Path:
        """The next free ``<stem>.before-resume-<n><suffix>`` beside ``name`` in this run."""
        stem, suffix = Path(name).stem, Path(name).suffix
        n = len(list(self.path.glob(f"{stem}.before-resume-*{suffix}"))) + 1
        return self.path / f"{stem}.before-resume-{n}{suffix}"

    def log_round(self, row: dict[str, Any]) -> None:
        """Append one round's metrics and print the one-line progress report."""
        row = _clean(row)
        self.rows.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())  # on disk before the round's checkpoint, which is fsynced
        log.info(progress_line(row))

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        summary = dict(summary)
        summary["wall-seconds"] = round(time.time() - self.started, 2)
        summary["run-dir"] = str(self.path)
        write_json_atomic(self.path / "summary.json", summary)
        try:
            if any(r.get("pre-accuracy") is not None for r in self.rows):  # a stream: Fed-ADE
                online, pre = time_step_curves(self.rows)
                plot_curves({"online accuracy": online, "predict-then-update": pre},
                            self.path / "accuracy.png", title=run_title(self.path.name, self.config),
                            xlabel="time step", ylabel="accuracy (all clients' batches)")
            else:
                plot_curves({self.path.name: self.rows}, self.path / "accuracy.png",
                            title=run_title(self.path.name, self.config),
                            ylabel=measure(self.config.get("method")))
        except Exception as e:  # noqa: BLE001 - a plot must never lose a finished run
            log.warning("could not plot accuracy: %s", e)
        return summary


def new_folder(parent: Path, stem: str) -> Path:
    """A new, empty folder ``<parent>/<stem>-<time>`` (``-2``, ``-3``... appended where that is
    taken), created here, so two runs started in the same second never share one."""
    parent = Path(parent).expanduser()
    make_folder(parent)
    base, n = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}", 1
    while not make_folder(path := parent / (base if n == 1 else f"{base}-{n}")):
        n += 1
    return path


def make_folder(path: Path, key: str = "output-dir") -> bool:
    """``path`` made with its parents; False where it was there already. Where the file system
    refuses (a file in the way, a path the kernel keeps such as /proc, a full disk) a
    ConfigError naming ``key``, not a bare errno."""
    try:
        Path(path).mkdir(parents=True)
        return True
    except FileExistsError:
        if Path(path).is_dir():
            return False
        reason = "a link to nothing is in the way" if Path(path).is_symlink() else "a file is in the way"
    except OSError as e:
        reason = e.strerror or str(e)
    from flowerbed.config import ConfigError

    raise ConfigError(key, str(path), f"no folder can be made there ({reason})")


def writable_folder(key: str, path: str | Path) -> Path:
    """``path`` where a folder can be (or is) written, made nowhere yet; a ConfigError naming
    ``key`` when it, or the nearest part of it that exists, is a file or read-only."""
    from flowerbed.config import ConfigError

    p = Path(path).expanduser().absolute()
    first = next(a for a in (p, *p.parents) if a.exists() or a == a.parent)
    if not first.is_dir():
        raise ConfigError(key, str(path), f"{first} is a file, not a folder")
    if not os.access(first, os.W_OK | os.X_OK):
        raise ConfigError(key, str(path), f"{first} is a folder this user cannot write to")
    return p


@contextlib.contextmanager
def held(path: Path, refusal: Exception) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (a folder, or a file made if missing) for the block's
    life, released by the kernel when the process ends, however it ends; ``refusal`` is raised
    while another process holds it. A file system without locks (some network ones) warns and
    runs unguarded."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY if Path(path).is_dir() else os.O_RDWR | os.O_CREAT,
                 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise refusal from None
    except OSError as e:
        log.warning("cannot lock %s (%s): two processes using it at once would not be refused",
                    path, e.strerror or e)
    try:
        yield
    finally:
        os.close(fd)


def folder_in_use(key: str, folder: Path) -> contextlib.AbstractContextManager[None]:
    """Marks the existing ``folder`` as written by this launcher for the block's life, so that a
    second launcher writing the same run or comparison there at the same time is refused with
    a ConfigError naming ``key``, instead of both writing one metrics.jsonl."""
    from flowerbed.config import ConfigError

    return held(folder, ConfigError(key, str(folder), "another flowerbed process is writing there "
                                    f"now; wait for it to end, or choose another {key}"))


#: held by the ServerApp writing a run, in its folder (the launcher holds the folder itself)
WRITER_LOCK = ".writer.lock"


def writer_refusal(run_dir: Path) -> Exception:
    """What a second writer of the run in ``run_dir`` is told."""
    from flowerbed.config import ConfigError

    return ConfigError("run-name", str(run_dir), "a ServerApp is still writing this run (one whose "
                       "launcher was killed goes on until it ends); wait for it, or stop it "
                       "(`flwr stop <run-id>` on its SuperLink, or end that SuperLink's processes: "
                       "`pgrep -af flower-superlink`)")


def refuse_live_writer(run_dir: Path) -> None:
    """:func:`writer_refusal` while a ServerApp writes the run in ``run_dir``, before a
    launcher starts another on it."""
    if (run_dir / WRITER_LOCK).exists():
        with held(run_dir / WRITER_LOCK, writer_refusal(run_dir)):
            pass


@functools.cache
def code_digest() -> str:
    """flowerbed's own code, as a short digest of its .py files (where and how it was installed
    aside: a Flower app bundle's copy gives the checkout's digest)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def software() -> dict[str, str]:
    """What a run's figures depend on besides its config: flowerbed's code (:func:`code_digest`),
    the versions of torch, flwr and Python, and the environment they come from: the
    site-packages torch was loaded from (Flower puts a per-run environment's first on
    ``sys.path``; ``sys.prefix`` stays the interpreter's)."""
    import platform

    import flwr
    import torch

    return {"flowerbed": code_digest(), "torch": torch.__version__, "flwr": flwr.__version__,
            "python": platform.python_version(),
            "environment": str(Path(torch.__file__).resolve().parents[1])}


def software_differences(configs: dict[str, dict[str, Any]]) -> list[str]:
    """The line under a table naming the code and software of each run (``configs``: config.json
    by row label) where they differ, e.g. runs resumed after a code change or from two machines."""
    def of(sw: dict[str, Any]) -> str:
        code = f", flowerbed code {sw['flowerbed']}" if sw.get("flowerbed") else ""
        return f"torch {sw.get('torch')}, flwr {sw.get('flwr')}{code}"

    software = {label: of(sw) for label, c in configs.items() if isinstance(sw := c.get("software"), dict)}
    if len(set(software.values())) < 2:
        return []
    return ["", "The runs ran on different code or software: "
            + "; ".join(f"{k}: {v}" for k, v in software.items()) + "."]


def refuse_existing(run_dir: Path) -> None:
    """A new run never goes into a directory that holds a run's metrics, nor into one that
    holds files no run wrote (a data set's folder, reached through a link or a run-name that
    names it): a ConfigError either way."""
    from flowerbed.config import ConfigError

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    try:
        if metrics.exists() and metrics.stat().st_size > 0:
            raise ConfigError("run-name", run_dir.name, f"{run_dir} already holds a run; continue "
                              f"it with `flowerbed run --resume {run_dir}` (plain flwr: "
                              "resume='<that folder>') or choose another run-name")
        others = []
        if run_dir.is_dir() and not (run_dir / "config.json").exists():  # config.json: a run's folder
            # hidden files (our locks and temporary files, the system's .DS_Store, .nfs...) and an
            # empty metrics.jsonl (a run stopped before its config was written) are no strangers
            others = sorted(p.name for p in run_dir.iterdir() if p != metrics
                            and not (p.name.startswith(".") and p.is_file()))
    except OSError as e:
        raise ConfigError("run-name", run_dir.name, f"{run_dir} cannot be read ({e.strerror})") from None
    if others:
        raise ConfigError("run-name", run_dir.name, f"{run_dir} holds files that are not a "
                          f"run's ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
                          "a new run writes into a new or empty folder: choose another "
                          "run-name or output-dir")


def pct(v: float | None) -> str:
    """A fraction as a table cell: a percentage with two decimals, "-" when missing."""
    return "-" if v is None else f"{100 * v:.2f}"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def size(n: float | None) -> str:
    """Bytes as a short figure: kB below a megabyte (FedCC's probabilities showed as 0.0 MB)."""
    n = n or 0
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def progress_line(row: dict[str, Any]) -> str:
    def f(key: str, fmt: str) -> str:
        v = row.get(key)
        return "-" if v is None else format(v, fmt)

    if row["round"] == 0:
        if row.get("accuracy") is None:  # personalised, ensemble and stream methods
            return f"[round 0/{row.get('rounds', '?')}] initial model: not scored on the server"
        return (f"[round 0/{row.get('rounds', '?')}] initial model: acc {f('accuracy', '.4f')} "
                f"loss {f('loss', '.4f')}")
    t = time_step(row)
    stream = "" if t is None else (  # Fed-ADE: its step, rate and risk (Fed-POE: its weights)
        f" | step {t} lr {f('lr', '.2e')} risk {f('risk', '.4f')}"
        f"{'' if row.get('fed-weight') is None else ' fed-w ' + f('fed-weight', '.3f')}"
        f"{'' if row.get('pool-weight') is None else ' pool-w ' + f('pool-weight', '.3f')}"
        f"{'' if row.get('pre-accuracy') is None else ' pre-acc ' + f('pre-accuracy', '.4f')}")
    terms = " ".join(f"{k.removeprefix('fedx-loss-')} {v:.4f}" for k, v in row.items()
                     if k.startswith("fedx-loss-") and v is not None)  # FedX: its loss, term by term
    return (f"[round {row['round']}/{row.get('rounds', '?')}] "
            f"acc {f('accuracy', '.4f')} loss {f('loss', '.4f')} | "
            f"train-loss {f('train-loss', '.4f')}{f' ({terms})' if terms else ''} "
            f"client-acc {f('client-accuracy', '.4f')}{stream} | "
            f"clients ok {row.get('clients-ok', 0)}/{row.get('clients-sampled', 0)} | "
            f"up {size(row.get('bytes-up', 0))} down {size(row.get('bytes-down', 0))}"
            f" | {f('seconds', '.1f')} s")


def time_step_curves(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A stream's rows (Fed-ADE) by time step, 1-based, from each row's ``time-step``: the
    online accuracy (a step's last round) and the predict-then-update accuracy of the same step
    (its first round), as rows for :func:`plot_curves`."""
    at = [(step, r) for r in rows if (step := time_step(r)) is not None]
    return ([{"round": t + 1, "accuracy": r["accuracy"]} for t, r in at
             if r.get("accuracy") is not None],
            [{"round": t + 1, "accuracy": r["pre-accuracy"]} for t, r in at
             if r.get("pre-accuracy") is not None])


def time_step(row: dict[str, Any]) -> int | None:
    """A stream's row's time step (0-based): from its training metrics, or from its evaluation's
    where training was skipped; None outside a stream."""
    t = row.get("time-step", row.get("client-time-step"))
    return None if t is None else round(t)


def min_span(lo: float, hi: float, span: float) -> tuple[float, float]:
    """The y-range (lo, hi) widened about its middle to at least ``span``."""
    if hi - lo >= span:
        return lo, hi
    mid = (lo + hi) / 2
    return mid - span / 2, mid + span / 2


def run_title(name: str, config: dict[str, Any]) -> str:
    """A run's plot title: its folder, and what ran (method, data, split, clients, seed)."""
    from flowerbed.config import STREAM_METHODS

    c = config
    stream = (f", {c.get('fedade-shift')} shift, {c.get('fedade-schedule')} schedule"
              if c.get("method") in STREAM_METHODS else "")
    return (f"{name}: {c.get('method')} on {c.get('dataset')}, {c.get('partition')}, "
            f"{c.get('num-partitions')} clients, seed {c.get('seed')}{stream}")


GLOBAL_MEASURE = "accuracy (test set)"  # the global model's: every method not in own_measures()


def own_measures() -> tuple[tuple[tuple[str, ...], str], ...]:
    """(methods, what their ``accuracy`` is) for the methods that measure their own way."""
    from flowerbed.config import DISTILL_METHODS, PERSONAL_METHODS, SSL_METHODS, STREAM_METHODS

    return ((SSL_METHODS, "linear-probe accuracy (test set)"),
            (DISTILL_METHODS, "ensemble accuracy (test set)"),
            (PERSONAL_METHODS, "personalised accuracy (local test splits)"),
            (STREAM_METHODS, "online accuracy (the clients' stream batches)"))


def measure(method: Any) -> str:
    """What a run's ``accuracy`` is, by its method (the y-axis of its plot, the ``acc`` of its
    progress lines, a table's ``final acc``)."""
    return next((what for methods, what in own_measures() if method in methods), GLOBAL_MEASURE)


def plot_curves(curves: dict[str, list[dict[str, Any]]], out: Path, title: str = "",
                key: str = "accuracy", xlabel: str = "round", ylabel: str | None = None,
                note: str = "") -> Path:
    """One line per run of ``key`` (accuracy by default: each run's own measure) against the rows' ``round``
    (which a caller may fill with another index, e.g. Fed-ADE's time step, named by ``xlabel``);
    ``note`` goes under the axes (e.g. the runs that failed and are not drawn); rows with a
    ``<key>-std`` (a mean over seeds) get a band of ± one std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, rows) in enumerate(curves.items()):
        pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        if pts:  # a line style each as well as a colour: curves that coincide stay visible
            line, = ax.plot(*zip(*pts, strict=True), marker="os^vD"[i % 5], markersize=3,
                            linestyle=("-", "--", ":", "-.")[i % 4], label=name)
            band = [(r["round"], r[key] - r[f"{key}-std"], r[key] + r[f"{key}-std"])
                    for r in rows if r.get(key) is not None and r.get(f"{key}-std") is not None]
            if band:  # a mean over seeds: ± one std
                ax.fill_between(*zip(*band, strict=True), color=line.get_color(), alpha=0.15)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds, not 1.2, 1.4, ...
    # "accuracy", not "test accuracy": personalised methods plot their clients' local test splits
    ax.set_ylabel(ylabel or key)
    if ax.lines:  # a span of at least 5 points: 0.733 to 0.740 filled the whole plot
        ax.set_ylim(*min_span(*ax.get_ylim(), 0.05))
    ax.set_title("\n".join(textwrap.wrap(title, 70, break_on_hyphens=False)), fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="firebrick")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
