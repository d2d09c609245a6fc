"""The console's one line per traceback (flowerbed/tracebacks.py), on the shapes Flower 1.42 and
Ray print; the real engine's output is checked in
test_resume.test_flwr_run_killed_then_resumed_through_the_real_engine."""

from __future__ import annotations

from pathlib import Path

from flowerbed.tracebacks import Folder, short_path, summary

APP = "/h/.flwr-home/local-1/apps/flowerbed.flowerbed.0.1.0.ab12/flowerbed"
CLIENT_FAILURE = f"""\x1b[91mERROR \x1b[0m:     An exception was raised when processing a message by Ray
\x1b[91mERROR \x1b[0m:     ray::ClientAppActor.run() (pid=1, ip=1.2.3.4, actor_id=ab)
  File "/v/site-packages/flwr/clientapp/client_app.py", line 161, in __call__
    return self._registered_funcs[full_name](message, context)
  File "{APP}/clients/base.py", line 40, in train
    loss = step(batch)
  File "/v/site-packages/torch/nn/functional.py", line 3, in cross_entropy
    return torch._C._nn.cross_entropy_loss(input, target)
IndexError: Target 10 is out of bounds.

The above exception was the direct cause of the following exception:

ray::ClientAppActor.run() (pid=1, ip=1.2.3.4, actor_id=ab)
  File "/v/site-packages/flwr/simulation/ray_transport/ray_actor.py", line 65, in run
    raise ClientAppException(str(ex)) from ex
flwr.clientapp.client_app.ClientAppException:
Exception ClientAppException occurred. Message: Target 10 is out of bounds.
\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):
  File "/v/site-packages/flwr/server/superlink/fleet/vce/vce_api.py", line 132, in worker
    out_mssg, updated_context = backend.process_message(message, context)
flwr.clientapp.client_app.ClientAppException:
Exception ClientAppException occurred. Message: Target 10 is out of bounds.
"""
SERVER_FAILURE = f"""\x1b[91mERROR \x1b[0m:     Simulation raised an exception
Traceback (most recent call last):
  File "/v/site-packages/flwr/server/run_serverapp.py", line 60, in run
    server_app(grid=grid, context=context)
  File "{APP}/apps/server_app.py", line 235, in run
    raise KeyError(name)
KeyError
\x1b[91mERROR \x1b[0m:     Exit Code: 700
"""


def fold(text: str) -> list[str]:
    folder = Folder(Path("runs/x.log"))
    shown = [s for line in text.splitlines(keepends=True) for s in folder.feed(line)]
    return shown + folder.flush()


def test_each_failed_message_is_one_line_naming_its_cause_our_frame_and_the_log():
    shown = fold("INFO :      [ROUND 1/2]\n" + CLIENT_FAILURE + CLIENT_FAILURE.replace("10", "11")
                 + "WARNING flowerbed: client partition 0 left out\n")
    assert shown[0] == "INFO :      [ROUND 1/2]\n" and shown[-1].startswith("WARNING flowerbed")
    assert len(shown) == 4, shown
    assert shown[1] == ("\x1b[91mERROR \x1b[0m:     [a ClientApp raised IndexError: Target 10 is out of "
                        "bounds. (at flowerbed/clients/base.py:40 in train); its traceback (22 lines) "
                        "is in runs/x.log]\n")
    assert "Target 11" in shown[2]


def test_a_servers_traceback_and_one_the_output_ends_in():
    shown = fold(SERVER_FAILURE)
    assert shown == ["\x1b[91mERROR \x1b[0m:     Simulation raised an exception\n",
                     "  [KeyError (at flowerbed/apps/server_app.py:235 in run); its traceback (6 lines) "
                     "is in runs/x.log]\n",
                     "\x1b[91mERROR \x1b[0m:     Exit Code: 700\n"]
    cut = SERVER_FAILURE.splitlines(keepends=True)[:-1]  # the output stops inside the traceback
    assert fold("".join(cut))[-1].startswith("  [KeyError (at flowerbed/apps/server_app.py:235")


def test_lines_that_are_not_tracebacks_pass_unchanged():
    text = "INFO flowerbed: [round 1/1] acc 0.5\n  indented text\nKeyError: not after a traceback\n"
    assert fold(text) == text.splitlines(keepends=True)
    assert summary(["Traceback (most recent call last):", "no frames at all"]) == "a traceback"
    assert short_path("/x/lib/python3.11/site-packages/torch/nn/functional.py") == "torch/nn/functional.py"
    assert short_path("/data/own.py") == "/data/own.py"
