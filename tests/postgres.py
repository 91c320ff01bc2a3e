"""A throwaway PostgreSQL server for tests: `initdb` in a temporary folder, `pg_ctl start` on a free
loopback port, stopped and removed afterwards. Debian's `postgresql` package provides the binaries
(.ci/run installs it); without them the tests that need it skip, saying so."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from services.common.ports import free_port


def binaries() -> Path | None:
    """The folder with initdb and pg_ctl: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(folder, "initdb").exists() and Path(folder, "pg_ctl").exists():
            return Path(folder)
    return None


def _as_server_user(command: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root: run it as the package's `postgres` user then.
    if os.geteuid() != 0:
        return command
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root and there is no `postgres` user to run PostgreSQL as") from None
    return ["runuser", "-u", "postgres", "--", *command]


@contextmanager
def postgres_server():
    """Yields a SQLAlchemy URL of a fresh, empty database."""
    folder = binaries()
    if folder is None:
        raise FileNotFoundError("PostgreSQL's initdb/pg_ctl not found (Debian package `postgresql`)")
    root = Path(tempfile.mkdtemp(prefix="qos-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", free_port()
    run = lambda *args: subprocess.run(_as_server_user([str(folder / args[0]), *args[1:]]),  # noqa: E731
                                       check=True, capture_output=True, text=True)
    try:
        run("initdb", "-D", str(data), "--auth=trust", "-U", "postgres", "--no-sync")
        run("pg_ctl", "-D", str(data), "-w", "-l", str(root / "server.log"), "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_server_user([str(folder / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def database_url(kind: str, folder: Path):
    """A fresh store URL of the given kind ("sqlite" in `folder`, or "postgresql" on a throwaway
    server), for fixtures parametrized over both; skips, saying why, where PostgreSQL is absent."""
    if kind == "sqlite":
        yield f"sqlite:///{folder}/store.db"
        return
    if binaries() is None:
        import pytest
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian package `postgresql`; .ci/run installs it)")
    with postgres_server() as server_url:
        yield server_url
