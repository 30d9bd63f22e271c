"""Ray session: an embedded local Ray bound to 127.0.0.1 with the job's chips declared as
resources, or attach to an existing cluster."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("dlbatch.workers.session")


def chip_resource(chip: str) -> str:
    return f"chip:{chip}"


def start_ray(address: str | None, chips: dict[str, int], num_cpus: int | None = None,
              runtime_env: dict | None = None) -> bool:
    """Returns True when a local cluster was started (and must be shut down by us)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if address is None and "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        address = "auto"  # we are the driver of a submitted Ray job: use its cluster, never a nested one
    if address is None:
        cores = os.cpu_count() or 2
        # Ray reserves CPUs per actor/task; declare more logical CPUs than cores so the
        # engine actors and the Ray Data stages never wait on each other for a slot.
        ncpu = num_cpus or max(8, 4 * cores)
        resources = {chip_resource(c): float(n) for c, n in chips.items()}
        ray.init(address="local", num_cpus=ncpu, resources=resources, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=True, logging_level=logging.WARNING,
                 runtime_env=runtime_env, configure_logging=True)
        log.info("started local Ray on 127.0.0.1 with %d logical CPUs and %s", ncpu, resources)
        return True
    ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    log.info("attached to Ray cluster at %s", address)
    return False


def shutdown_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()
