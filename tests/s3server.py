"""pytest fixtures: a moto S3 server on 127.0.0.1 (free port), dummy credentials, s3fs options.

Use in a test module with ``from tests.s3server import s3_server, s3_options, s3_bucket``.
"""

from __future__ import annotations

import os
import uuid

import pytest

_DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="module")
def s3_server():
    """Start moto's threaded server on a free loopback port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _DUMMY_ENV}
    os.environ.update(_DUMMY_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def s3_options(s3_server):
    """storage_options for s3fs / fsspec pointing at the loopback server."""
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": s3_server, "region_name": "us-east-1"}}


@pytest.fixture
def s3_bucket(s3_options):
    """A fresh, empty bucket; yields its name."""
    import boto3

    name = f"dlbatch-test-{uuid.uuid4().hex[:10]}"
    client = boto3.client("s3", endpoint_url=s3_options["client_kwargs"]["endpoint_url"],
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    client.create_bucket(Bucket=name)  # us-east-1: no location constraint
    yield name
