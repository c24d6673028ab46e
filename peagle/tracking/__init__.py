"""MLflow (and wandb) as peagle uses them: runs, live step metrics, datasets, parameters
scrubbed of credentials (``mlflow_run``, ``datasets``, ``scrub``, ``wandb_mirror``). It knows
no stage: what each stage records and what the registry does with a head is ``peagle.publish``.
Import the modules themselves: ``import peagle.tracking`` loads no MLflow (a slow import).
"""
