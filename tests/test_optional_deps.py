"""Tests of optional system libraries skip, naming the reason, where the library is absent: a
newcomer's `make test` on a machine without ``libibverbs1`` passes. The hiding switch
(tests/helpers/optional.py) fails the import as the loader does, and the dlslime tests, run
with the library hidden, pass or skip naming it (what .ci/run does on every CI run)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import optional

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def hidden():
    show = optional.hide("libibverbs")
    yield
    show()


def test_a_hidden_library_fails_the_import_as_the_loader_does(hidden):
    with pytest.raises(ImportError, match=r"libibverbs\.so\.1: cannot open shared object file"):
        import dlslime  # noqa: F401
    reason = optional.dlslime_missing()
    assert reason is not None and "libibverbs" in reason and "apt-get install libibverbs1" in reason


def test_an_unknown_library_name_is_refused():
    with pytest.raises(ValueError, match=r"DLBATCH_TEST_HIDE: unknown library 'libfoo'"):
        optional.hide("libfoo")


def _dlslime_test_modules() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if p.name != pathlib.Path(__file__).name and "dlslime" in p.read_text())


def test_every_dlslime_test_module_skips_without_libibverbs():
    """The quick tests of every module that touches dlslime, with libibverbs hidden: none fails,
    and the tests that need a live endpoint skip naming the library (Ray-marked modules are in
    .ci/run's targeted run: they start Ray)."""
    modules = _dlslime_test_modules()
    assert "tests/test_transfer_dlslime.py" in modules and "tests/test_transfer_dlslime_security.py" in modules
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-m", "not slow and not ray", *modules],
                          cwd=REPO, env={**_env(), optional.HIDE_ENV: "libibverbs"},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("libibverbs" in line for line in skipped if "dlslime" in line), out[-4000:]
    for module in ("test_transfer_dlslime.py", "test_transfer_dlslime_security.py"):
        assert any(module in line for line in skipped), (module, out[-4000:])
    assert not re.search(r"\d+ failed|\d+ error", out), out[-4000:]


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
