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
