from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO_SAMPLES = Path(__file__).resolve().parent.parent / "samples" / "papers"


def test_help_is_fast():
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "--help"], capture_output=True, text=True, timeout=30)
    dt = time.perf_counter() - t
    assert r.returncode == 0 and "generate" in r.stdout
    assert dt < 1.0, f"dlbatch --help took {dt:.2f}s"
    r = subprocess.run([sys.executable, "-c", "import dlbatch.cli, sys; print(sorted(m for m in ('torch','ray','transformers') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "[]"


def test_generate_cli_bad_model():
    r = subprocess.run([sys.executable, "-m", "dlbatch.cli", "generate", "--model", "nope-model", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nope-model" in r.stderr


def test_ctrl_c_says_what_is_committed_and_that_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `dlbatch run`: exit 130 and one line saying how many documents the output
    holds and that rerunning resumes (it used to print only 'interrupted')."""
    from dlbatch.cli.main import main
    from dlbatch.driver import runner
    from dlbatch.output import open_store
    from dlbatch.jobspec import load_job

    out = tmp_path / "out"
    spec = load_job("jobs/papers.yaml", [f"output.path={out}"])
    row = {"output": "x", "prompt_tokens": 3, "output_tokens": 1, "finish_reason": "stop", "truncated": False,
           "model": "m", "ttft_s": 0.1, "latency_s": 0.2}
    rows = [{**row, "doc_id": d, "source": f"{d}.pdf", "task": t.name} for d in ("a", "b") for t in spec.tasks]
    open_store(spec.output).commit(rows, [], include_text=False)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.JobRunner, "run", interrupted)
    assert main(["run", "jobs/papers.yaml", "--set", f"output.path={out}"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: 2 documents committed in" in err and "rerun the same command to resume" in err, err


def test_status_after_a_limited_run_is_not_complete(tmp_path, capsys):
    """A run with input.limit 3 completes; `dlbatch status` of the job without the limit says
    3 done, 5 pending, and that the job is not complete (it said 'complete')."""
    from dlbatch.cli.main import main
    from dlbatch.jobspec import load_job
    from dlbatch.output import open_store

    out = tmp_path / "out"
    spec = load_job("jobs/papers.yaml", [f"output.path={out}", "input.limit=3"])
    papers = sorted(p.name for p in (REPO_SAMPLES).iterdir() if p.suffix == ".pdf")[:3]
    row = {"output": "x", "prompt_tokens": 3, "output_tokens": 1, "finish_reason": "stop", "truncated": False,
           "model": "m", "ttft_s": 0.1, "latency_s": 0.2}
    store = open_store(spec.output)
    store.commit([{**row, "doc_id": p, "source": str(REPO_SAMPLES / p), "task": t.name}
                  for p in papers for t in spec.tasks], [], include_text=False)
    store.files.write_json("_manifest.json", {"name": spec.name, "limit": 3, "complete": True})
    assert main(["status", "jobs/papers.yaml", "--set", f"output.path={out}"]) == 0
    text = capsys.readouterr().out
    assert "3 done, 0 failed, 5 pending (of 8)" in text, text
    assert "state: incomplete: the last run completed with input.limit 3" in text, text
    assert main(["status", "jobs/papers.yaml", "--set", f"output.path={out}", "--set", "input.limit=3"]) == 0
    assert "state: complete" in capsys.readouterr().out
