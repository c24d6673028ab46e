"""Whether the user interrupted this process (Ctrl-C), for the errors an interruption causes.

A Ctrl-C in a terminal reaches every process of the foreground group at once: vLLM's engine
processes may die of it before this process's ``KeyboardInterrupt`` surfaces (or while vLLM
is handling it), and what this process sees first is then an engine that died. A stage that
meets an error after a Ctrl-C reports the interruption it is (``peagle.data.pipeline``), and
the CLI exits as interrupted.
"""

from __future__ import annotations

import signal
import time

_received_at: float | None = None


def record_interrupts() -> None:
    """From now on a SIGINT is recorded, then raises ``KeyboardInterrupt`` as Python's handler does.
    Call from the main thread (the CLI's ``main``)."""

    def on_sigint(signum, frame):
        global _received_at
        _received_at = time.monotonic()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)


def interrupted() -> bool:
    """A Ctrl-C (SIGINT) reached this process since ``record_interrupts``."""
    return _received_at is not None
