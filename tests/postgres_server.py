"""A throwaway PostgreSQL server for tests and benchmarks: `temporary_server`.

Debian's ``postgresql`` package (``make test`` installs it): ``initdb`` in a temporary folder,
trust authentication for the user ``gdngen``, listening on a free loopback port with fsync off,
run as the ``postgres`` user when the caller is root (PostgreSQL refuses root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def server_bin() -> Path | None:
    """The folder of PostgreSQL's server binaries (initdb, pg_ctl, postgres), if installed:
    ``initdb`` on PATH, else the newest ``/usr/lib/postgresql/<major>/bin``."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent

    def major(path):
        name = Path(path).parent.parent.name
        return int(name) if name.isdigit() else 0

    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=major)
    return Path(dirs[-1]).parent if dirs else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def temporary_server(bindir: Path):
    """Start a server from ``bindir``; yields ``database()``, which creates a fresh database
    and returns its ``postgresql://`` URL. The server is stopped and its folder removed on
    exit. RuntimeError (with the tool's output) when a step fails; KeyError when run as root
    on a system without a ``postgres`` user."""
    as_user = []
    folder = Path(tempfile.mkdtemp(prefix="gdngen-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")  # the Debian package creates this user
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()

    def run(*args):
        proc = subprocess.run([*as_user, *map(str, args)], capture_output=True, text=True,
                              timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    started = False
    try:
        run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "gdngen", "-E", "UTF8",
            "--no-sync")
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off"
        run(bindir / "pg_ctl", "-D", data, "-o", options, "-l", folder / "server.log", "-w",
            "start")
        started = True
        base = f"postgresql://gdngen@127.0.0.1:{port}"
        made = []

        def database() -> str:
            import psycopg

            name = f"study{len(made)}"
            with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {name}")
            made.append(name)
            return f"{base}/{name}"

        yield database
    finally:
        if started:
            run(bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)
