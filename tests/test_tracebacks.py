"""The console's one line per failure (flowerbed/tracebacks.py), on the shapes Flower 1.42 and
Ray print; the real engine's output is checked in
test_resume.test_flwr_run_killed_then_resumed_through_the_real_engine."""

from __future__ import annotations

from pathlib import Path

from flowerbed.tracebacks import Folder, ours, short_path

RED = "\x1b[91mERROR \x1b[0m:     "
APP = "/h/.flwr-home/local-1/apps/flowerbed.flowerbed.0.1.0.ab12/flowerbed"
SITE = "/home/u/flowerbed/.venv/lib/python3.11/site-packages"  # a clone named flowerbed


HEADER = "ray::ClientAppActor.run() (pid=1, ip=1.2.3.4, actor_id=ab)"


def chain(inner: list[str]) -> list[str]:
    """A failed ClientApp call's chain after Ray's header line: ``inner`` (frames and the
    original exception chain), then Flower's wrapper whose text ends in the last exception's."""
    last = inner[-1].split(": ", 1)[-1]
    return ["                  ^^^^^^^^^^^^^",
            f'  File "{SITE}/flwr/clientapp/client_app.py", line 161, in __call__',
            "    return self._registered_funcs[full_name](message, context)", *inner, "",
            "The above exception was the direct cause of the following exception:", "", HEADER,
            f'  File "{SITE}/flwr/simulation/ray_transport/ray_actor.py", line 65, in run',
            "    raise ClientAppException(str(ex)) from ex", "flwr.clientapp.client_app.ClientAppException: ",
            f"Exception ClientAppException occurred. Message: {last}"]


def ray_chain(inner: list[str]) -> str:
    """Ray's record of the failure."""
    return "\n".join([f"{RED}{HEADER}", *chain(inner)]) + "\n"


def worker(inner: list[str]) -> str:
    """Flower's worker's record of the same failure: its traceback, then Ray's chain again (as
    Flower 1.42 prints it), or (``inner`` a string) only Flower's wrapper with that text."""
    tail = ([f"ray.exceptions.RayTaskError(ClientAppException): {HEADER}", *chain(inner)]
            if isinstance(inner, list) else ["flwr.clientapp.client_app.ClientAppException:",
                                             f"Exception ClientAppException occurred. Message: {inner}"])
    return "\n".join([f"{RED}Traceback (most recent call last):",
                      f'  File "{SITE}/flwr/server/superlink/fleet/vce/vce_api.py", line 132, in worker',
                      "    out_mssg, updated_context = backend.process_message(message, context)",
                      f'  File "{SITE}/ray/_private/worker.py", line 1023, in get_objects',
                      "    raise value.as_instanceof_cause()", *tail]) + "\n"


FAILED = f"{RED}An exception was raised when processing a message by RayBackend\n"
OURS = [f'  File "{APP}/clients/base.py", line 40, in train', "    loss = step(batch)",
        f'  File "{SITE}/torch/nn/functional.py", line 3, in cross_entropy',
        "    return torch._C._nn.cross_entropy_loss(input, target)",
        "IndexError: Target 10 is out of bounds."]
SERVER = "\n".join([f"{RED}Simulation raised an exception", "Traceback (most recent call last):",
                    f'  File "{SITE}/flwr/server/run_serverapp.py", line 60, in run',
                    "    server_app(grid=grid, context=context)",
                    f'  File "{APP}/apps/server_app.py", line 235, in run', "    raise KeyError(name)",
                    "KeyError", f"{RED}Exit Code: 700"]) + "\n"


def fold(text: str) -> list[str]:
    folder = Folder(Path("runs/x.log"))
    shown = [s for line in text.splitlines(keepends=True) for s in folder.feed(line)]
    return shown + folder.flush()


def test_a_clients_failure_is_one_line_naming_its_exception_our_frame_and_the_log():
    shown = fold("INFO :      [ROUND 1/2]\n" + FAILED + ray_chain(OURS)
                 + worker(OURS) + "WARNING flowerbed: client partition 0 left out\n")
    assert shown == ["INFO :      [ROUND 1/2]\n",
                     f"{RED}[a ClientApp raised IndexError: Target 10 is out of bounds. (at "
                     "flowerbed/clients/base.py:40 in train); the traceback is in runs/x.log]\n",
                     "WARNING flowerbed: client partition 0 left out\n"]


