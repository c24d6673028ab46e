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


PREFECT_CHECK_TIMEOUT_S = 10.0  # an API slower than this to answer its health check is down for us
POINT_AT_PREFECT = "`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`, or `prefect cloud login`"


def require_prefect_api() -> str | None:
    """The Prefect API this process uses answers its health check; else ``ServiceUnavailable``
    naming it and how to start one. Returns its URL; None where none is configured and Prefect
    runs flows on a temporary server of its own (refused when
    PREFECT_SERVER_ALLOW_EPHEMERAL_MODE is off)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from peagle.services import ServiceUnavailable, reason

    settings = get_current_settings()
    url = settings.api.url
    if not url:
        if settings.server.ephemeral.enabled:
            return None
        raise ServiceUnavailable("Prefect API", "is not configured (PREFECT_API_URL is unset and "
                                 "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE is off)",
                                 f"start one (`prefect server start`) and point PREFECT_API_URL at it ({POINT_AT_PREFECT})")
    with get_client(httpx_settings={"timeout": PREFECT_CHECK_TIMEOUT_S}, sync_client=True) as client:
        failed = client.api_healthcheck()
    if failed is not None:
        raise ServiceUnavailable(f"Prefect API {url}", f"does not answer ({reason(failed)})",
                                 f"start it (`prefect server start`) or point PREFECT_API_URL at a running one "
                                 f"({POINT_AT_PREFECT})")
    return url


from flows.common import send_peagle_logs_to_prefect as _send_peagle_logs_to_prefect  # noqa: E402

_send_peagle_logs_to_prefect()
