"""`dlbatch batch -i requests.jsonl -o results.jsonl --model M`: an OpenAI batch file in, its
responses out, as `vllm run-batch` takes them, with dlbatch's resume, dead letters and
exactly-once underneath.

The command builds an ``input.format: openai_batch`` job (docs/inputs.md) over ``-i`` and
runs it with `dlbatch.api.run`. The job's own output (its committed Parquet parts, the
exactly-once record of what is answered) lives in a work folder beside ``-o``
(``<o>.dlbatch/``, or ``--work-dir``): rerunning the same command after a kill resumes there
and answers each request once. When the run completes, ``-o`` is written whole (a temporary
file, then renamed where the filesystem allows): one response line per request, then one
line per request that failed (``"response": null, "error": {"code", "message"}``), as
`vllm run-batch` writes both into its output file; the work folder also keeps them apart
(``results.jsonl``, ``errors.jsonl``), as the OpenAI Batch API returns them.
``--served-model-name`` lets bodies that name another deployment's model (``"model":
"gpt-4o-mini"``) run unchanged. ``-i``, ``-o`` and ``--work-dir`` may be local paths or fsspec
URLs.
"""
from __future__ import annotations

import hashlib
import sys

from dlbatch.cli.jobs import EXIT_BUSY, EXIT_FAILED, EXIT_INVALID, EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("batch", help="answer an OpenAI batch file (vllm run-batch's interface, resumable)")
    p.add_argument("-i", "--input-file", required=True, help="the batch request file (.jsonl; local or fsspec URL)")
    p.add_argument("-o", "--output-file", required=True, help="where the responses go (.jsonl; local or fsspec URL)")
    p.add_argument("--model", required=True, help="the model: alias, HF folder, GGUF, URL or Hub id")
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name a request body may give for the model (repeatable)")
    p.add_argument("--work-dir", default=None, help="the resumable job output (default: <output-file>.dlbatch)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="any job key, e.g. model.backend=vllm or model.max_model_len=8192 (repeatable)")
    p.add_argument("--fresh", action="store_true", help="forget earlier answers in the work folder and start over")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.set_defaults(func=cmd_batch)


def batch_job(input_file: str, work_dir: str, model: str, served: list[str]) -> dict:
    """The job `dlbatch batch` runs: the request file in, the OpenAI batch output in ``work_dir``."""
    name = "batch-" + hashlib.sha256(input_file.encode()).hexdigest()[:10]
    return {"name": name, "pipeline": "papers",
            "input": {"format": "openai_batch", "path": input_file},
            "output": {"format": "openai_batch", "path": work_dir},
            "model": {"name": model, "served_model_name": list(served)},
            "cluster": {"colocated": {"chip": "local", "replicas": 1, "num_cpus": 1}}}


def cmd_batch(args) -> int:
    from dlbatch.api import load, run
    from dlbatch.driver.runner import JobFailed
    from dlbatch.jobspec import JobSpecError
    from dlbatch.output.lease import LeaseHeld

    work = args.work_dir or args.output_file.rstrip("/") + ".dlbatch"
    try:
        spec = load(batch_job(args.input_file, work, args.model, args.served_model_name), args.overrides)
    except (JobSpecError, ValueError) as e:
        print(f"invalid batch: {e}", file=sys.stderr)
        return EXIT_INVALID
    try:
        result = run(spec, fresh=args.fresh, progress=None if not args.no_progress else False)
    except LeaseHeld as e:
        print(f"batch not started: {e}", file=sys.stderr)
        return EXIT_BUSY
    except (JobFailed, OSError) as e:
        print(f"batch failed: {type(e).__name__}: {e}; answers so far are kept in {work}: rerun to resume",
              file=sys.stderr)
        return EXIT_FAILED
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    n = write_output(spec, args.output_file)
    print(f"{args.output_file}: {n['results']} responses, {n['errors']} errors "
          f"({result.docs_ok} answered, {result.docs_failed} failed; work folder {work})", file=sys.stderr)
    return EXIT_OK


def write_output(spec, output_file: str) -> dict:
    """-o: the work folder's results.jsonl then errors.jsonl, written whole to a temporary name
    beside it and renamed into place (a reader never sees half a file where rename is atomic)."""
    import fsspec

    from dlbatch.output import open_store
    from dlbatch.output.openai_export import ERRORS_FILE, RESULTS_FILE

    files = open_store(spec.output).files
    parts = {name: files.read_bytes(name) or b"" for name in (RESULTS_FILE, ERRORS_FILE)}
    fs, path = fsspec.core.url_to_fs(output_file)
    tmp = f"{path}.tmp-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    with fs.open(tmp, "wb") as f:
        for body in parts.values():
            f.write(body if not body or body.endswith(b"\n") else body + b"\n")
    fs.mv(tmp, path)
    return {"results": parts[RESULTS_FILE].count(b"\n"), "errors": parts[ERRORS_FILE].count(b"\n")}
