from __future__ import annotations

import subprocess
import sys
import time


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
    from dlbatch.output.delta_store import open_store
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
