"""Track and publish, the pipeline's last stage: what each stage's results record in MLflow
(``records``), a head registered as a model version (``registry``), the gate that promotes it
only when it beats the champion measured beside it, and the retraining plan (``gate``),
publishing a pipeline run's head once (``promote``), and a registry consumer's verified download
(``pull``). It sits above export and evaluation, whose results it reads, and reaches MLflow
through ``peagle.tracking``.
"""
