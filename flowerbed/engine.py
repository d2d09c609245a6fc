"""Run the Flower App through the real engines: a SuperLink we start, then ``flwr run``.

``flwr run`` against Flower's managed ``:local:`` SuperLink re-installs the app's dependencies
into a fresh venv for every run (flower-guide §6.4). We start our own simulation SuperLink with
``--disable-runtime-dependency-installation`` instead, so runs use this venv, and we stop it (by
process group) when done.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowerbed.tracebacks import ANSI, Folder

log = logging.getLogger("flowerbed")

PROJECT = Path(__file__).resolve().parents[1]
CONNECTION = "flowerbed-sim"


class EngineError(RuntimeError):
    """A SuperLink could not be started or stopped; the message says why."""


class RunFailed(EngineError):
    """A ``flwr run`` ended without writing its summary."""


class SuperLinkTimeout(EngineError, TimeoutError):
    """A SuperLink did not open its port in time."""


def _bin(name: str) -> str:
    """An executable of this venv (flwr, flower-superlink) even when PATH lacks the venv."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"'{name}' not found next to {sys.executable} or on PATH")
    return found


def _ephemeral_range(default: tuple[int, int] = (32768, 60999)) -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections (read on Linux; elsewhere Linux's
    default, which starts below the 49152 of macOS and Windows)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return default


def _port_choices() -> tuple[int, int]:
    """[start, stop) to pick a port from outside the ephemeral range: below it from 10000, or,
    where that range starts low (a widened one, e.g. 1024-65535), above it; else 10000-60000."""
    low, high = _ephemeral_range()
    if low - 10000 >= 1000:
        return 10000, low
    if 65536 - (high + 1) >= 1000:
        return high + 1, 65536
    return 10000, 60000  # no room outside it: the bind check below is all there is


_HANDED_OUT: set[int] = set()  # this process's picks: a port not yet bound by its server is not free
PICKED = Path(tempfile.gettempdir()) / f"flowerbed-ports-{os.getuid()}"  # <port>: its picker's pid file


