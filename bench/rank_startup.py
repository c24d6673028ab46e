"""Training rank start-up: what a rank's process pays to import its code before its first step.

Every ``peagle train`` starts its ranks as fresh processes (``python -m peagle.rank`` under
torchrun), and each imports torch, transformers, DeepSpeed and peagle's trainer. DeepSpeed
imports MLflow wherever it is installed (for an autotuner peagle never runs), and transformers
imports scikit-learn with any model class (for assisted generation, which a rank never runs),
so a rank's process marks both absent before its imports (``peagle.rank.ABSENT_IN_A_RANK``).
This times a process that imports what a rank imports, both ways, in turn within each round
(the order alternating):
- as ranks run: ``peagle.rank`` run as its own program (to its argument parsing), then ``deepspeed``;
- both importable: ``peagle.rank`` imported as a library (as the launcher's process does), then ``deepspeed``.
Reported per process: wall seconds and CPU seconds (user + system, from the OS's accounting of
the finished child), and which of the two it imported; then the first over the second per round.

    .venv/bin/python bench/rank_startup.py [--rounds 5]
    .venv/bin/python bench/rank_startup.py --render-only

Results go to ``results/rank_startup.*``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAME = "rank_startup"
IMPORTED = "import deepspeed, sys; print(*(sys.modules.get(m) is not None for m in ('mlflow', 'sklearn')))"
AS_A_RANK = ("import runpy, sys; sys.argv = ['peagle.rank', '--help']\n"
             "try: runpy.run_module('peagle.rank', run_name='__main__', alter_sys=True)\n"
             "except SystemExit: pass\n")
WAYS = {
    "as ranks run (MLflow, scikit-learn absent)": AS_A_RANK + IMPORTED,
    "both importable": "import peagle.rank\n" + IMPORTED,
}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_process(code: str) -> dict:
    """One fresh interpreter running ``code``: its wall and CPU seconds, and whether it imported
    MLflow and scikit-learn."""
    cpu, start = children_cpu_s(), time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    mlflow, sklearn = (word == "True" for word in done.stdout.strip().splitlines()[-1].split())
    return {"wall_s": round(wall, 2), "cpu_s": round(children_cpu_s() - cpu, 2),
            "imports_mlflow": mlflow, "imports_sklearn": sklearn}


def tables(result: dict):
    runs = result["runs"]
    rows = [[str(r["round"]), r["way"], f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}",
             "yes" if r["imports_mlflow"] else "no", "yes" if r["imports_sklearn"] else "no"] for r in runs]
    first, second = WAYS
    ratios = []
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["way"]: r for r in runs if r["round"] == rnd}
        ratios.append([str(rnd), f"{by[first]['wall_s'] / by[second]['wall_s']:.2f}x",
                       f"{by[first]['cpu_s'] / by[second]['cpu_s']:.2f}x",
                       f"{by[second]['cpu_s'] - by[first]['cpu_s']:.1f}"])
    if len(ratios) > 1:  # a round the shared machine slowed for one process only is one of several
        wall, cpu, saved = ([float(r[i].rstrip("x")) for r in ratios] for i in (1, 2, 3))
        ratios.append(["median", f"{median(wall):.2f}x", f"{median(cpu):.2f}x", f"{median(saved):.1f}"])
    return [
        ("A training rank's imports in a fresh process",
         ["round", "imports", "wall s", "CPU s", "imports MLflow", "imports scikit-learn"], rows),
        (f"{first} over {second}", ["round", "wall", "CPU", "CPU s saved"], ratios),
    ]


def notes(result: dict) -> list[str]:
    return ["Each ratio is taken within one round, the two processes back to back: the cores are shared.",
            "A rank then builds its DeepSpeed engine and takes steps; those are the same both ways."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    if args.render_only:
        return render_saved(NAME, tables, notes)
    result = started() | {"runs": []}
    timed_process(WAYS["both importable"])  # the files in the page cache before either is timed
    for rnd in range(args.rounds):
        for way in (list(WAYS) if rnd % 2 == 0 else list(WAYS)[::-1]):
            run = timed_process(WAYS[way]) | {"way": way, "round": rnd}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    report(NAME, result, tables(result), notes(result))


if __name__ == "__main__":
    main()
