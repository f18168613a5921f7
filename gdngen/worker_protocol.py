"""The worker-subprocess protocol shared by ``gdngen tune`` (one process per trial) and
``gdngen bench`` (one process per framework).

The parent runs ``python -m <module> <args>`` with this gdngen's source root first on
``PYTHONPATH`` (the worker imports the gdngen the parent imported) and the environment plus
``env_extra``; it writes one JSON request to the worker's stdin and reads its stdout. The worker
reads the request (`read_request`) and prints its result as one line, ``<tag><JSON>``
(`reply`); anything else it prints is ignored. `call` maps the outcome:

* ``ok``: the process exited 0 and printed a tagged line (the last one is the result);
* ``crash``: a non-zero exit, or no tagged line;
* ``timeout``: the process ran past ``timeout`` seconds and was killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the folder holding the ``gdngen`` package the parent imported
SRC_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Outcome:
    """How a worker ended: ``status`` "ok" / "crash" / "timeout"; ``result`` the decoded
    tagged line (when "ok"); ``returncode`` (None after a timeout); ``error`` a one-line
    account for "crash" / "timeout" (with the tail of stderr when it was captured)."""

    status: str
    result: Any = None
    returncode: int | None = None
    error: str = ""


def call(module: str, request, *, tag: str, args=(), label: str = "worker",
         env_extra: dict | None = None, timeout: float | None = None,
         capture_stderr: bool = True) -> Outcome:
    """Run ``python -m module *args`` as a worker, send ``request`` (JSON) on its stdin and
    return its `Outcome`. ``label`` names the worker in ``error``; ``timeout`` None waits
    forever; ``capture_stderr`` False lets the worker's stderr through to ours."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_ROOT, env.get("PYTHONPATH")) if p)
    env.update(env_extra or {})
    with subprocess.Popen(
            [sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE if capture_stderr else None,
            text=True, env=env) as proc:
        try:
            stdout, stderr = proc.communicate(json.dumps(request), timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return Outcome("timeout", error=f"{label} exceeded {timeout:g} s and was killed")
        except BaseException:  # e.g. KeyboardInterrupt: leave no worker behind
            proc.kill()
            raise
    tagged = [ln for ln in stdout.splitlines() if ln.startswith(tag)]
    if proc.returncode != 0 or not tagged:
        tail = f": {stderr[-2000:]}" if capture_stderr else ""
        return Outcome("crash", returncode=proc.returncode,
                       error=f"{label} process exited with {proc.returncode}{tail}")
    return Outcome("ok", json.loads(tagged[-1][len(tag):]), proc.returncode)


def read_request():
    """The worker side: the JSON request the parent wrote to stdin."""
    return json.loads(sys.stdin.read())


def reply(tag: str, result) -> None:
    """The worker side: print ``result`` as the tagged JSON line `call` reads."""
    print(tag + json.dumps(result), flush=True)