def test_two_failures_interleaved_by_flowers_threads_are_named_once_each():
    """From a review: two clients failing at once interleave their records (A1 B1 A2 A3 B2 B3)."""
    a, b = ([*OURS[:-1], f"flowerbed.faults.InjectedFault: partition {p}"] for p in (0, 2))
    shown = fold(FAILED + FAILED + ray_chain(a) + worker(a) + ray_chain(b) + worker(b))
    assert [s.split(" (at")[0] for s in shown] == [
        f"{RED}[a ClientApp raised flowerbed.faults.InjectedFault: partition {p}" for p in (0, 2)]
    assert fold(FAILED + FAILED + ray_chain(a) + ray_chain(b) + worker(a) + worker(b)) == shown
    same = fold(FAILED + ray_chain(a) + worker(a) + FAILED + ray_chain(a) + worker("partition 0"))
    assert len(same) == 1 and "[2 ClientApps raised flowerbed.faults.InjectedFault: partition 0" in same[0]


def test_the_exception_that_says_most_is_named():
    """From a review: client_app's KeyError -> ValueError naming the key and message type, and a
    ConfigError raised while handling a KeyError, were named by their first (bare) exception."""
    renamed = [*OURS[:2], "KeyError: 'server-control'", "", "The above exception was the direct "
               "cause of the following exception:", "", "Traceback (most recent call last):",
               f'  File "{APP}/apps/client_app.py", line 50, in wrapped', "    raise ValueError(...)",
               "ValueError: train message for method 'scaffold': 'server-control' is missing"]
    shown = fold(FAILED + ray_chain(renamed) + worker(renamed))
    assert len(shown) == 1 and ("raised ValueError: train message for method 'scaffold': 'server-control' "
                                "is missing (at flowerbed/apps/client_app.py:50 in wrapped)") in shown[0]
    handling = SERVER.replace("KeyError\n", "KeyError: 'lr'\n\nDuring handling of the above exception, "
                              "another exception occurred:\n\nTraceback (most recent call last):\n"
                              f'  File "{APP}/config.py", line 9, in check\n    raise ConfigError(...)\n'
                              "flowerbed.config.ConfigError: lr must be > 0\n")
    assert "  [flowerbed.config.ConfigError: lr must be > 0 (at flowerbed/config.py:9 in check);" in \
        fold(handling)[1]


def test_other_lines_end_the_fold_and_are_shown():
    """From a review: Ray's prefixed client lines, warnings and prints after a traceback were
    hidden until the next log record."""
    after = ["\x1b[36m(ClientAppActor pid=9)\x1b[0m INFO flowerbed: client partition 1/3 on cpu\n",
             "/x/y.py:3: UserWarning: something\n", "a line printed\n"]
    shown = fold(FAILED + ray_chain(OURS) + "".join(after) + worker(OURS))
    assert shown[1:] == after and "IndexError" in shown[0]  # (Flower's record: the same failure)
    shown = fold(SERVER.replace(f"{RED}Exit Code: 700\n", "".join(after)))
    assert shown[1].startswith("  [KeyError (at flowerbed/apps/server_app.py:235 in run)")
    assert shown[2:] == after


def test_a_servers_traceback_one_the_output_ends_in_and_one_that_names_nothing():
    shown = fold(SERVER)
    assert shown == [f"{RED}Simulation raised an exception\n",
                     "  [KeyError (at flowerbed/apps/server_app.py:235 in run); the traceback is in "
                     "runs/x.log]\n", f"{RED}Exit Code: 700\n"]
    cut = "".join(SERVER.splitlines(keepends=True)[:-1])  # the output stops inside the traceback
    assert fold(cut)[-1].startswith("  [KeyError (at flowerbed/apps/server_app.py:235")
    bare = "Traceback (most recent call last):\n  something unparsed\n"
    assert fold(bare) == bare.splitlines(keepends=True)  # shown as it came, not lost


