"""The program every training rank of the pipeline runs: the trainer's rank
(``peagle.train.launch.rank_main``), handed offline evaluation (``peagle.eval.offline``) as a
function, so checkpoints are chosen by simulated acceptance. It sits above training and
evaluation both: training never reaches evaluation, by import or by name.
``peagle.stages.train_head`` launches it (``launch_training(..., rank_module=RANK_MODULE)``)::

    python -m peagle.rank --config-json OUT/launch_config.json --data-dir ... --target ... --out OUT
"""

from __future__ import annotations

import sys

from peagle.paths import mark_absent

RANK_MODULE = "peagle.rank"  # this module, by the name ranks start it under (-m runs it as __main__)
# Never used in a rank, and seconds of every rank's start-up on a small CPU where installed
# (bench/results/rank_startup.md): MLflow, which DeepSpeed imports for its autotuner (the
# launcher's process tracks the run), and scikit-learn, which transformers imports with any model
# class. A rank's process marks them absent before its imports below; a process that imports
# this module as a library (the launcher's, through peagle.stages) keeps them.
ABSENT_IN_A_RANK = ("mlflow", "sklearn")

if __name__ == "__main__":
    mark_absent(*ABSENT_IN_A_RANK)

from peagle.eval.offline import offline_eval_fn  # noqa: E402 (after a rank's process marks what it never imports)
from peagle.train.launch import rank_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return rank_main(argv, prog=f"python -m {RANK_MODULE}", make_eval_fn=offline_eval_fn)


if __name__ == "__main__":
    sys.exit(main())
