"""One Prefect test server for every test under tests/flows (it takes 10-60 s to start here)."""

import pytest


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
