"""Client state that survives a server crash: ``context.state`` filed per round, restored on resume.

Flower keeps a client's ``context.state`` for one run; a resumed run is a new Flower run with empty
contexts. Methods whose clients keep state between rounds (SCAFFOLD's c_i, FedDyn's ∇L_i, FedBYOL's
target, FedU's local model, FedMoCo's and FedProtoCL's key encoder and queue, MOON-unsup's previous
model, FedCC/FedDF/FedMD/FedCT's models, FedRep's head, Ditto's personal model, APFL's personal model and
α, Local's model, FedSoft's local model and importance weights, FedXDS's D_g, Fed-ADE's personal
layers and estimator buffers, Fed-POE's local and pre-trained models and Hedge weights) therefore
file it after every training round, on the
client's own machine, under ``<client-state-dir>/<run-key>/partition-<i>/round-<r>.attempt-<n>.pt`` (the last
two rounds are kept; after the run, the last). The first message a client process gets in a run
(in a resumed run, or after its SuperNode restarted) restores the newest file from before its
round that the run still stands on; methods without client state write nothing.

Attempts. A resumed run repeats the rounds after its checkpoint, so state filed in them by the
attempt that crashed is not the run's. Every message of a resumed run names its resume points
(``resumed-after``: config.json's ``resumed-after-rounds``); the state a client files in round
r of the run's n-th attempt (0: the first) is ``round-<r>.attempt-<n>.pt``, and round r belongs
to the attempt that ran it last before the checkpoint it resumed from (:func:`attempt_of`).
Files of another attempt are set aside as ``abandoned-...``: the partition may not be asked in
the resumed rounds at all, so its first message can come after those rounds, or after a later
resume. Files named ``round-<r>.pt`` (flowerbed before attempts) count for any attempt, except
in rounds after the last resume point (:func:`_rolled_back`).

``run-key`` (:func:`run_key`) is the run directory's name plus the run's id (kept in its
config.json), sent by the server in every message's config: two runs of the same name in
different folders (every ``flowerbed compare`` names its runs after their methods), or a fresh
run where an earlier one was moved aside, never share or prune each other's state.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import re
import shutil
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from flowerbed import cache_root
from flowerbed.checkpoint import decode, encode, write_synced
from flowerbed.config import Config
from flowerbed.results import own_temporary, remove_dead_temporaries, write_atomic

log = logging.getLogger("flowerbed")
RESTORED = "flowerbed.restored"  # our marker in context.state: restore was done for this run
KEEP = 2
RELEASED = "released."  # prefix of records a client has sent out for good (see restore)
# (FedXDS kept its release here before it got a file of its own: read from older runs' state)


def run_key(run_dir: Path, run_id: str | None) -> str:
    """The client-state folder name of the run in ``run_dir``: its name and the run's id (made
    when the run starts, kept in its config.json: a fresh run in a folder whose earlier run was
    moved aside gets its own); runs made before run ids: a hash of the path."""
    digest = run_id or hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return f"{Path(run_dir).name}-{digest}"


def root(cfg: Config) -> Path:
    return Path(cfg.client_state_dir).expanduser() if cfg.client_state_dir else cache_root() / "client-state"


def folder(cfg: Config, run_key: str, partition_id: int) -> Path:
    if not run_key or "/" in run_key or run_key in (".", ".."):
        raise ValueError(f"bad run-key {run_key!r}")
    return root(cfg) / run_key / f"partition-{partition_id}"


def attempt_of(server_round: int, resumed_after: list[int]) -> int:
    """The attempt that ran ``server_round`` in the run's history: the first (0) ran rounds up
    to its crash, the n-th resume (after round p_n) from p_n + 1 on; the points never decrease."""
    return sum(p < server_round for p in resumed_after)


def _config_of(msg: Message) -> ConfigRecord:
    return msg.content.config_records.get("config") or ConfigRecord()


def resumed_after_of(msg: Message) -> list[int]:
    """The resume points a message names (none in a run never resumed)."""
    return [int(p) for p in _config_of(msg).get("resumed-after", [])]


def _name(server_round: int, attempt: int) -> str:
    return f"round-{server_round}.attempt-{attempt}.pt"


def _put_arrays(context: Context, arrays: dict) -> None:
    for k, v in arrays.items():
        context.state[k] = v if isinstance(v, ArrayRecord) else ArrayRecord(v)


def _records(context: Context) -> dict:
    st = context.state
    return {"arrays": {k: v for k, v in st.array_records.items()},
            "configs": {k: dict(v) for k, v in st.config_records.items() if k != RESTORED},
            "metrics": {k: dict(v) for k, v in st.metric_records.items()}}


def save(cfg: Config, context: Context, run_key: str, partition_id: int, server_round: int,
         attempt: int = 0) -> None:
    """File this client's state after training in ``server_round`` of the run's ``attempt``
    (nothing if it has none and never filed any; an empty state after filed ones is filed too,
    so that a resume does not bring back a state the client dropped, e.g. a diverged personal
    model)."""
    recs = _records(context)
    if not run_key:
        return
    d = folder(cfg, run_key, partition_id)
    if not any(recs.values()) and not d.is_dir():
        return
    d.mkdir(parents=True, exist_ok=True)
    write_synced(d / _name(server_round, attempt), encode(recs))  # on disk before the reply leaves
    for *_, old in _filed(d)[:-KEEP]:
        with contextlib.suppress(OSError):
            old.unlink()


def _filed(d: Path, prefix: str = "") -> list[tuple[int, int, Path]]:
    """(round, attempt, path) of each state file in ``d``, by round, the attempt -1 for a file
    from before attempts (``prefix``: set-aside ones)."""
    pattern = re.escape(prefix) + r"round-(\d+)(?:\.attempt-(\d+))?\.pt"
    return sorted((int(m.group(1)), int(m.group(2) or -1), p) for p in d.glob(f"{prefix}round-*.pt")
                  if (m := re.fullmatch(pattern, p.name))) if d.is_dir() else []


def restore(cfg: Config, context: Context, run_key: str, partition_id: int, server_round: int,
            keeps_state: bool = True, resumed_after: list[int] | None = None,
            evaluating: bool = False) -> int | None:
    """Put back the newest state this run filed before ``server_round`` (``evaluating``: up to
    it, which the evaluation after its training scores); its resume points ``resumed_after``
    say which attempt's files those are. Returns the restored state's round.

    Runs once per client process and run (a marker in ``context.state`` remembers it was done):
    in a resumed run, and in a fresh one whose SuperNode restarted (its context is new, its files
    are there). Records named ``released.*`` (what the client has sent out for good) come back
    from any filed round, also one the resumed run repeats.
    """
    if RESTORED in context.state.config_records or not run_key:
        return None
    context.state[RESTORED] = ConfigRecord({"round": server_round})
    d = folder(cfg, run_key, partition_id)
    if not d.is_dir() and cfg.resume and (old := _filed_under_another_name(cfg, run_key, partition_id)):
        # the run's folder was renamed (or copied) since: its state is copied to the new name, so
        # that what it files from now on sits beside it (a second crash finds both); the old
        # folder is left as it is (a copied run's original still owns it)
        try:
            _copy_folder(old, d)
        except OSError as e:
            log.warning("partition %d: could not copy its state from %s to %s (%s); read there",
                        partition_id, old, d, e)
            d = old
        else:
            try:
                _copy_run_files(old.parent, d.parent)
            except OSError as e:  # D_g: the server sends it again when a client lacks it
                log.warning("partition %d: could not copy the run's files from %s (%s)",
                            partition_id, old.parent, e)
    if not d.is_dir() and not cfg.resume:  # a fresh run's first message: nothing to look for
        return None
    before = server_round + evaluating
    _abandon(d, before, partition_id, list(resumed_after or []))
    _restore_releases(context, d, before)
    earlier = [(r, p) for r, _, p in reversed(_filed(d)) if r < before]
    if not earlier:  # said only where the method's client keeps state (Client.keeps_state)
        log.log(logging.INFO if keeps_state else logging.DEBUG, "partition %d: no filed state from "
                "before round %d in %s (none filed, or lost: it starts from the method's initial state)",
                partition_id, before, d)
        return None
    for r, path in earlier:  # a damaged file: the one before it (KEEP), loudly
        try:
            recs = decode(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001
            log.warning("partition %d: cannot read its state %s (%s)", partition_id, path, e)
            continue
        _put_arrays(context, recs["arrays"])
        for k, v in recs["configs"].items():
            context.state[k] = ConfigRecord(v)
        for k, v in recs["metrics"].items():
            context.state[k] = MetricRecord(v)
        log.info("partition %d: restored its state from round %d (%s)", partition_id, r, path)
        return r
    log.warning("partition %d: no readable state in %s; it starts without it", partition_id, d)
    return None


def _copy_run_files(old: Path, new: Path) -> None:
    """The files a run keeps beside its partitions' folders (FedXDS's D_g), each copied once,
    atomically, so that a client of another process reads it whole or not at all."""
    for f in old.iterdir():
        if f.is_file() and not f.name.startswith(".") and not (new / f.name).exists():
            with open(f, "rb") as src:
                write_atomic(new / f.name, lambda out, src=src: shutil.copyfileobj(src, out))


def _copy_folder(old: Path, new: Path) -> None:
    """``old`` copied to ``new`` whole or not at all (a copy cut short by a full disk or a kill
    would otherwise pass for the partition's folder, without the files it lacks); hidden files
    (other writers' work in progress) are left out, and so are the leftovers of copies killed
    mid-way here."""
    tmp = own_temporary(new, ".copy")
    try:
        shutil.copytree(old, tmp, ignore=shutil.ignore_patterns(".*"))
        tmp.rename(new)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not new.is_dir():  # (else another process of this partition made it first)
            raise
    finally:
        remove_dead_temporaries(new, ".copy", shutil.rmtree)


def filed_file(cfg: Config, run_key: str, partition_id: int, name: str) -> Path | None:
    """The file ``name`` this run keeps in the partition's state folder, or, where the run's
    folder was renamed or copied and the copy could not be made, under the run's former name."""
    here = folder(cfg, run_key, partition_id) / name
    return here if here.is_file() else _newest_of_run(cfg, run_key, partition_id, name)


def _filed_under_another_name(cfg: Config, run_key: str, partition_id: int) -> Path | None:
    """This client's state filed by the same run under the name its folder had then; the newest
    such folder, if any."""
    d = _newest_of_run(cfg, run_key, partition_id)
    if d is not None:
        log.info("partition %d: its state is filed under the run's former name, %s", partition_id,
                 d.parent.name)
    return d


def _newest_of_run(cfg: Config, run_key: str, partition_id: int, name: str = "") -> Path | None:
    """The newest ``partition-<i>`` folder this run (the key's tail is its id) has under any
    name, or the newest file ``name`` in one."""
    run_id = glob.escape(run_key.rsplit("-", 1)[-1])
    found = []
    for p in root(cfg).glob(f"*-{run_id}/partition-{partition_id}" + (name and f"/{glob.escape(name)}")):
        with contextlib.suppress(OSError):  # (one removed since the glob)
            if p.is_file() if name else p.is_dir():
                found.append((p.stat().st_mtime, p))
    return max(found)[1] if found else None


def _rolled_back(r: int, a: int, before: int | None, resumed_after: list[int]) -> bool:
    """Whether state filed in round ``r`` by attempt ``a`` is not the run's: a later attempt ran
    that round (:func:`attempt_of`). A file from before attempts (``a`` < 0) counts for any
    attempt, but not from round ``before`` on (None: the run ended, no round is asked), nor after
    the last resume point (only the attempt now running runs those, and it names its files)."""
    if a >= 0:
        return a != attempt_of(r, resumed_after)
    return (before is not None and r >= before) or (bool(resumed_after) and r > max(resumed_after))


def _abandon(d: Path, before: int | None, partition_id: int, resumed_after: list[int]) -> None:
    """Set aside the state filed in rounds the run rolled back past (:func:`_rolled_back`).
    Left in place, a later restore could take one of them for the newest state from before
    its round."""
    for r, a, path in _filed(d):
        if _rolled_back(r, a, before, resumed_after):
            with contextlib.suppress(OSError):
                path.replace(aside := d / f"abandoned-{path.name}")
                log.info("partition %d: its state filed in round %d of an attempt the run rolled "
                         "back past, set aside as %s", partition_id, r, aside)


def _restore_releases(context: Context, d: Path, before: int) -> None:
    """``released.*`` records filed in round ``before`` or later, or set aside (the server died
    after the client's reply but before its checkpoint): a repeated round re-sends them, never
    a new draw."""
    files = ([p for r, _, p in reversed(_filed(d)) if r >= before]
             + [p for *_, p in reversed(_filed(d, "abandoned-"))])
    for f in files:
        with contextlib.suppress(Exception):  # a damaged file: the next older one, or none
            arrays = decode(torch.load(f, map_location="cpu", weights_only=True))["arrays"]
            found = {k: v for k, v in arrays.items() if k.startswith(RELEASED)}
            _put_arrays(context, found)
            if found:  # the newest file that has them: every later file carries them too
                return


def run_key_of(msg: Message) -> str:
    return str(_config_of(msg).get("run-key", ""))


def prune(cfg: Config, run_key: str, resumed_after: list[int] | None = None) -> None:
    """A finished run: keep only each client's newest filed state on this machine that the run
    stands on (what a run extended with more rounds resumes from, as on a deployed client's
    machine): a partition asked in none of a resumed run's rounds still holds the crashed
    attempt's file, which is not it."""
    base = root(cfg) / run_key if run_key else None
    if base is None or not base.is_dir():
        return
    for d in base.glob("partition-*"):
        if not (m := re.fullmatch(r"partition-(\d+)", d.name)):
            continue
        _abandon(d, None, int(m.group(1)), list(resumed_after or []))
        kept = _filed(d)
        newest = kept[-1][0] if kept else -1
        # a file set aside up to the newest state's round: that state was filed after the
        # restore that set it aside, so it carries its released.* records; a later one may not
        for *_, old in kept[:-1] + [(r, a, p) for r, a, p in _filed(d, "abandoned-") if r <= newest]:
            with contextlib.suppress(OSError):
                old.unlink()
