"""Library output goes to the run's log file; peagle's own lines stay on the console.

Run in a fresh interpreter, as the CLI or a worker's flow-run process is: pytest's own
capture replaces ``sys.stdout`` and would hide what the descriptors do.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import logging, subprocess, sys
    from pathlib import Path
    import transformers  # sets up its own stderr handler, as in a real run
    from peagle.logs import library_output_to, show_on_console

    tmp = Path(sys.argv[1])
    show_on_console()
    with library_output_to(tmp / "logs" / "libraries.log"):
        logging.getLogger("peagle.data.pipeline").info("data: 40 train + 8 held-out prompts")
        # an engine or rank subprocess inherits the descriptors: its output lands in the file
        subprocess.run([sys.executable, "-c", "import sys; print('INFO vllm engine core started');"
                        "print('[W] gloo warning', file=sys.stderr)"], check=True)
        print("a library's print")
        transformers.logging.get_logger("transformers.modeling_utils").warning("Some weights were not initialized")
        logging.getLogger("urllib3").warning("Retrying connection")
        with library_output_to(tmp / "inner.log"):  # a subflow keeps the outer file
            logging.getLogger("deepspeed").warning("DeepSpeed says hello")
            logging.getLogger("vllm").error("engine failed: out of memory")  # errors stay visible
    logging.getLogger("peagle.train.launch").info("after the run")
    print("summary table")
""")


def test_library_output_goes_to_the_file_and_our_lines_to_the_console(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    console = proc.stdout + proc.stderr
    library_log = (tmp_path / "logs" / "libraries.log").read_text()
    for ours in ("data: 40 train + 8 held-out prompts", "after the run", "summary table",
                 "engine failed: out of memory"):
        assert ours in console
    for noise in ("vllm engine core", "gloo warning", "a library's print", "not initialized",
                  "Retrying connection", "DeepSpeed says"):
        assert noise not in console
        assert noise in library_log
    assert "held-out prompts" not in library_log
    assert not (tmp_path / "inner.log").exists()
