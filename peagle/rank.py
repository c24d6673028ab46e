"""The program every training rank of the pipeline runs: the trainer's rank
(``peagle.train.launch.rank_main``), handed offline evaluation (``peagle.eval.offline``) as a
function, so checkpoints are chosen by simulated acceptance. It sits above training and
evaluation both: training never reaches evaluation, by import or by name.
``peagle.stages.train_head`` launches it (``launch_training(..., rank_module=RANK_MODULE)``)::

    python -m peagle.rank --config-json OUT/launch_config.json --data-dir ... --target ... --out OUT
"""

from __future__ import annotations

import sys

from peagle.eval.offline import offline_eval_fn
from peagle.train.launch import rank_main

RANK_MODULE = "peagle.rank"  # this module, by the name ranks start it under (-m runs it as __main__)


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, prog=f"python -m {RANK_MODULE}", make_eval_fn=offline_eval_fn)


def without_mlflow() -> None:
    """Mark MLflow absent in this rank's process, as where it is not installed. A rank never logs
    to MLflow (the launcher's process tracks the run), but ``import deepspeed`` imports MLflow
    whenever it can, for an autotuner peagle never runs; that import alone costs every rank
    seconds of start-up on a small CPU (bench/results/rank_startup.md). An MLflow the process
    already imported is kept."""
    sys.modules.setdefault("mlflow", None)


if __name__ == "__main__":
    without_mlflow()
    sys.exit(main())
