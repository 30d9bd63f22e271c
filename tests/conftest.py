"""Shared fixtures: one local Ray for the whole test session, bound to 127.0.0.1, with the
chip resources the sample jobs use (cpu-local: the solver's layout of a local run; fast and
cheap: the pools jobs/papers_pd.yaml names); a Ray temp dir of a test's own (raytmp); a moto S3
server on 127.0.0.1 (s3_server, s3_options, s3_bucket). Shared helpers that are not
fixtures live in tests/helpers/. ``DLBATCH_TEST_HIDE=libibverbs`` hides that system library
from the test process (tests/helpers/optional.py)."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")

from tests.helpers.optional import hide_from_environment  # noqa: E402

hide_from_environment()  # DLBATCH_TEST_HIDE=libibverbs: the tests as a machine without that library runs them


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, resources={"chip:fast": 4, "chip:cheap": 4, "chip:cpu-local": 4},
                 include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def sample_model():
    """Make sure the bundled GGUF is converted once (cache) before workers start."""
    from dlbatch.engine.loader import model_dir

    model_dir("smollm2-135m-instruct")
    return "smollm2-135m-instruct"


@pytest.fixture
def raytmp():
    """A short temp dir for a Ray started by the test (its RAY_TMPDIR); every process that
    names it is killed afterwards."""
    from tests.helpers.jobs import procs_with

    d = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    yield d
    for p in procs_with(d):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- S3 (moto)
_DUMMY_AWS_ENV = {
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

    saved = {k: os.environ.get(k) for k in _DUMMY_AWS_ENV}
    os.environ.update(_DUMMY_AWS_ENV)
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
