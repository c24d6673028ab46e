"""What a command needs running beside it, and the one error that says one is missing.

A command needs some of: a Prefect API (``peagle run``, ``retrain``, ``deploy``), an MLflow
tracking server when the tracking URI is a remote one (``run``, ``retrain``, ``pull``,
``train`` with ``train.init_from: champion``), vLLM and a device it runs on (``data``,
``export``, ``evaluate``, ``serve``, ``run``, ``retrain``). Each service's owner checks it
where peagle first contacts it (``flows.require_prefect_api``,
``peagle.tracking.mlflow_run.require_tracking_server``, ``peagle.serving.engine.require_vllm``)
and raises ``ServiceUnavailable``; the CLI prints its one line and exits with
``EXIT_UNAVAILABLE``, with no traceback.
"""

from __future__ import annotations

import os

EXIT_UNAVAILABLE = getattr(os, "EX_UNAVAILABLE", 69)  # sysexits.h: "a service is unavailable"


class ServiceUnavailable(RuntimeError):
    """A service a command needs is missing or down. The message is one line: the service,
    what is wrong with it, and how to start it or point peagle at a running one."""

    def __init__(self, service: str, problem: str, fix: str, *, transient: bool = False):
        self.service, self.problem, self.fix = service, problem, fix
        self.transient = transient  # a server that may answer again (worth a retry), not a missing package
        super().__init__(f"{service} {problem}: {fix}")


def reason(err: BaseException) -> str:
    """An exception as a short phrase for a message: its type and first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
