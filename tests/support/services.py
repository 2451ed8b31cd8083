"""pytest fixtures that start real services on loopback for the tests that need them.

Import the fixtures into a test module (or conftest.py):

    from tests.support.services import s3_server, mlflow_server  # noqa: F401

Both are session-scoped: the first test that asks starts the server, the session's end stops it.
"""

from __future__ import annotations

import pytest

from infra.services import MlflowServer, SeaweedS3


@pytest.fixture(scope="session")
def s3_server():
    """A SeaweedFS S3 server with bucket "flyroll"; `.storage_options`, `.env`, `.bucket`."""
    with SeaweedS3(bucket="flyroll") as s3:
        yield s3


@pytest.fixture(scope="session")
def mlflow_server(s3_server):
    """An MLflow tracking server (SQLite store) whose artifacts go to s3://flyroll/mlflow."""
    with MlflowServer(s3=s3_server) as server:
        yield server