def _claim(port: int) -> bool:
    """Whether ``port`` is ours to hand out: no other running process of this user picked it
    (two launchers, or two test workers, could pick the same port before either's server binds
    it). Claims of processes no longer running are dropped; where the folder cannot be used, the
    bind check is all there is."""
    try:
        PICKED.mkdir(mode=0o700, exist_ok=True)
        with open(PICKED / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (released with the file)
            for f in PICKED.glob("[0-9]*"):
                if (picker := _read_pid(f)) is not None and not _alive(*picker):
                    f.unlink(missing_ok=True)
            os.close(os.open(PICKED / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            _write_pid(PICKED / str(port), os.getpid())
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def free_port() -> int:
    """A TCP port nothing listens on, outside the kernel's ephemeral range, and not one this
    process or another running one (:func:`_claim`) handed out before (a SuperNode started just
    now may not listen yet). A port the kernel hands
    out (a bind to port 0) is free again once we close our probe, and until the SuperLink or
    SuperNode we start binds it, any outgoing connection may take it as its local port: a
    SuperNode's connection to its SuperLink did, and the next SuperNode died with 'address already
    in use' (the deployment tests, 2026-12-06). Ports below that range are only ever taken by a
    bind, so a random one that binds now stays free."""
    rng, (start, stop) = random.SystemRandom(), _port_choices()
    for _ in range(100):
        if (port := rng.randrange(start, stop)) in _HANDED_OUT:  # (a SuperNode not yet listening)
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken (or in TIME_WAIT): another
                continue
        if _claim(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # every try taken: what the kernel hands out
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port`` (IPv6 brackets allowed)."""
    with contextlib.suppress(OSError), socket.create_connection((host.strip("[]"), port), 0.5):
        return True
    return False


def wait_superlink(proc: subprocess.Popen, host: str, port: int, log_path: Path,
                   timeout: float = 180.0) -> None:
    """Wait until the SuperLink ``proc`` accepts connections on ``host:port``; if it exits
    first, a RuntimeError with the end of its log, if the port stays closed, a TimeoutError."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
            raise EngineError(f"flower-superlink exited with code {proc.returncode}; its log "
                              f"({log_path}) ends with:\n{tail}")
        if port_open(host, port):
            return
        time.sleep(0.2)
    raise SuperLinkTimeout(f"flower-superlink did not open {host}:{port} within {timeout:.0f} s "
                           f"(log: {log_path})")


def flwr_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["FLWR_HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray's driver (the simulation) warns on every start that it will stop hiding GPUs from
    # actors given none; training.pick_device already asks Ray for the actor's GPUs instead
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), RAY_GPU_TIP]))
    return env


RAY_GPU_TIP = "ignore::FutureWarning:ray._private.worker"


def _write_connection(home: Path, port: int) -> None:
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')


def log_header(what: str) -> str:
    """The line a log gets before each command's output is appended (``what``: the command),
    or where the output stops: its time and what."""
    return f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n"


def _start(home: Path, port: int, out, pid_files: tuple[Path, ...] = ()) -> subprocess.Popen:
    """Start a simulation SuperLink writing to the open file ``out``; wait for its port. Its pid
    goes to ``pid_files`` at once, before the wait (a launcher killed while it waits leaves a
    SuperLink that reap_orphans or `superlink down` must find)."""
    home.mkdir(parents=True, exist_ok=True)
    _write_connection(home, port)
    cmd = [_bin("flower-superlink"), "--insecure", "--simulation",
           "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)]
    out.write(log_header(shlex.join(cmd)).encode())  # several SuperLinks' output in one log: each headed
    out.flush()
    proc = subprocess.Popen(cmd, env=flwr_env(home), stdout=out, stderr=subprocess.STDOUT,
                            cwd=PROJECT, start_new_session=True)
    try:
        for f in pid_files:
            _write_pid(f, proc.pid)
        wait_superlink(proc, "127.0.0.1", port, Path(out.name))
    except BaseException:  # a SuperLink that never opened its port is not left behind
        _stop(proc)
        for f in pid_files:  # nor named as running
            f.unlink(missing_ok=True)
        raise
    return proc


def shared_home() -> Path:
    """The project's FLWR_HOME: the detached SuperLink's connection and every SuperLink's log."""
    return (PROJECT / ".flwr-home").resolve()


def home_option(home: Path, default: Path | None = None) -> str:
    """`` --home <home>`` for a command the user is told to run, or nothing where ``home`` is
    the command's default (``default``; the shared home unless given)."""
    return "" if home == (default or shared_home()) else f" --home {home}"


def superlink_up(home: Path | None = None, port: int = 39191) -> int:
    """Start a detached simulation SuperLink for plain `flwr run .`; returns its pid."""
    from flowerbed.results import held

    home = Path(home).resolve() if home else shared_home()
    pid_file = home / "superlink.pid"
    home.mkdir(parents=True, exist_ok=True)
    # from the check to the pid file: two `up`s at once would start two, one never stopped
    with held(home / "superlink.lock", EngineError(f"another `flowerbed superlink up` is starting "
                                                   f"a SuperLink from {home} now")):
        if (pid := _read_pid(pid_file)) is not None and _alive(*pid):
            raise EngineError(f"a SuperLink is already running (pid {pid[0]}); stop it with "
                              f"`flowerbed superlink down{home_option(home)}`")
        if port_open("127.0.0.1", port):
            raise EngineError(f"port {port} is in use (another SuperLink?); pick another with --port")
        with open(home / "superlink.log", "ab") as out:
            proc = _start(home, port, out, (pid_file,))
    return proc.pid


def _write_pid(pid_file: Path, pid: int) -> None:
    """A pid file :func:`_read_pid` reads: the pid with its start time (a reused pid is not it)."""
    pid_file.write_text(json.dumps({"pid": pid, "start": start_time(pid)}))


def _read_pid(pid_file: Path) -> tuple[int, int | None] | None:
    """(pid, start time) from a pid file (older files: the bare pid); None if unreadable."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        d = json.loads(pid_file.read_text())
        return (d, None) if isinstance(d, int) else (int(d["pid"]), d.get("start"))
    return None


def superlink_down(home: Path | None = None) -> int | None:
    """Stop the SuperLink started by :func:`superlink_up` (and its children); returns its pid."""
    home = Path(home).resolve() if home else shared_home()
    pid_file = home / "superlink.pid"
    if (pid := _read_pid(pid_file)) is None:
        return None
    if ours(*pid):  # not a pid reused by another process since
        stop_group(pid[0], timeout=10.0)
    pid_file.unlink()
    return pid[0]


def stop_group(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM the process group ``pid`` leads and every process below ``pid`` with the groups
    they lead, wait, then SIGKILL whatever is left. Not the group alone: Flower starts
    ``flower-superexec`` and ``flwr-simulation`` (with Ray) in groups of their own, which
    outlived the SuperLink and finished an interrupted run in the background; so the tree is
    taken while ``pid`` still holds it, and taken again while stopping (a process started in
    between). Only groups led by a process of the tree are signalled (or ``pid``'s, when its
    leader has died), never this process's own."""
    tree: dict[int, int | None] = {}
    groups: set[int] = set() if _alive(pid) else {pid}  # a group whose leader died goes on

    def collect() -> None:
        for p in [pid, *descendants(pid, *(q for q, st in tree.items() if _alive(q, st)))]:
            if p not in tree and (st := start_time(p)) is not None:
                tree[p] = st  # with its start: a pid reused later is not ours
        groups.update(int(f[2]) for p in tree if (f := _stat(p)) and int(f[2]) in tree)
        groups.discard(os.getpgrp())

    def left() -> bool:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap the leader if it is our child
        return any(_alive(p, st) for p, st in tree.items()) or any(map(_group_alive, groups))

    for sig in (signal.SIGTERM, signal.SIGKILL):
        collect()
        if sig == signal.SIGKILL and not left():
            return  # all of it left after SIGTERM (children too: they get the same grace)
        t0, sent, sent_groups = time.time(), set(), set()
        while True:  # each process and group once per signal: a second SIGTERM can cut short
            for target in [p for p, st in tree.items() if p not in sent and _alive(p, st)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(target, sig)
                sent.add(target)
            for pgid in groups - sent_groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
                sent_groups.add(pgid)
            if time.time() - t0 >= timeout or not left():
                break
            time.sleep(0.2)
            collect()


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    for proc in Path("/proc").iterdir():
        fields = _stat(int(proc.name)) if proc.name.isdigit() else None
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp, ...
            return True
    return False


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), None if unreadable."""
    with contextlib.suppress(OSError, ValueError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, names the process
    even after the pid is reused."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def ours(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``) or what is left of its process group still
    runs: a leader that died leaves its group's id in use, which Linux never hands to a new
    process, so a group without its leader is still the one we started."""
    if _alive(pid, start):
        return True
    fields = _stat(pid)
    gone = fields is None or fields[0] == "Z"  # no such process, or the dead leader's zombie
    return gone and _group_alive(pid)


def _alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not) and, given ``start``, is the process that
    started then, not a later one that reused the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: not one of ours
        return start is None
    fields = _stat(pid)
    if fields is None:
        return True
    return fields[0] != "Z" and (start is None or int(fields[19]) == start)


@contextlib.contextmanager
def local_superlink(home: Path | None = None, port: int | None = None,
                    log_file: Path | None = None) -> Iterator[tuple[Path, str]]:
    """Start a simulation SuperLink that uses this venv; yield (FLWR_HOME, connection name).

    Without ``home`` each call gets its own FLWR_HOME under ``.flwr-home/`` (removed afterwards;
    the log goes to ``.flwr-home/superlink.log``): the connection lives in FLWR_HOME's
    config.toml, so two launchers in one project, or a launcher next to ``flowerbed superlink
    up``, would otherwise point each other's `flwr run` at the wrong SuperLink.
    """
    port = port or free_port()
    own = home is None
    if own:
        reap_orphans()
    home = Path(home or shared_home() / f"local-{os.getpid()}-{port}").resolve()
    home.mkdir(parents=True, exist_ok=True)
    out = open(log_file or (shared_home() if own else home) / "superlink.log", "ab")  # noqa: SIM115
    try:
        if own:  # for reap_orphans, should this launcher be killed (also while the SuperLink starts)
            _write_pid(home / "launcher.pid", os.getpid())
        proc = _start(home, port, out, (home / "superlink.pid",) if own else ())
        try:
            log.info("SuperLink (pid %d) on 127.0.0.1:%d, FLWR_HOME=%s", proc.pid, port, home)
            yield home, CONNECTION
        finally:
            _stop(proc)
    finally:
        out.close()
        if own:
            shutil.rmtree(home, ignore_errors=True)


def reap_orphans() -> None:
    """The SuperLinks of launchers that were killed (SIGKILL, the OOM killer) outlive them, in
    sessions of their own, with the rest of their runs: each launcher's start stops those whose
    run has ended, names those still running one, and removes their FLWR_HOMEs."""
    for home in sorted(shared_home().glob("local-*-*")):
        if not (named := re.fullmatch(r"local-(\d+)-\d+", home.name)):
            continue
        # a home without launcher.pid (one starting, or made by an older flowerbed): the
        # launcher's pid is in its name
        launcher = _read_pid(home / "launcher.pid") or (int(named.group(1)), None)
        if _alive(*launcher):
            continue
        link = _read_pid(home / "superlink.pid")
        if link is not None and ours(*link):
            running = [p for p in descendants(link[0]) if "flwr-simulation" in _cmdline(p)]
            if running:
                log.warning("a SuperLink (pid %d) left by a launcher that was killed (pid %d) is "
                            "still running a run; the next launcher after that run stops it "
                            "(now: flowerbed superlink down --home %s)", link[0], launcher[0], home)
                continue
            stop_group(link[0], timeout=10.0)
            log.info("stopped the SuperLink (pid %d) left by a launcher that was killed (pid %d); "
                     "its run had ended", link[0], launcher[0])
        shutil.rmtree(home, ignore_errors=True)


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def descendants(*pids: int) -> list[int]:
    """Every live process below ``pids`` (children, their children, ...), from one read of /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stop(proc: subprocess.Popen) -> None:
    """Stop the SuperLink and everything it started (:func:`stop_group`), then reap it."""
    if proc.poll() is None:  # reaped already: its pid may belong to another process by now
        with shielded("the SuperLink and its simulation"):
            stop_group(proc.pid)
        proc.poll()


@contextlib.contextmanager
def shielded(what: str) -> Iterator[None]:
    """A clean-up that a second Ctrl-C must not cut short: pressed twice, Ctrl-C left the
    simulation (flwr-simulation and Ray) training on in the background. Within it SIGINT, SIGTERM
    and SIGHUP (a closed terminal after a Ctrl-C) are noted, not raised (the clean-ups are
    bounded: a SIGTERM, a wait, a SIGKILL; ``flwr stop``'s timeout); an ignored one stays
    ignored. Main thread only, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    pending: list[int] = []

    def note(signum, frame):
        log.warning("still stopping %s; a moment (it is not left running)", what)
        if not getattr(old[signum], "notes_only", False):
            pending.append(signum)

    note.notes_only = True
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s, handler in old.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, note)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if pending:  # a clean-up that did not start from a signal (a run's normal end): one that came
        signal.raise_signal(pending[0])  # during it is obeyed now, not dropped (the command went on)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    text = str(v)
    if '"' in text:  # flwr's --run-config/--node-config parser cannot read it back
        from flowerbed.config import ConfigError

        raise ConfigError("run-config", text, "a string value may not contain '\"'")
    return json.dumps(text, ensure_ascii=False)


def federation_config(num_supernodes: int, cpus_per_client: float = 1.0,
                      gpus_per_client: float = 0.0) -> dict[str, Any]:
    from flowerbed.config import ConfigError

    if not (cpus_per_client > 0 and math.isfinite(cpus_per_client)):  # Ray divided by 0 later
        raise ConfigError("--cpus-per-client", cpus_per_client, "must be a finite number > 0")
    if not (gpus_per_client >= 0 and math.isfinite(gpus_per_client)):
        raise ConfigError("--gpus-per-client", gpus_per_client, "must be a finite number >= 0")
    if gpus_per_client > 1 and not float(gpus_per_client).is_integer():  # Ray: a share or whole GPUs
        raise ConfigError("--gpus-per-client", gpus_per_client, "a share below 1 (clients share a "
                          "GPU) or a whole number of GPUs")
    if not float(cpus_per_client).is_integer():  # `flwr run` refuses a fraction (an int field)
        raise ConfigError("--cpus-per-client", cpus_per_client, "must be a whole number of CPUs "
                          "(Flower's client-resources-num-cpus)")
    if cpus_per_client > (n := os.cpu_count() or 1):  # Ray could place no client: a traceback
        raise ConfigError("--cpus-per-client", cpus_per_client, f"more than this machine's {n} "
                          "CPUs: no client could start")
    # Flower wants whole CPUs as an int (a float like 1.0 is refused).
    return {"num-supernodes": num_supernodes, "client-resources-num-cpus": int(cpus_per_client),
            "client-resources-num-gpus": float(gpus_per_client)}


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """A file's identity and last change, or None if it does not exist."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def flwr_run(home: Path, connection: str, run_config: dict[str, Any],
             federation: dict[str, Any] | None, app_dir: Path = PROJECT, quiet: bool = False,
             log_file: Path | None = None, tee: bool = False) -> dict[str, Any]:
    """``flwr run <app> <connection> --stream``; returns the run's summary.json.

    The run's output goes to ``log_file`` (appended) where given, and to the console: all of it
    with ``tee`` or without a log file, else only the progress line per round; ``quiet``: none.

    ``federation``: the simulation's ``--federation-config`` (None for a deployment).

    ``flwr run --stream`` exits 0 even when the ServerApp raised, so success is judged by the
    summary file the ServerApp writes last.
    """
    out_dir = Path(run_config["output-dir"]).resolve()
    run_dir = out_dir / run_config["run-name"]
    summary = run_dir / "summary.json"
    before = _stamp(summary)  # kept: a refused run must not lose a finished run's summary
    rc = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
    cmd = [_bin("flwr"), "run", str(app_dir), connection, "--stream", "--run-config", rc]
    if federation:  # simulation only; a deployment's SuperNodes are real processes
        cmd += ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation.items())]
    log.info("$ %s", shlex.join(cmd))  # quoted: it can be pasted into a shell
    sink = open(log_file, "a") if log_file else None  # noqa: SIM115 - earlier attempts' logs kept
    tail: collections.deque[str] = collections.deque(maxlen=300)  # for the failure's reason
    try:
        if sink:
            sink.write(log_header(shlex.join(cmd)))
            sink.flush()
        console = None if quiet else sys.stdout
        out = sink or console
        echo = console if sink and tee else None  # the console too, every line but tracebacks
        fold = Folder(log_file) if echo else None  # (one line each; the log file keeps them)
        progress = console if sink and not tee else None  # a logged run's progress, one line a round
        with subprocess.Popen(cmd, env=flwr_env(home), cwd=PROJECT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
            run_id = None
            try:
                for line in proc.stdout:
                    tail.append(line)
                    if run_id is None and (m := _STARTED.search(line)):
                        run_id = m.group(1)
                    shown = not (federation and any(n in line for n in SIMULATION_NOISE))
                    if out and (shown or out is sink):
                        out.write(ANSI.sub("", line) if out is sink else line)  # a file: no colours
                        out.flush()
                    try:  # a closed console (| head) does not stop a logged run
                        if echo and shown:
                            echo.writelines(fold.feed(line))
                            echo.flush()
                        if progress and PROGRESS in line:  # "<run-name> [round r/n] acc ..."
                            at = line.index(PROGRESS) + len(PROGRESS) - len("[round ")
                            progress.write(f"{run_config['run-name']} {line[at:]}")
                            progress.flush()
                    except OSError:
                        echo = progress = None
                if echo:  # a traceback the output ended in
                    _end_fold(echo, fold)
            except BaseException as e:  # Ctrl-C or a broken terminal: leave neither flwr nor the run
                with shielded("the run"):  # a second Ctrl-C left it running
                    if echo:  # a failure whose traceback was being folded: its line
                        _end_fold(echo, fold)
                    proc.terminate()
                    try:  # Popen's exit waits without a limit for anything but a KeyboardInterrupt
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    # an interrupt after the ServerApp wrote its summary (flwr still streaming the
                    # end): the run finished, and its summary rides on the exception (compare's table)
                    finished = False
                    with contextlib.suppress(OSError, ValueError):  # nothing here may hide the interrupt
                        if _stamp(summary) not in (None, before):
                            e.summary, finished = json.loads(summary.read_text()), True
                    if sink:
                        sink.write(log_header(f"interrupted ({type(e).__name__}): " + (
                            "the run had finished; its results are kept" if finished
                            else "the run is stopped")))
                        sink.flush()
                    if finished:
                        log.warning("interrupted after run '%s' had finished: its results are in %s",
                                    run_config["run-name"], run_dir)
                    elif run_id is not None:
                        stop_run(home, connection, run_id)
                    else:  # flwr may have submitted it before it printed the id: say how to look
                        log.warning("interrupted before `flwr run` named its run id: if it was "
                                    "submitted, it may still run; `flwr list %s` (FLWR_HOME=%s) shows "
                                    "it and `flwr stop <run-id> %s` stops it", connection, home,
                                    connection)
                raise
    finally:
        if sink:
            sink.close()
    if _stamp(summary) in (None, before):
        where = f"its log: {log_file}" if log_file else "its log is above"
        # `flwr run --stream` can end (a lost connection) while a deployment's ServerApp goes on
        going = ("" if federation is not None or run_id is None else
                 f"; if it still runs on the SuperLink, `flwr log {run_id} {connection}` follows "
                 f"it and `flwr stop {run_id} {connection}` stops it (FLWR_HOME={home})")
        raise RunFailed(f"run '{run_config['run-name']}' ended without writing {summary}: "
                        f"{failure_reason(list(tail), run_dir)} ({where}){going}")
    return json.loads(summary.read_text())


def _end_fold(echo, fold: Folder) -> None:
    """The console's line for a traceback still being folded (a closed console: nothing)."""
    with contextlib.suppress(OSError):
        echo.writelines(fold.flush())
        echo.flush()


_STARTED = re.compile(r"Successfully started run (\d+)")
# flwr's simulation lines kept out of the console (a log file keeps them): a warning printed on
# every start whatever num-supernodes is (we always set it; the next line says how many), its
# advice to resize with `flwr federation` (ours is --num-clients), and each Ray actor's notice
# when it is stopped (at the run's end; mid-run only if Ray loses a node)
SIMULATION_NOISE = ("Since flwr 1.32, default simulated SuperNodes changed",
                    "To change federation size, use the following command",
                    "flwr federation simulation-config", "Manually terminating ClientAppActor")
PROGRESS = "flowerbed: [round "  # the ServerApp's line per round (results.progress_line)


def stop_run(home: Path, connection: str, run_id: str) -> None:
    """``flwr stop``: the ServerApp goes on after ``flwr run --stream`` is interrupted (a
    deployment's SuperLink outlives the launcher). Best effort; says so when it fails."""
    try:
        # in a session of its own: a second Ctrl-C reaches the terminal's whole group, and
        # killed it (the run then trained on, on a deployment's SuperLink)
        res = subprocess.run([_bin("flwr"), "stop", run_id, connection], env=flwr_env(home),
                             cwd=PROJECT, capture_output=True, text=True, timeout=60,
                             start_new_session=True)
        ok = res.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if ok:
        log.warning("interrupted: stopped run %s on %s", run_id, connection)
    else:
        log.warning("interrupted: could not stop run %s; stop it with `flwr stop %s %s`",
                    run_id, run_id, connection)


_REASON = re.compile(r"\b((?:flowerbed\.[\w.]+\.)?\w*(?:Error|Crash|Aggregated)): (.+)")


def failure_reason(lines: list[str], run_dir: Path) -> str:
    """The ServerApp's own error from the end of a run's output, or a generic line: flowerbed's
    exceptions first, else the last error after the last round's progress line (earlier ones
    can be clients' errors, which the round survived)."""
    last_round = max((i for i, ln in enumerate(lines) if PROGRESS in ln), default=-1)
    mine = [ln for ln in lines if "flowerbed." in ln]  # e.g. flowerbed.config.ConfigError: ...
    for line in [*reversed(mine), *reversed(lines[last_round + 1:])]:
        if m := _REASON.search(line):
            kind, text = m.group(1).rsplit(".", 1)[-1], m.group(2).strip()
            hint = (f"; continue it with `flowerbed run --resume {run_dir}`"
                    if kind == "SimulatedCrash" else "")
            return f"{kind}: {text}{hint}"
    if any(ln.startswith("╭─ Error") for ln in lines):  # `flwr run` itself refused (its box)
        return "flwr run: " + " ".join(ln.strip("│ \n") for ln in lines if ln.startswith("│"))
    return "the ServerApp failed"
