"""Prefect flows and deployments: the only place that imports prefect.

Prefect reads its settings once, at import: point every cache and store at the project
home (``peagle.paths.configure_environment``) before prefect loads.
"""

from peagle.paths import configure_environment as _configure_environment

_configure_environment()
