"""A Ray cluster of a test's own on 127.0.0.1 (`ray start --head --block`, its own temp dir,
free ports, its own process group and auth token) and the `dlbatch` command run against
it. Used by tests/test_cluster.py and tests/test_submit_preflight.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TINY = ["--set", "input.limit=1", "--set", "tasks.0.max_tokens=6", "--set", "tasks.1.max_tokens=4",
        "--set", "tasks.2.max_tokens=4", "--set", "model.max_model_len=2048"]
JOB_TIMEOUT = 600


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


CLUSTER_TOKEN = uuid.uuid4().hex + uuid.uuid4().hex  # the test clusters' own (not ~/.ray/auth_token)


def cluster_env(**extra) -> dict:
    """Environment of the cluster and of every command run against it: token authentication
    on with a token of our own (whatever ~/.ray/auth_token holds), the venv's python first."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = CLUSTER_TOKEN
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_ADDRESS", None)  # Ray prefers it over any explicit address
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update(extra)
    return env


class LocalCluster:
    """`ray start --head --block` in its own session; stop() kills exactly what it started."""

    def __init__(self, resources: dict, num_cpus: int = 8, ray_bin: str | None = None, env: dict | None = None):
        self.resources, self.num_cpus = resources, num_cpus
        self.ray_bin = ray_bin or str(VENV_BIN / "ray")  # another python's `ray` (tests/test_submit_preflight.py)
        self.env = env  # the cluster's environment (default: cluster_env())
        self.proc = None
        self.pids: dict[int, float] = {}

    def _prepare(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="dlbray-")  # short: Ray's unix sockets live under it
        (self.gcs_port, self.dash_port, client_port, agent_http, agent_grpc, rt_env, metrics, node_mgr,
         obj_mgr) = free_ports(9)
        self.cmd = [self.ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                    "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--port={self.gcs_port}",
                    f"--dashboard-port={self.dash_port}", f"--ray-client-server-port={client_port}",
                    f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
                    f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
                    f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
                    f"--num-cpus={self.num_cpus}", f"--resources={json.dumps(self.resources)}",
                    f"--temp-dir={self.temp_dir}", "--disable-usage-stats", "--object-store-memory=500000000"]
        self.log = open(os.path.join(self.temp_dir, "ray-start.log"), "wb")
        self.pids = {}

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dash_port}"

    @property
    def gcs(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start(self, timeout: float = 150.0, attempts: int = 3) -> None:
        """Ray gives a raylet a hard-coded 30 s to register; on a loaded machine that can run
        out, and then `ray start` exits. Such a start is cleaned up and tried again."""
        errors = []
        for _ in range(attempts):
            self._prepare()
            try:
                self._start_once(timeout)
                return
            except RuntimeError as e:
                errors.append(str(e)[-1500:])
                self.stop()
        raise RuntimeError("could not start the test cluster:\n" + "\n---\n".join(errors))

    def _start_once(self, timeout: float) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env or cluster_env(),
                                     start_new_session=True, cwd=self.temp_dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: {self.start_log()[-3000:]}")
            self._record_pids()
            if "Ray runtime started" in self.start_log() and self._jobs_api_ready():
                time.sleep(2)  # `ray start` may still give up right after printing
                if self.proc.poll() is None:
                    self._record_pids()
                    return
            time.sleep(1)
        raise RuntimeError(f"the Ray head did not come up in {timeout} s: {self.start_log()[-3000:]}")

    def _jobs_api_ready(self) -> bool:
        """The Jobs API lists jobs (through Ray's client, which adds the auth token when the
        cluster uses token authentication)."""
        try:
            with urllib.request.urlopen(self.dashboard + "/api/version", timeout=3):
                pass
        except urllib.error.HTTPError:
            pass  # it answered
        except OSError:
            return False
        from ray.job_submission import JobSubmissionClient

        try:
            JobSubmissionClient(self.dashboard, headers={"Authorization": f"Bearer {CLUSTER_TOKEN}"}).list_jobs()
            return True
        except Exception:
            return False

    def start_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def _record_pids(self) -> None:
        """Remember (pid, create_time) of the head's process tree and of every process whose
        command line names our temp dir, so that stop() signals exactly those."""
        import psutil

        procs = []
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp_dir in a for a in (p.info["cmdline"] or [])):
                    procs.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        for p in procs:
            try:
                self.pids[p.pid] = p.create_time()
            except psutil.NoSuchProcess:
                pass

    def _ours(self):
        import psutil

        for pid, created in list(self.pids.items()):
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    yield p
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        if self.proc is None:
            return
        self._record_pids()
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:  # start_new_session: the group id is the leader's pid
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for p in self._ours():
                try:
                    p.send_signal(sig)
                except Exception:
                    pass
            gone_by = time.monotonic() + wait
            while time.monotonic() < gone_by and self.alive_pids():
                time.sleep(0.3)
            if not self.alive_pids():
                break
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def alive_pids(self) -> list[int]:
        return [p.pid for p in self._ours()]


def run_dlbatch(*args, timeout: float = JOB_TIMEOUT, cwd=ROOT, check: bool = False,
                env=None) -> subprocess.CompletedProcess:
    """`python -m dlbatch.cli *args` (in the repository, with cluster_env() unless `env`)."""
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", *args], cwd=cwd, env=env or cluster_env(),
                       capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"dlbatch {' '.join(args)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r
