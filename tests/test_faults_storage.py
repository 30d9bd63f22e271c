"""Storage fault drills through JobRunner, input changes, and the point-7 fixes (per-user
cache, shm same-node check and segment cleanup)."""
from __future__ import annotations

import json
import os
import stat

import pytest


from dlbatch.testing.faultfs import FaultPlan, install
from tests.helpers.fake_workers import FakeWorker
from tests.helpers.jobs import PD_POOLS, SEQ, canon, output_rows, run_job, write_jsonl

DOCS3 = {"alpha": "Solar cells convert light into electricity with perovskite absorbers. " * 4,
         "beta": "Songbirds migrate at night and time their departure by day length. " * 4,
         "gamma": "Glaciers carve valleys as they slide over bedrock under their own weight. " * 4}
# short documents: a small batch budget keeps them one document per batch, so one per part
ONE_PER_PART = [*SEQ, "batching.max_batch_tokens=300"]


@pytest.fixture
def plan():
    from connectors.io_retry import IOBackoff, set_default_policy

    prev = set_default_policy(IOBackoff(max_attempts=3, initial_wait_s=0.01, max_wait_s=0.05, jitter_s=0.01))
    p = install(FaultPlan())
    yield p
    install(FaultPlan())
    set_default_policy(prev)


def _exactly_once(out):
    rows = output_rows(out)
    keys = [(r["doc_id"], r["task"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * len(DOCS3), sorted(keys)
    return canon(rows)


@pytest.mark.ray
def test_drills_reply_lost_and_disk_full_exactly_once_equal_to_clean_run(ray_local, sample_model, tmp_path, plan):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS3)
    extra = [f"input.path={src}", "input.id_field=id", "model.dtype=float32", *ONE_PER_PART]
    run_job("jobs/papers_jsonl.yaml", str(tmp_path / "clean"), extra, flush_docs=1)
    clean = _exactly_once(str(tmp_path / "clean"))

    # every part commit's rename lands but reports an error: the run completes, no row twice
    out = f"faultfile://{tmp_path}/lost"
    plan.reply_lost = 100
    rep = run_job("jobs/papers_jsonl.yaml", out, extra, flush_docs=1)
    assert plan.injected["reply_lost"] >= 2 and rep["docs_ok"] == 3  # parts and their index files
    assert _exactly_once(out) == clean

    # the disk fills up after the first part: the job fails naming ENOSPC; space freed, rerun
    out = f"faultfile://{tmp_path}/full"
    install(FaultPlan(full_after_commits=1))
    with pytest.raises(OSError) as ei:
        run_job("jobs/papers_jsonl.yaml", out, extra, flush_docs=1)
    assert ei.value.errno == 28
    first = output_rows(out)
    assert 0 < len(first) and len(first) % 3 == 0  # whole documents only (the rest failed on ENOSPC)
    install(FaultPlan())
    rep = run_job("jobs/papers_jsonl.yaml", out, extra, flush_docs=1)
    assert rep["docs_this_run"] == 3 - len(first) // 3
    assert _exactly_once(out) == clean


@pytest.mark.ray
def test_appended_rows_and_raised_limit_are_processed_committed_not_redone(ray_local, sample_model, tmp_path):
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, dict(list(DOCS3.items())[:2]))
    out = str(tmp_path / "out")
    extra = [f"input.path={path}", "input.id_field=id", "input.limit=1"]
    assert run_job("jobs/papers_jsonl.yaml", out, extra)["docs_ok"] == 1
    rep = run_job("jobs/papers_jsonl.yaml", out, extra[:2])  # limit lifted: not "nothing to do"
    assert not rep.get("noop") and rep["docs_this_run"] == 1 and rep["docs_ok"] == 2
    assert run_job("jobs/papers_jsonl.yaml", out, extra[:2]).get("noop")  # nothing changed: nothing to do
    with open(path, "a") as f:  # a row appended to the same file
        f.write(json.dumps({"id": "gamma", "text": DOCS3["gamma"]}) + "\n")
    rep = run_job("jobs/papers_jsonl.yaml", out, extra[:2])
    assert not rep.get("noop") and rep["docs_this_run"] == 1 and rep["docs_ok"] == 3
    keys = [(r["doc_id"], r["task"]) for r in output_rows(out)]
    assert len(keys) == len(set(keys)) == 9


@pytest.mark.ray
def test_a_replaced_input_is_redone_and_a_deleted_one_reported(ray_local, sample_model, tmp_path):
    """A text file replaced in place by a same-size file that keeps its mtime is redone, its
    old rows gone (not a no-op, not duplicates); a deleted input is reported, its rows kept."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name, v in zip("ab", list(DOCS3.values())[:2]):
        (folder / f"{name}.txt").write_text(v)
    out = str(tmp_path / "out")
    extra = [f"input.path={folder}", "input.format=text"]
    assert run_job("jobs/papers_jsonl.yaml", out, extra)["docs_ok"] == 2
    b = folder / "b.txt"
    old_text = b.read_text()
    st = b.stat()
    new_text = old_text.replace("a", "o")
    assert len(new_text) == len(old_text) and new_text != old_text
    b.write_text(new_text)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    rep = run_job("jobs/papers_jsonl.yaml", out, extra)
    assert not rep.get("noop") and rep["inputs_replaced"]["count"] == 1 and rep["docs_this_run"] == 1
    rows = output_rows(out)
    keys = [(r["doc_id"], r["task"]) for r in rows]
    assert len(keys) == len(set(keys)) == 6 and {r["source"] for r in rows} == {str(folder / "a.txt"), str(b)}
    b.unlink()
    rep = run_job("jobs/papers_jsonl.yaml", out, extra)
    assert rep["inputs_deleted"]["count"] == 1 and rep["inputs_deleted"]["sources"][0].endswith("b.txt")
    assert rep["docs_ok"] == 2 and len(output_rows(out)) == 6


# ------------------------------------------------------------------------ per-user cache
def test_user_cache_dir_is_private_and_checked(tmp_path, monkeypatch):
    from dlbatch.cache import secure_dir, user_cache_dir

    monkeypatch.setenv("DLBATCH_CACHE", str(tmp_path / "c"))
    d = user_cache_dir("native")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and stat.S_IMODE(os.stat(d.parent).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    assert stat.S_IMODE(os.stat(secure_dir(loose)).st_mode) == 0o700  # ours: tightened
    (tmp_path / "link").symlink_to(loose)
    with pytest.raises(PermissionError, match="symlink"):
        secure_dir(tmp_path / "link")
    if os.getuid() == 0:  # only root can give a directory to someone else
        other = tmp_path / "other"
        other.mkdir()
        os.chown(other, 12345, 12345)
        with pytest.raises(PermissionError, match="belongs to uid 12345"):
            secure_dir(other)


def test_native_helper_compiled_into_private_cache_and_recompiled_when_writable(tmp_path, monkeypatch):
    import shutil

    from dlbatch import cbuild as native

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("DLBATCH_CACHE", str(tmp_path / "c"))
    src = tmp_path / "_k.c"
    src.write_text("int dl_k(int x) { return x + 1; }\n")
    assert native.load(src).dl_k(41) == 42
    (so,) = list((tmp_path / "c" / "native").glob("k-*.so"))
    assert stat.S_IMODE(os.stat(so).st_mode) == 0o700
    os.chmod(so, 0o777)  # someone could have written it: not loaded, compiled again
    ino = os.stat(so).st_ino
    assert native.load(src).dl_k(1) == 2
    assert os.stat(so).st_ino != ino and stat.S_IMODE(os.stat(so).st_mode) == 0o700



def test_native_helper_rebuilt_when_a_local_header_changes(tmp_path, monkeypatch):
    """The build's name hashes the headers the source includes from its own folder: a new
    header gives a new library, never the one built from the old header."""
    import shutil

    from dlbatch import cbuild as native

    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("DLBATCH_CACHE", str(tmp_path / "c"))
    (tmp_path / "_step.h").write_text("#define STEP 1\n")
    src = tmp_path / "_h.c"
    src.write_text('#include "_step.h"\nint dl_h(int x) { return x + STEP; }\n')
    assert native.load(src).dl_h(1) == 2
    (tmp_path / "_step.h").write_text("#define STEP 5\n")
    assert native.load(src).dl_h(1) == 6
    assert len(list((tmp_path / "c" / "native").glob("h-*.so"))) == 2

def test_remote_gguf_copy_goes_to_the_private_cache(tmp_path, monkeypatch):
    import fsspec

    from dlbatch.engine.loader import _local_copy

    monkeypatch.setenv("DLBATCH_CACHE", str(tmp_path / "c"))
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"/storage-test-{os.getpid()}/m.gguf", b"GGUF fake")
    dst = _local_copy(fs, f"/storage-test-{os.getpid()}/m.gguf")
    assert dst.startswith(str(tmp_path / "c" / "remote")) and open(dst, "rb").read() == b"GGUF fake"
    assert stat.S_IMODE(os.stat(os.path.dirname(dst)).st_mode) == 0o700


# ----------------------------------------------------------------------------- shm

def _pools(via, workers):
    from dlbatch.driver.config import RunConfig
    from dlbatch.workers.pools import WorkerPools
    from dlbatch.jobspec import load_job

    p = WorkerPools(RunConfig.resolve(load_job("jobs/papers_jsonl.yaml", PD_POOLS)))
    p.kv_via, p.workers = via, workers
    return p


def test_shm_across_nodes_fails_at_start_naming_the_nodes(monkeypatch):
    import ray

    from dlbatch.workers.pools import JobFailed

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: refs)
    split = {"prefill": [FakeWorker("aaaa")], "decode": [FakeWorker("aaaa"), FakeWorker("bbbb")]}
    with pytest.raises(JobFailed, match=r"kv_transport='shm' needs every prefill and decode worker on one node.*"
                                        r"2 nodes.*decode\[1\]"):
        _pools("shm", split)._check_shm_same_node()
    same = {"prefill": [FakeWorker("aaaa")], "decode": [FakeWorker("aaaa")]}
    _pools("shm", same)._check_shm_same_node()  # one node: fine, and stale segments swept there
    assert same["decode"][0].cleaned == [False]
    _pools("object_store", split)._check_shm_same_node()  # other transports: not concerned


def test_shm_cleanup_sweeps_dead_and_closes_own_pool():
    from dlbatch.transfer import payload as P
    from dlbatch.transfer import shm as S

    meta = P.make_meta("fp-storage-test", "float32", 2, 4, 2, 8)
    S.prewarm(meta, 2)
    mine = [n for n in S.list_segments() if n.startswith(f"{S.PREFIX}{os.getpid()}_")]
    assert len(mine) >= 2
    dead = f"{S.PREFIX}999999999_{os.urandom(4).hex()}"  # a pid that cannot exist
    with open(os.path.join(S.SHM_DIR, dead), "wb") as f:
        f.write(b"\0" * 64)
    assert dead in S.cleanup(close=False) and dead not in S.list_segments()
    assert set(mine) <= set(S.list_segments())  # a live process's segments stay
    S.cleanup(close=True)  # a graceful stop: this process's idle segments go
    assert not set(mine) & set(S.list_segments())
