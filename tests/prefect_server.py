"""A real ``prefect server start`` for tests: a given PREFECT_HOME, a free 127.0.0.1 port.

The suite starts ONE (the session fixture ``prefect_server`` of tests/conftest.py) and points
the test process and the subprocesses it starts at it:

    with prefect_server(home) as server, server.as_default():
        my_flow()                                                       # this process's client
        subprocess.run(["prefect", "deploy", "--all"], env=server.env)  # the CLI as users run it

The server runs as users start it (a subprocess of Prefect's CLI); start-up takes 10-60 s on
a loaded 2-core machine. Stopped (and its process group killed) on exit, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.processes import free_port, process_group, wait_http_ok

PREFECT = str(Path(sys.executable).with_name("prefect"))


@dataclass(frozen=True)
class PrefectServer:
    api_url: str
    home: Path
    env: dict  # the environment a CLI subprocess needs to talk to this server (and only to it)

    @contextlib.contextmanager
    def settings(self):
        """Point this process's Prefect client at the server."""
        from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url, PREFECT_HOME: self.home}):
            yield

    @contextlib.contextmanager
    def as_default(self):
        """This process's client (Prefect's settings) and the subprocesses it starts (os.environ)
        talk to this server until the block ends; queued logs and events are sent before it does."""
        saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
        os.environ.update(PREFECT_API_URL=self.api_url, PREFECT_HOME=str(self.home))
        try:
            with self.settings():
                try:
                    yield self
                finally:
                    send_queued_logs_and_events()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def send_queued_logs_and_events() -> None:
    """Flush Prefect's background log and event workers (as prefect_test_harness does before
    it stops its server), so nothing is sent to a server that is gone."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30, at_exit=False)
    EventsWorker.drain_all(timeout=30, at_exit=False)


def isolated_env(home: Path, api_url: str | None = None) -> dict:
    """os.environ with Prefect confined to ``home`` (no user profile, no telemetry, no network)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_PROFILES_PATH=str(home / "profiles.toml"),
               PREFECT_MEMO_STORE_PATH=str(home / "memo_store.toml"),
               PREFECT_LOCAL_STORAGE_PATH=str(home / "storage"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


@contextlib.contextmanager
def prefect_server(home: Path, timeout_s: float = 180):
    """Start ``prefect server start --host 127.0.0.1 --port P`` with PREFECT_HOME ``home`` (its
    database and ``server.log`` live there); yield a PrefectServer."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    cmd = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with process_group(cmd, log, env=isolated_env(home), stop_timeout_s=30) as proc:
        wait_http_ok(f"{api_url}/health", proc, log, timeout_s, what="prefect server")
        yield PrefectServer(api_url, home, isolated_env(home, api_url))
