"""peagle's own log lines, and where the libraries' noise goes.

The library logs through std ``logging`` under ``peagle.*`` and never decides where lines
end up: the CLI prints them (``show_on_console``), the Prefect flows send them to the run's
logs (``flows/logs.py``). vLLM, DeepSpeed, torch and transformers write to the process's
stdout/stderr, also from the engine and rank processes they start (which inherit those file
descriptors): ``library_output_to`` sends the descriptors to a log file under the run
directory (``RunLayout.library_log``) while our own console handlers and progress bars
(``console_stream``) keep writing to the terminal, so our lines stay readable and the
libraries' output is still there to read when something fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from peagle.layout import RunLayout

ROOT = "peagle"
# Loggers whose records are ours to show: peagle's, and Prefect's run/state lines.
OWN_LOGGERS = (ROOT, "prefect")
CONSOLE_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"

_redirect_depth = 0
_console = None  # the terminal while library_output_to holds fds 1 and 2


def console_stream():
    """Where our progress bars write: the terminal, also while ``library_output_to`` sends
    fds 1 and 2 to the library log."""
    return _console or sys.stderr


def show_on_console(level: int = logging.INFO) -> None:
    """Print ``peagle.*`` records at ``level`` on stderr (the CLI); idempotent."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(getattr(h, "_peagle_console", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(CONSOLE_FORMAT, datefmt="%H:%M:%S"))
        handler._peagle_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False  # the root logger's handlers would print it twice


def is_own(record: logging.LogRecord) -> bool:
    """peagle's and Prefect's lines, and any library's errors: what the console shows."""
    return record.levelno >= logging.ERROR or record.name.split(".", 1)[0] in OWN_LOGGERS


class _OwnLinesOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return is_own(record)


class _LibraryLinesOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not is_own(record)


def _console_handlers() -> list[logging.StreamHandler]:
    """Handlers printing to this process's stdout/stderr on the root and peagle loggers."""
    found = []
    for logger in (logging.getLogger(), logging.getLogger(ROOT)):
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) \
                    and getattr(h, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                found.append(h)
    return found


def _set_stream(handler: logging.StreamHandler, stream) -> None:
    handler.setStream(stream)
    console = getattr(handler, "console", None)  # Prefect's console handler prints through rich
    if console is not None and hasattr(console, "file"):
        console.file = stream


@contextlib.contextmanager
def library_output_to(path: Path) -> Iterator[Path]:
    """Send everything written to fds 1 and 2 (this process and its children) to ``path``.

    Console handlers of the root and ``peagle`` loggers keep writing to the original
    stderr, showing only our own records (``is_own``); other libraries' log records go to
    ``path`` too. Re-entrant: an inner call (a subflow) keeps the outer file.
    """
    global _redirect_depth, _console
    path = Path(path)
    if _redirect_depth:
        _redirect_depth += 1
        try:
            yield path
        finally:
            _redirect_depth -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    console = os.fdopen(os.dup(saved_err), "w", buffering=1, encoding="utf-8", errors="replace")
    handlers = _console_handlers()
    previous = {h: h.stream for h in handlers}
    own, library = _OwnLinesOnly(), _LibraryLinesOnly()
    formatter = logging.Formatter(CONSOLE_FORMAT, datefmt="%H:%M:%S")
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(formatter)
    file_handler.addFilter(library)
    added = [file_handler]
    if not any(h in previous for h in logging.getLogger().handlers):  # no console on the root logger:
        errors = logging.StreamHandler(console)  # libraries' errors still reach the user
        errors.setFormatter(formatter)
        errors.setLevel(logging.ERROR)
        added.append(errors)
    for h in handlers:
        _set_stream(h, console)
        h.addFilter(own)
    for h in added:
        logging.getLogger().addHandler(h)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    _redirect_depth, _console = 1, console
    try:
        yield path
    finally:
        _redirect_depth, _console = 0, None
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        for h in added:
            logging.getLogger().removeHandler(h)
        file_handler.close()
        for h, stream in previous.items():
            h.removeFilter(own)
            _set_stream(h, stream)
        console.close()


def run_library_output(run_dir: Path) -> contextlib.AbstractContextManager[Path]:
    """``library_output_to`` the run's library log (``RunLayout.library_log``): what the flows
    and the stage commands wrap a stage in."""
    return library_output_to(RunLayout(run_dir).library_log)
