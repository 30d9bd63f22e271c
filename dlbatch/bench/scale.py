"""`dlbatch bench scale`: the pipeline's driver-side cost at N documents, with a tiny model.

The model is a tiny random 2-layer llama (`dlbatch/bench/tiny_model.py`, fp32) and every task
asks for 1-2 tokens, so what is timed is everything but the model: input reading, prompt
rendering and tokenizing, dispatch, commits, the index, the report. Inputs: N one-task JSONL
documents of ~--tokens tokens each, seeded, every text distinct (no prefix-cache answers), as
one file (``--files 1``) or split evenly over ``--files`` files of one folder (the same
documents in the same order).

  ours      `dlbatch run JOB --fresh` in a subprocess (its own embedded Ray): the first batch
            (the report's ``data_first_batch``: from the data plan to the first block of
            request rows out of the input pipeline), documents/s over the generation phase
            (the report's first token -> last result) and end to end (the subprocess's wall
            time); the driver's peak RSS (VmHWM of the driver process, polled until it exits)
            and the prompt actors' (the largest VmHWM among the run's Ray processes running
            the prompt stage, polled every half second); the same at N/10 documents for the
            RSS growth. Then, on the complete output, a no-op rerun (`dlbatch run JOB`: must
            print "nothing to do") and `dlbatch status JOB`, wall times.
  baseline  a plain Ray Data job over the same input in a subprocess: read_json -> map_batches
            (tokenizes with the same tokenizer; one row per document with a 1-token "output")
            -> write_parquet; documents/s end to end and after ray.init.
  limit     one process, no Ray: pyarrow reads the input, the same tokenizer encodes it in one
            batch, pyarrow writes the same rows as Parquet; documents/s.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from dlbatch.bench.common import fmt, median, ratio, table

TARGETS = {"rss_gib": 1.0, "rss_growth": 2.0, "noop_s": 10.0, "status_s": 10.0, "docs_per_s": 200.0,
           "first_batch_s": 10.0}
PROMPT_ACTOR = "PromptStage"  # in the process title of a Ray Data actor running the prompt stage


def add_arguments(p) -> None:
    p.add_argument("--docs", type=int, default=10_000, help="documents (default 10000)")
    p.add_argument("--tokens", type=int, default=150, help="tokens per document (default 150)")
    p.add_argument("--max-tokens", type=int, default=1, choices=(1, 2), help="generated tokens per document")
    p.add_argument("--files", type=int, default=1,
                   help="input files: the documents as one JSONL file (1, default) or split evenly over N files")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs per figure, median (default: 1 for the runs, 3 for rerun and status)")
    p.add_argument("--quick", action="store_true", help="smoke run: 200 documents")
    p.add_argument("--no-growth", action="store_true", help="skip the run at N/10 documents (RSS growth)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="extra job override for ours (repeatable)")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")


# ---------------------------------------------------------------------------- inputs
def write_docs(path: str, n: int, tokens: int, seed: int = 0, files: int = 1) -> str:
    """N documents as one JSONL file at ``path`` (files 1), or as ``files`` files
    ``part-NNNNN.jsonl`` of about N/files documents each in the folder ``path`` (the same
    documents, in the same order); -> the input path."""
    from dlbatch.bench.tiny_model import random_words

    if files < 1:
        raise ValueError(f"--files must be >= 1, got {files}")
    rng = random.Random(seed)
    if files > 1:
        os.makedirs(path, exist_ok=True)
    cuts = [n * k // files for k in range(files + 1)]
    for k in range(files):
        with open(path if files == 1 else os.path.join(path, f"part-{k:05d}.jsonl"), "w") as f:
            for i in range(cuts[k], cuts[k + 1]):  # the index first: distinct texts even if two draws matched
                f.write(json.dumps({"id": f"d{i:07d}", "text": f"t{3 + i % 4000} " + random_words(rng, tokens - 1)})
                        + "\n")
    return path


def input_files(path: str) -> list[str]:
    """The JSONL files of an input written by `write_docs`, in order."""
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".jsonl"))
    return [path]


def write_job(path: str, jsonl: str, out: str, model: str, max_tokens: int) -> str:
    job = {"name": "bench_scale", "pipeline": "papers",
           "input": {"format": "jsonl", "path": jsonl, "text_field": "text", "id_field": "id"},
           "output": {"path": out, "include_text": False},
           "model": {"name": model, "dtype": "float32", "max_model_len": 1024, "chat": False},
           "tasks": [{"name": "next", "prompt": "{{ text }}", "max_tokens": max_tokens}],
           "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
           "cluster": {"colocated": {"chip": "fast", "replicas": 1, "device": "cpu", "num_cpus": 1}}}
    with open(path, "w") as f:
        json.dump(job, f, indent=1)  # JSON is YAML
    return path


# ---------------------------------------------------------------------------- subprocesses
def _vmhwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _descendants(root: int) -> list[int]:
    """Every process under ``root`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class StagePeaks:
    """The peak RSS of the prompt actors under a process: each process below ``root`` whose
    title names the prompt stage (Ray titles an actor's process after its class; an idle
    worker can become one, so titles are read again at every poll), its VmHWM as last read."""

    def __init__(self, root: int, marker: str = PROMPT_ACTOR):
        self.root, self.marker = root, marker
        self.peaks: dict[int, int] = {}  # pid -> VmHWM (KiB)

    def poll(self) -> None:
        for pid in _descendants(self.root):
            if pid in self.peaks or self.marker in _title(pid):
                self.peaks[pid] = max(self.peaks.get(pid, 0), _vmhwm_kib(pid) or 0)

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values(), default=0) * 1024


def run_cmd(argv: list[str], cwd: str, poll_s: float = 0.05, timeout_s: float = 3600.0, tree_s: float = 0.5) -> dict:
    """Run `argv`; -> wall_s, rc, stdout, stderr, peak_rss_bytes (VmHWM of that process only,
    polled until it exits), prompt_rss_bytes and prompt_actors (`StagePeaks` over its
    descendants, polled every ``tree_s``: the largest prompt actor's VmHWM, how many ran)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err)
        peak, actors, tree_at = 0, StagePeaks(p.pid), 0.0
        while p.poll() is None:
            peak = max(peak, _vmhwm_kib(p.pid) or 0)
            now = time.perf_counter()
            if now - tree_at >= tree_s:
                actors.poll()
                tree_at = now
            if now - t0 > timeout_s:
                p.terminate()
                p.wait()
                raise RuntimeError(f"{' '.join(argv[:4])} ...: no end after {timeout_s:.0f} s")
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return {"wall_s": wall, "rc": p.returncode, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace"), "peak_rss_bytes": peak * 1024,
                "prompt_rss_bytes": actors.peak_bytes, "prompt_actors": len(actors.peaks)}


def _dlbatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlbatch.cli", *args]


def _check(res: dict, what: str) -> dict:
    if res["rc"] != 0:
        raise RuntimeError(f"{what} exited {res['rc']}:\n{res['stderr'][-3000:]}")
    return res


def run_ours(job: str, n: int, overrides: list[str], work: str) -> dict:
    sets = [a for o in overrides for a in ("--set", o)]
    res = _check(run_cmd(_dlbatch("run", job, "--fresh", "--no-progress", *sets), work), "dlbatch run")
    with open(os.path.join(json.load(open(job))["output"]["path"], "_report.json")) as f:
        rep = json.load(f)
    if rep["docs_ok"] != n:
        raise RuntimeError(f"dlbatch run: {rep['docs_ok']} documents ok of {n}")
    phases = rep.get("startup", {}).get("phases_s", {})
    gen_s = phases.get("generation")
    return {"wall_s": res["wall_s"], "run_wall_s": rep["wall_s"], "generation_s": gen_s,
            "first_batch_s": phases.get("data_first_batch"), "peak_rss_bytes": res["peak_rss_bytes"],
            "prompt_rss_bytes": res["prompt_rss_bytes"], "prompt_actors": res["prompt_actors"],
            "docs_per_s_e2e": n / res["wall_s"],
            "docs_per_s_generation": (n / gen_s) if gen_s else None, "phases_s": phases,
            "compaction": rep.get("compaction"), "rows_written": rep["rows_written"]}


def run_noop(job: str, work: str) -> float:
    res = _check(run_cmd(_dlbatch("run", job, "--no-progress"), work), "no-op rerun")
    if "nothing to do" not in res["stderr"] + res["stdout"]:
        raise RuntimeError(f"the rerun of a complete job did not say 'nothing to do':\n{res['stderr'][-2000:]}")
    return res["wall_s"]


def run_status(job: str, n: int, work: str) -> float:
    res = _check(run_cmd(_dlbatch("status", job, "--json"), work), "dlbatch status")
    st = json.loads(res["stdout"].strip().splitlines()[-1])
    if st["docs_done"] != n or not st["complete"]:
        raise RuntimeError(f"dlbatch status: {st}")
    return res["wall_s"]


# ---------------------------------------------------------------------------- baseline and limit
class _Tokenize:
    """The baseline's map_batches callable: the same tokenizer, one row per document, a
    1-token output (the last prompt token stands in for the generated one)."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_json)

    def __call__(self, batch: dict) -> dict:
        enc = self.tok.encode_batch(list(batch["text"]))
        return {"doc_id": batch["id"], "output": [e.tokens[-1] for e in enc],
                "prompt_tokens": [len(e.ids) for e in enc]}


def raydata_baseline(source: str, tokenizer_json: str, out: str) -> dict:
    """Runs in its own process (`python -m dlbatch.bench.scale --baseline ...`); ``source``:
    a JSONL file or a folder of them."""
    import logging

    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    t1 = time.perf_counter()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ds = ray.data.read_json(source)
    # one tokenizer actor (encode_batch is multi-threaded itself); the CPU left runs the reads
    ds = ds.map_batches(_Tokenize, fn_constructor_args=(tokenizer_json,), batch_size=1024, concurrency=1,
                        num_cpus=1)
    ds.write_parquet(out)
    t2 = time.perf_counter()
    ray.shutdown()
    return {"ray_init_s": t1 - t0, "pipeline_s": t2 - t1}


def run_baseline(source: str, tokenizer_json: str, n: int, work: str) -> dict:
    out = os.path.join(work, "baseline_out")
    shutil.rmtree(out, ignore_errors=True)
    res = _check(run_cmd([sys.executable, "-m", "dlbatch.bench.scale", "--baseline", source, tokenizer_json, out],
                         work), "Ray Data baseline")
    inner = json.loads(res["stdout"].strip().splitlines()[-1])
    import pyarrow.dataset as pds

    rows = pds.dataset(out, format="parquet").count_rows()
    if rows != n:
        raise RuntimeError(f"Ray Data baseline wrote {rows} rows of {n}")
    return {"wall_s": res["wall_s"], "pipeline_s": inner["pipeline_s"], "ray_init_s": inner["ray_init_s"],
            "peak_rss_bytes": res["peak_rss_bytes"], "docs_per_s_e2e": n / res["wall_s"],
            "docs_per_s_pipeline": n / inner["pipeline_s"]}


def run_limit(source: str, tokenizer_json: str, n: int, work: str) -> dict:
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    out = os.path.join(work, "limit.parquet")
    t0 = time.perf_counter()
    t = pa.concat_tables([pj.read_json(f) for f in input_files(source)])
    t1 = time.perf_counter()
    enc = tok.encode_batch(t.column("text").to_pylist())
    t2 = time.perf_counter()
    pq.write_table(pa.table({"doc_id": t.column("id"), "output": [e.tokens[-1] for e in enc],
                             "prompt_tokens": pa.array([len(e.ids) for e in enc], pa.int32())}), out)
    t3 = time.perf_counter()
    assert pq.ParquetFile(out).metadata.num_rows == n
    return {"wall_s": t3 - t0, "read_s": t1 - t0, "tokenize_s": t2 - t1, "write_s": t3 - t2,
            "docs_per_s": n / (t3 - t0), "docs_per_s_io_only": n / ((t1 - t0) + (t3 - t2))}


# ---------------------------------------------------------------------------- the bench
def _med(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return median(vals) if vals else None


def run(args) -> int:
    from dlbatch.bench.common import finish_bench, machine_info
    from dlbatch.bench.tiny_model import make_tiny_model

    if args.quick:
        args.docs = 200
    rep_run = args.repeat or 1
    rep_fast = args.repeat or 3
    work = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="dlbatch-bench-scale-"))
    os.makedirs(work, exist_ok=True)
    n = args.docs
    try:
        model = make_tiny_model(os.path.join(work, "model"))
        tokenizer_json = os.path.join(model, "tokenizer.json")
        res = {"machine": machine_info(), "docs": n, "files": args.files, "tokens_per_doc": args.tokens,
               "max_tokens": args.max_tokens, "repeat_run": rep_run, "repeat_fast": rep_fast,
               "overrides": list(args.overrides), "targets": TARGETS}
        sizes = [n] if args.no_growth else [max(1, n // 10), n]
        source = {size: os.path.join(work, f"docs-{size}" + (".jsonl" if args.files == 1 else "")) for size in sizes}
        for size in sizes:
            write_docs(source[size], size, args.tokens, files=args.files)
            job = write_job(os.path.join(work, f"job-{size}.yaml"), source[size], os.path.join(work, f"out-{size}"),
                            model, args.max_tokens)
            print(f"{size} documents in {args.files} file(s): dlbatch run ...", flush=True)
            runs = [run_ours(job, size, args.overrides, work) for _ in range(rep_run)]
            key = "ours" if size == n else "ours_small"
            res[key] = {"docs": size, "runs": runs, **{k: _med(runs, k) for k in (
                "wall_s", "run_wall_s", "generation_s", "first_batch_s", "peak_rss_bytes", "prompt_rss_bytes",
                "docs_per_s_e2e", "docs_per_s_generation")}}
            print(f"  {fmt(res[key]['docs_per_s_e2e'])} documents/s end to end, first batch "
                  f"{fmt(res[key]['first_batch_s'], 1)} s, peak RSS {res[key]['peak_rss_bytes'] / 2**20:.0f} MiB "
                  f"(prompt actor {res[key]['prompt_rss_bytes'] / 2**20:.0f} MiB)", flush=True)
        job = os.path.join(work, f"job-{n}.yaml")
        print("no-op rerun, status ...", flush=True)
        res["noop_s"] = median([run_noop(job, work) for _ in range(rep_fast)])
        res["status_s"] = median([run_status(job, n, work) for _ in range(rep_fast)])
        print("Ray Data baseline, limit ...", flush=True)
        bl = [run_baseline(source[n], tokenizer_json, n, work) for _ in range(rep_run)]
        res["baseline"] = {"runs": bl, **{k: _med(bl, k) for k in bl[0] if not isinstance(bl[0][k], dict)}}
        lim = [run_limit(source[n], tokenizer_json, n, work) for _ in range(rep_run)]
        res["limit"] = {k: _med(lim, k) for k in lim[0]}
        res["targets_met"] = _targets(res)
        return finish_bench(res, _render, args.json)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"kept {work}")


def _targets(r: dict) -> list[dict]:
    o, small = r["ours"], r.get("ours_small")
    gib = o["peak_rss_bytes"] / 2**30
    growth = ratio(o["peak_rss_bytes"], small["peak_rss_bytes"]) if small else None
    out = [
        {"target": f"driver peak RSS at {r['docs']:,} docs (GiB)", "value": gib, "goal": TARGETS["rss_gib"],
         "met": gib <= TARGETS["rss_gib"]},
        {"target": f"RSS growth {small['docs'] if small else '-'} -> {r['docs']:,} docs (x)", "value": growth,
         "goal": TARGETS["rss_growth"], "met": None if growth is None else growth < TARGETS["rss_growth"]},
        {"target": "no-op rerun (s)", "value": r["noop_s"], "goal": TARGETS["noop_s"],
         "met": r["noop_s"] <= TARGETS["noop_s"]},
        {"target": "dlbatch status (s)", "value": r["status_s"], "goal": TARGETS["status_s"],
         "met": r["status_s"] <= TARGETS["status_s"]},
        {"target": "documents/s end to end", "value": o["docs_per_s_e2e"], "goal": TARGETS["docs_per_s"],
         "met": o["docs_per_s_e2e"] >= TARGETS["docs_per_s"]},
        {"target": "documents/s, generation phase", "value": o["docs_per_s_generation"],
         "goal": TARGETS["docs_per_s"], "met": None if o["docs_per_s_generation"] is None
         else o["docs_per_s_generation"] >= TARGETS["docs_per_s"]},
        {"target": "first batch (s)", "value": o["first_batch_s"], "goal": TARGETS["first_batch_s"],
         "met": None if o["first_batch_s"] is None else o["first_batch_s"] <= TARGETS["first_batch_s"]},
    ]
    return out


def _render(r: dict) -> str:
    o, b, lim, small = r["ours"], r["baseline"], r["limit"], r.get("ours_small")
    mib = (lambda x: None if x is None else x / 2**20)
    rows = [
        ["ours: first batch (s: data plan -> first request rows)", fmt(o["first_batch_s"], 1), "", ""],
        ["ours: documents/s, generation phase", fmt(o["docs_per_s_generation"]),
         f"{fmt(ratio(o['docs_per_s_generation'], b['docs_per_s_pipeline']), 2)}x (vs after ray.init)",
         f"{fmt(ratio(o['docs_per_s_generation'], lim['docs_per_s']), 3)}"],
        ["ours: documents/s, end to end (subprocess wall)", fmt(o["docs_per_s_e2e"]),
         f"{fmt(ratio(o['docs_per_s_e2e'], b['docs_per_s_e2e']), 2)}x", f"{fmt(ratio(o['docs_per_s_e2e'], lim['docs_per_s']), 3)}"],
        ["baseline Ray Data: documents/s, after ray.init", fmt(b["docs_per_s_pipeline"]), "1.00x", ""],
        ["baseline Ray Data: documents/s, end to end", fmt(b["docs_per_s_e2e"]), "1.00x", ""],
        ["limit (pyarrow + tokenizer, one process): documents/s", fmt(lim["docs_per_s"]), "", "1"],
        ["limit, I/O only (read + write, no tokenize): documents/s", fmt(lim["docs_per_s_io_only"]), "", ""],
        ["ours: driver peak RSS (MiB)", fmt(mib(o["peak_rss_bytes"]), 0),
         f"baseline driver {fmt(mib(b['peak_rss_bytes']), 0)}", ""],
        ["ours: prompt-actor peak RSS (MiB, the largest)", fmt(mib(o["prompt_rss_bytes"]), 0),
         f"{o['runs'][0]['prompt_actors']} actor(s)", ""],
    ]
    if small:
        rows.append([f"ours at {small['docs']:,} docs: driver / prompt-actor peak RSS (MiB)",
                     f"{fmt(mib(small['peak_rss_bytes']), 0)} / {fmt(mib(small['prompt_rss_bytes']), 0)}", "", ""])
    rows += [
        ["no-op rerun (s, median)", fmt(r["noop_s"], 2), "", ""],
        ["dlbatch status (s, median)", fmt(r["status_s"], 2), "", ""],
    ]
    ph = o["runs"][0].get("phases_s") or {}
    head = table(["what", "ours", "vs baseline", "of limit"], rows,
                 title=f"{r['docs']:,} one-task documents x ~{r['tokens_per_doc']} tokens in {r['files']} JSONL "
                       f"file(s), tiny random model, "
                       f"max_tokens {r['max_tokens']} (medians: runs x{r['repeat_run']}, rerun/status "
                       f"x{r['repeat_fast']})")
    phases = "ours, phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items())
    tgt = table(["target", "measured", "goal", "PASS/FAIL"],
                [[t["target"], "-" if t["value"] is None else f"{t['value']:.3g}",
                  ("<= " if "RSS" in t["target"] or "(s)" in t["target"] else ">= ") + f"{t['goal']:g}"
                  if "growth" not in t["target"] else f"< {t['goal']:g}",
                  "not measured" if t["met"] is None else ("PASS" if t["met"] else "FAIL")]
                 for t in r["targets_met"]])
    return "\n\n".join([head, phases, tgt])


if __name__ == "__main__":  # the baseline's own process
    if len(sys.argv) == 5 and sys.argv[1] == "--baseline":
        print(json.dumps(raydata_baseline(*sys.argv[2:5])))
    else:
        sys.exit("usage: python -m dlbatch.bench.scale --baseline JSONL_OR_FOLDER TOKENIZER_JSON OUT")
