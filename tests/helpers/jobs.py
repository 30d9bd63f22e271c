"""Running the sample jobs in tests (in process through JobRunner, or `dlbatch run` in a
subprocess with its own local Ray), reading their committed rows, killing a run, and
checking what it committed. Used by tests/test_reliability.py, test_fault_drills.py,
test_faults_storage.py and test_long_job.py. The `raytmp` fixture is in tests/conftest.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq

from dlbatch.jobspec import load_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["tasks.0.max_tokens=8", "tasks.1.max_tokens=6", "tasks.2.max_tokens=6", "model.max_model_len=2048"]
# one document per batch, one batch in flight: documents finish (and commit) one after another
SEQ = ["batching.max_batch_tokens=4096", "batching.max_inflight_batches=1"]
# prefill/decode pools on the chips the test session's Ray declares (as jobs/papers_pd.yaml names them)
PD_POOLS = ["cluster.prefill.chip=fast", "cluster.decode.chip=cheap"]
KEYCOLS = ["doc_id", "source", "task", "output", "prompt_tokens", "output_tokens", "finish_reason", "truncated"]


def output_rows(out, storage_options=None):
    """Every committed result row of the output at `out`."""
    from dlbatch.output.parquet_store import ParquetStore

    return ParquetStore(out, storage_options).results().to_pylist()


def canon(rows):
    """Rows as sorted KEYCOLS tuples: equal for two runs that wrote the same results."""
    return sorted(tuple(r[c] for c in KEYCOLS) for r in rows)


def run_job(job, out, extra=(), **kw):
    """Run `job` in this process (JobRunner) into `out`, with SHORT and `extra` overrides."""
    from dlbatch.driver.runner import JobRunner

    spec = load_job(job, [f"output.path={out}", *SHORT, *extra])
    return JobRunner(spec, progress=False, **kw).run()


def write_jsonl(path, docs):
    """Write {id: text} as JSONL records {"id", "text"}; returns the path as a string."""
    path.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    return str(path)


def run_until_inflight(spec, timeout=600):
    """A `JobRunner` of `spec` running in a thread, once a batch is in flight (a worker is
    computing); -> (runner, thread, box) as `run_in_thread`."""
    from dlbatch.driver.runner import JobRunner

    runner = JobRunner(spec, progress=False)
    t, box = run_in_thread(runner)
    deadline = time.time() + timeout
    while time.time() < deadline and not runner.inflight and t.is_alive():
        time.sleep(0.05)
    assert runner.inflight, box
    return runner, t, box


def run_in_thread(runner):
    """Start `runner.run()` in a daemon thread; returns (thread, box) where box gets
    "report" or "error"."""
    box = {}

    def target():
        try:
            box["report"] = runner.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def cli_sets(out, extra):
    """`--set` arguments of the CLI for output `out`, SHORT and `extra`."""
    args = []
    for s in [f"output.path={out}", *SHORT, *extra]:
        args += ["--set", s]
    return args


def ray_env(raytmp):
    """Environment of a `dlbatch` subprocess or `ray start` whose Ray lives in `raytmp`."""
    env = dict(os.environ)
    env.update(RAY_TMPDIR=raytmp, PYTHONPATH=REPO, RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="token")  # every node and driver uses the local token (~/.ray/auth_token)
    env.setdefault("RAY_agent_register_timeout_ms", "180000")  # agents start slowly on a busy 2-core machine
    env.pop("RAY_ADDRESS", None)
    return env


def start_run(job, out, extra, raytmp, logf, cli_args=()):
    """`dlbatch run` in a subprocess (its own process group, committing every document)."""
    cmd = [sys.executable, "-m", "dlbatch.cli", "run", job, "--no-progress", "--commit-docs", "1",
           "--commit-seconds", "0", *cli_args, *cli_sets(out, extra)]
    return subprocess.Popen(cmd, cwd=REPO, env=ray_env(raytmp), stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)


def procs_with(marker: str) -> list[int]:
    """Pids whose command line or environment names `marker` (our Ray temp dir / node)."""
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if marker.encode() in cmd or marker.encode() in env:
            out.append(int(d))
    return out


def kill_group_and_ray(proc, raytmp):
    """kill -9 the driver's process group, then every process of its Ray (found by temp dir)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while time.time() < deadline:
        pids = procs_with(raytmp)
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"processes of the killed run survive: {procs_with(raytmp)}")


def committed_parts(out):
    """The committed result and dead-letter parts under `out` (`part-*.parquet`; not the ones
    in `_tmp`, nor bookkeeping such as `_sources.arrow`)."""
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(out) for f in fs
                  if f.startswith("part-") and f.endswith(".parquet") and "_tmp" not in dp)


def check_committed(out, job, extra, raytmp):
    """Every committed part is a whole Parquet file, no (doc, task) twice, and `dlbatch status`
    (in a subprocess, without Ray) says exactly what is committed."""
    for p in committed_parts(out):
        pq.read_table(p)  # a partial file would not parse
    rows = output_rows(out)
    keys = [(r["doc_id"], r["task"]) for r in rows]
    assert len(keys) == len(set(keys)), f"duplicate rows: {keys}"
    st = cli_status(job, out, extra, raytmp)
    by_doc: dict[str, set] = {}
    for d, t in keys:
        by_doc.setdefault(d, set()).add(t)
    assert all(len(ts) == 3 for ts in by_doc.values()), f"a document is partly committed: {by_doc}"
    assert (st["rows"], st["docs_done"], st["duplicate_rows"]) == (len(rows), len(by_doc), 0), st
    assert st["docs_pending"] == st["docs_total"] - len(by_doc) - st["docs_failed"]
    return rows, st


def cli_status(job, out, extra, raytmp):
    """`dlbatch status --json` in a fresh interpreter; it must not import Ray (so cannot start it).
    It leaves with os._exit, as the `dlbatch` command does (dlbatch.cli:entry): Arrow's thread
    pool torn down at interpreter exit can abort the process after its work is done."""
    code = ("import os, sys, json; from dlbatch.cli import main; rc = main(sys.argv[1:]); "
            "print(json.dumps({'ray_imported': 'ray' in sys.modules, 'rc': rc}), flush=True); os._exit(0)")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code, "status", job, "--json", *cli_sets(out, extra)], cwd=REPO,
                       env=ray_env(raytmp), capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr
    st, meta = json.loads(lines[0]), json.loads(lines[1])
    assert meta == {"ray_imported": False, "rc": 0}
    st["_seconds"] = time.time() - t0
    return st