def test_syntax_errors_exception_groups_and_clones_named_flowerbed():
    syntax = ["Traceback (most recent call last):", f'  File "{APP}/apps/client_app.py", line 5, in <module>',
              "    from flowerbed.clients import base", f'  File "{APP}/clients/base.py", line 40',
              "    def f(:", "          ^", "SyntaxError: invalid syntax"]
    shown = fold("\n".join(syntax) + "\n")
    assert "[SyntaxError: invalid syntax (at flowerbed/clients/base.py:40);" in shown[0]
    group = ["  + Exception Group Traceback (most recent call last):",
             f'  |   File "{APP}/strategies/base.py", line 7, in aggregate',
             "  |     raise ExceptionGroup(...)",
             "  | ExceptionGroup: two (2 sub-exceptions)", "  +-+---------------- 1 ----------------",
             "    | Traceback (most recent call last):", f'    |   File "{APP}/x.py", line 3, in f',
             "    |     raise StopIteration", "    | StopIteration"]
    shown = fold("Traceback (most recent call last):\n" + "\n".join(group[1:]) + "\n")
    assert "[StopIteration (at flowerbed/x.py:3 in f);" in shown[0]
    assert not ours(f"{SITE}/torch/nn/functional.py") and ours(f"{APP}/x.py")
    assert short_path(f"{SITE}/torch/nn/functional.py") == "torch/nn/functional.py"
    assert short_path("/home/u/flowerbed/flowerbed/apps/x.py") == "flowerbed/apps/x.py"
    assert short_path("/data/own.py") == "/data/own.py"
    assert fold("INFO flowerbed: [round 1/1] acc 0.5\n  indented\nKeyError: not in a traceback\n") == [
        "INFO flowerbed: [round 1/1] acc 0.5\n", "  indented\n", "KeyError: not in a traceback\n"]


def test_a_multi_line_message_is_read_whole_and_a_group_separator_is_not_a_message():
    """From a review: a message whose second line is not indented ended the fold, and Ray's
    chain after it was shown raw; a group's separator line was read as part of a message."""
    inner = [*OURS[:-1], "ValueError: first line", "second line"]
    shown = fold(FAILED + ray_chain(inner) + worker(inner) + "INFO flowerbed: [round 1/1]\n")
    assert len(shown) == 2 and "[a ClientApp raised ValueError: first line | second line (at " in shown[0]
    group = ["Traceback (most recent call last):", f'  File "{APP}/x.py", line 3, in f',
             "    raise ExceptionGroup(...)", "ExceptionGroup: two (2 sub-exceptions)",
             "  +-+---------------- 1 ----------------", "    | Traceback (most recent call last):",
             f'    |   File "{APP}/x.py", line 4, in g', "    |     raise ValueError('a')",
             "    | ValueError: a",
             "    +---------------- 2 ----------------"]
    assert "[ValueError: a (at flowerbed/x.py:4 in g);" in fold("\n".join(group) + "\n")[0]


def test_lines_after_a_tracebacks_last_exception_are_shown_not_read_as_its_message():
    """From a review: a warning or print right after a traceback's last exception line was read
    as that exception's message (and, after Flower's worker's record, counted a failure twice)."""
    after = ["/x/y.py:3: UserWarning: something\n", "  warnings.warn(\n", "a line printed\n"]
    shown = fold(SERVER.replace(f"{RED}Exit Code: 700\n", "".join(after)))
    assert shown[1].startswith("  [KeyError (at flowerbed/apps/server_app.py:235 in run);")
    assert shown[2:] == after
    a = [*OURS[:-1], "flowerbed.faults.InjectedFault: partition 0"]
    shown = fold(FAILED + ray_chain(a) + worker("partition 0") + after[0] + "INFO flowerbed: [round 2/5]\n")
    assert len(shown) == 3 and "InjectedFault: partition 0 (at" in shown[0] and shown[1:] == [
        after[0], "INFO flowerbed: [round 2/5]\n"]


def test_a_line_between_two_tracebacks_is_shown_between_their_lines():
    """From a review: a print between one failure and the next (a record or a bare traceback)
    was read as the first one's message: hidden, and the failure counted twice."""
    a, b = ([*OURS[:-1], f"flowerbed.faults.InjectedFault: partition {p}"] for p in (0, 2))
    shown = fold(FAILED + ray_chain(a) + worker("partition 0") + "a line printed\n"
                 + FAILED + ray_chain(b) + worker("partition 2"))
    assert len(shown) == 3 and "partition 0 (at" in shown[0] and shown[1] == "a line printed\n"
    assert "partition 2 (at" in shown[2]
    two = fold(SERVER.replace(f"{RED}Exit Code: 700\n", "a line printed\n\nTraceback (most recent call "
                              f'last):\n  File "{APP}/y.py", line 2, in h\n    raise\nValueError: v\n'))
    assert [ln.split(" (at")[0] for ln in two[1:]] == ["  [KeyError", "a line printed\n", "\n",
                                                       "  [ValueError: v"]
