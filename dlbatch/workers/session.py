"""Ray session: an embedded local Ray bound to 127.0.0.1 with the job's chips declared as
resources, or attach to an existing cluster."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("dlbatch.workers.session")


def chip_resource(chip: str) -> str:
    return f"chip:{chip}"


def verbose() -> bool:
    """The run logs at debug level (`dlbatch -v`): Ray's own messages are shown too."""
    return logging.getLogger("dlbatch").isEnabledFor(logging.DEBUG)


def quiet_ray() -> int:
    """Ray's own log lines, unless the run is verbose: its warnings and notices (token
    authentication on a local cluster, deprecations, Ray Data's execution plans and its
    per-dataset progress blocks) are not the job's news; our progress line says how far the
    job is. Errors still show, and Ray Data's full log stays in its session folder
    (``ray-data.log``). -> the logging level Ray is started with."""
    level = logging.INFO if verbose() else logging.ERROR
    logging.getLogger("ray").setLevel(level)
    try:  # Ray Data configures its own console handler (INFO) again for every dataset it runs
        from ray.data._internal import logging as data_logging

        data_logging.DEFAULT_CONFIG["handlers"]["console"]["level"] = logging.getLevelName(level)
        data_logging.configure_logging()
    except Exception:  # a Ray whose Data logging is laid out otherwise: its default output stays
        pass
    return level


def start_ray(address: str | None, chips: dict[str, int], num_cpus: int | None = None,
              runtime_env: dict | None = None) -> bool:
    """Returns True when a local cluster was started (and must be shut down by us)."""
    import ray

    level = quiet_ray()
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
                 _node_ip_address="127.0.0.1", log_to_driver=True, logging_level=level,
                 runtime_env=runtime_env, configure_logging=True)
        log.info("started local Ray on 127.0.0.1 with %d logical CPUs and %s", ncpu, resources)
        return True
    ray.init(address=address, runtime_env=runtime_env, logging_level=level)
    log.info("attached to Ray cluster at %s", address)
    return False


def shutdown_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()
