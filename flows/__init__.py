"""Prefect flows and deployments: the only place that imports prefect.

Prefect reads its settings once, at import: point every cache and store at the project
home (``peagle.paths.configure_environment``) before prefect loads. peagle's own log
lines (``peagle.*`` loggers) go to every flow and task run's logs at INFO.
"""

from peagle.paths import configure_environment as _configure_environment

_configure_environment()

from flows.common import send_peagle_logs_to_prefect as _send_peagle_logs_to_prefect  # noqa: E402

_send_peagle_logs_to_prefect()
