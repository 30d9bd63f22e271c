"""When `dlbatch run` starts its workers before it lists the inputs.

A worker's start is mostly its model load (seconds on our engine; vLLM's engine set-up and
compile cache, tens of seconds), and it needs nothing from the inputs. Listing a remote
input and peeking its first rows (the checks of `dlbatch.driver.checks`) takes network round
trips per object, minutes for a bucket of many files. So for a remote input the workers are
started as soon as the run's configuration resolves and load while the inputs are listed,
checked, parsed and tokenized; for a local input listing takes milliseconds and the workers
start after the checks, so a job the checks refuse starts nothing.

A run whose output says complete is most likely a no-op rerun (a scheduled job whose inputs
did not change): it lists first and starts workers only when there is work.
"""
from __future__ import annotations

import os

from fsspec.core import split_protocol

LOCAL_PROTOCOLS = (None, "file", "local")


def is_remote(path: str) -> bool:
    """Does ``path`` name something behind a network protocol (s3://, gs://, https://, ...)?"""
    return split_protocol(str(path))[0] not in LOCAL_PROTOCOLS


def starts_early(spec, fresh: bool) -> bool:
    """Start the workers before the inputs are listed: a remote input (or a Hub dataset),
    unless the output's manifest says the job is complete (and the run is not ``--fresh``)."""
    inp = spec.input
    hub = inp.format == "hf" and not is_remote(inp.path) and not os.path.exists(inp.path)  # a Hub dataset id
    if inp.format == "dataset" or not (is_remote(inp.path) or hub):
        return False
    if fresh:
        return True
    from dlbatch.output import open_store

    try:
        manifest = open_store(spec.output).files.read_json("_manifest.json")
    except (OSError, ValueError):  # the checks name what is wrong with the output
        return False
    return not (manifest and manifest.get("complete"))
