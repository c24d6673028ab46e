"""Prefect flows and deployments: the only place that imports prefect.

Prefect reads its settings once, at import: the process environment is set up
(``peagle.paths.configure_environment``) before prefect loads. Prefect's home, profile and
API stay the user's: with no API configured, Prefect starts its own ephemeral server.
peagle's own log lines (``peagle.*`` loggers) go to every flow and task run's logs at INFO.
"""

from peagle.paths import configure_environment as _configure_environment

_configure_environment()


def prefect_settings() -> dict:
    """The Prefect profile, API and home this process resolved; ``api_url`` None means
    Prefect's ephemeral server."""
    from prefect.context import get_settings_context

    ctx = get_settings_context()
    return {"profile": ctx.profile.name, "api_url": ctx.settings.api.url, "home": str(ctx.settings.home)}


from flows.common import send_peagle_logs_to_prefect as _send_peagle_logs_to_prefect  # noqa: E402

_send_peagle_logs_to_prefect()
