"""The ``peagle`` command as users run it, for tests of what it says: a subprocess of this
checkout (``python -m peagle.cli``, the console script's entry point), its output read back
as one line of words (rich wraps long messages at the terminal width)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Result:
    returncode: int
    output: str  # stdout and stderr, whitespace runs as one space
    last_line: str = ""  # the last non-empty line the command wrote (stdout, else stderr), as written

    def __contains__(self, text: str) -> bool:
        return " ".join(text.split()) in self.output


def peagle(*args: str, env: dict | None = None, cwd: Path = REPO, timeout: int = 600) -> Result:
    environ = {**os.environ, **(env or {}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "peagle.cli", *map(str, args)], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in (done.stdout.splitlines() or done.stderr.splitlines()) if line.strip()]
    return Result(done.returncode, " ".join((done.stdout + "\n" + done.stderr).split()), lines[-1] if lines else "")


def assert_refused(result: Result, *says: str, code: int = 2) -> None:
    """Refused with exit ``code``, as a message (no traceback) holding each of ``says``."""
    assert result.returncode == code, result.output
    assert "Traceback" not in result.output, result.output
    for text in says:
        assert text in result, f"{text!r} not in: {result.output}"
