"""A Ctrl-C is recorded before Python raises it, so an error it causes elsewhere (vLLM's engine
dying of the same signal, reported as an engine error) still reads as the interruption it is."""

import subprocess
import sys
import textwrap

from tests.peagle_cli import REPO

SCRIPT = textwrap.dedent("""
    import os, signal
    from peagle.interrupt import interrupted, record_interrupts

    print("before:", interrupted())
    record_interrupts()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**7):
                pass
        except KeyboardInterrupt:
            raise RuntimeError("engine core died")  # a library turning the interruption into its own error
    except RuntimeError:
        print("after:", interrupted())
""")


def test_a_ctrl_c_turned_into_another_error_is_still_known_as_an_interruption():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["before: False", "after: True"], done.stdout
