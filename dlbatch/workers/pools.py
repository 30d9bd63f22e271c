"""The compute plane of one run: Ray, the worker pools of the plan, the KV transport between
them and the RDT collective group.

`WorkerPools` owns everything the driver holds in Ray for the pools of the run's
configuration (`dlbatch.driver.config.RunConfig`: the pools by role, what each worker
builds): it starts (or attaches to) Ray with the pools' chips declared, waits until some
node provides each pool's chip resource, picks the KV transport (`dlbatch.transfer.choose`),
creates one actor per replica (each owns one engine, `dlbatch.workers.actors`), waits until
every worker has loaded its model, forms the RDT group when KV moves over Ray's direct
tensor transport, and tears all of it down on `stop`. While the job runs it tells whether
a chip resource went missing, records a restarted worker's new process and re-forms the RDT
group over the live workers.

Invariant: every wait here is bounded and names what it waited for when it gives up
(`JobFailed`); committed output is never touched.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import replace

from dlbatch.transfer.errors import brief

log = logging.getLogger("dlbatch.run")

MAX_RESTARTS = 4  # per worker actor; Ray restarts a dead worker this many times


class JobFailed(RuntimeError):
    """The job cannot go on (no worker or node can serve it); committed output is intact."""


class WorkerPools:
    def __init__(self, config, resource_timeout_s: float = 120.0):
        """``config``: the run's configuration (`dlbatch.driver.config.RunConfig`): the job, and
        the pools by role, each with the `WorkerSpec` its workers build."""
        self.spec = config.job
        self.pools = config.pools  # role -> PoolConfig
        self.resource_timeout_s = resource_timeout_s  # a chip resource may be absent this long
        self.workers: dict[str, list] = {}  # role -> actor handles
        self.worker_pids: dict = {}  # (role, idx) -> pid of the worker's process
        self.needed_resources: dict = {}  # chip resource -> the role whose pool needs it
        self.by_chip = True  # workers ask for their chip resource (`_place_by_chip`)
        self.kv_via = "object_store"  # how prefill workers hand KV to decode workers
        self.rdt_backend = self.rdt_group = self.rdt_device = None
        self.rdt_regroups = 0  # times the group was re-formed after a worker restart
        self._ray_started = False

    @property
    def pd(self) -> bool:
        return "prefill" in self.pools

    # ---- start ---------------------------------------------------------------------------------
    def start(self, startup) -> None:
        """Ray up, chip resources present, transport chosen, actors created (not yet loaded)."""
        from dlbatch.workers.session import chip_resource, start_ray
        from dlbatch.workers.actors import make_worker_class
        from dlbatch.engine.loader import model_dir

        spec, pools = self.spec, self.pools
        chips: dict[str, int] = collections.Counter()
        for p in pools.values():
            chips[p.chip] += p.replicas
        if self.pd:  # an explicit transport that cannot run fails here, before any work
            try:
                self.kv_via, _ = self._choose_transport(probe=None)
            except ValueError as e:
                raise JobFailed(str(e)) from None
        startup.start("model_cache")
        model_dir(spec.model.ref)  # download a Hub id or convert a GGUF once, before workers race for it
        startup.end("model_cache")
        startup.start("ray_start")
        self._ray_started = start_ray(spec.cluster.address, dict(chips))
        startup.end("ray_start")
        self.by_chip = self._place_by_chip(chips)
        self.needed_resources = {chip_resource(p.chip): role for role, p in pools.items()} if self.by_chip else {}
        self._wait_for_resources(time.time())
        if self.pd and spec.cluster.kv_transport == "auto":
            self.kv_via, why = self._choose_transport(probe=self._probe_devices)
            log.info("kv_transport auto -> %s (%s)", self.kv_via, why)
        use_rdt = self.pd and self.kv_via == "rdt"
        # the driver's DLBATCH_* settings (DLBATCH_NATIVE, DLBATCH_MALLOPT, ...), vLLM's and the Hub's
        # endpoint/offline switches hold for its workers too (paths and tokens stay each node's own)
        forwarded = {k: v for k, v in os.environ.items()
                     if k.startswith(("DLBATCH_", "VLLM_")) or k in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
        if self.pd and self.kv_via == "dlslime":  # the job's opt-in alone decides, whatever the nodes' env holds
            forwarded["DLBATCH_DLSLIME_ALLOW_NETWORK"] = "1" if spec.cluster.dlslime_allow_network else "0"
        startup.start("workers_ready")
        for role, pool in pools.items():
            cls = make_worker_class(role, tensor_transport=use_rdt)
            wspec = replace(pool.worker, kv_transport=self.kv_via)  # the transport is known once Ray is up
            opts = dict(num_cpus=pool.num_cpus, num_gpus=pool.num_gpus,
                        resources={chip_resource(pool.chip): 1} if self.by_chip else {},
                        max_restarts=MAX_RESTARTS, max_task_retries=0)
            if forwarded:
                opts["runtime_env"] = {"env_vars": forwarded}
            self.workers[role] = [cls.options(**opts).remote(wspec) for _ in range(pool.replicas)]

    def wait_ready(self, startup, report) -> None:
        """Every worker has loaded its model; the shm placement checked; the RDT group formed."""
        self._wait_workers_up(report)
        startup.end("workers_ready")
        self._check_shm_same_node()
        if self.pd and self.kv_via == "rdt":  # one collective group over every prefill and decode worker
            from dlbatch.transfer import rdt

            self.rdt_device = self.pools["prefill"].device
            self.rdt_group = rdt.create_group(self.workers["prefill"] + self.workers["decode"], device=self.rdt_device)
            self.rdt_backend = rdt.backend_for(self.rdt_device)

    def _choose_transport(self, probe):
        from dlbatch.transfer.choose import choose_transport

        return choose_transport(self.spec.cluster.kv_transport, self.pools["prefill"].device,
                                self.pools["decode"].device, probe=probe,
                                dlslime_allow_network=self.spec.cluster.dlslime_allow_network)

    def _probe_devices(self) -> list[dict]:
        """What a worker of each PD pool will see (device after Ray's renumbering, CUDA, RDT),
        from one Ray task per pool with the pool's own resources: the driver's devices do not
        matter. Decided before the workers exist, so a restarted worker gets the same answer."""
        import ray

        from dlbatch.workers.session import chip_resource
        from dlbatch.workers.actors import probe_device

        probe = ray.remote(probe_device)
        refs = [probe.options(num_cpus=p.num_cpus, num_gpus=p.num_gpus,
                              resources={chip_resource(p.chip): 1} if self.by_chip else {})
                .remote(p.device) for p in (self.pools["prefill"], self.pools["decode"])]
        try:
            return ray.get(refs, timeout=300)
        except ray.exceptions.GetTimeoutError:
            raise JobFailed("kv_transport=auto: the prefill/decode pools' resources did not come up within 300 s "
                            "to probe their devices; set cluster.kv_transport explicitly") from None

    def _place_by_chip(self, chips: dict) -> bool:
        """Whether the workers ask Ray for their pool's ``chip:<name>`` resource: always, except
        on a one-node Ray the caller started before us (a notebook's `ray.init()`, or the one
        a `ray.data` call starts) that declares none of them: custom resources are fixed when
        Ray starts, and with one node there is nothing to choose between."""
        import ray

        from dlbatch.workers.session import chip_resource

        if self._ray_started or self.spec.cluster.address is not None:
            return True
        have = ray.cluster_resources()
        if any(have.get(chip_resource(c), 0) for c in chips) or len(ray.nodes()) != 1:
            return True
        log.info("the Ray session this process joined is one node without chip resources: the pools (%s) are "
                 "placed on it without them", ", ".join(sorted(chips)))
        return False

    # ---- resources -----------------------------------------------------------------------------
    def missing_resources(self) -> list[str]:
        if not self.needed_resources:
            return []
        import ray

        have = ray.cluster_resources()
        return [r for r in self.needed_resources if have.get(r, 0) < 1]

    def _wait_for_resources(self, since: float) -> None:
        """Wait (bounded) until some node provides every chip resource the pools ask for."""
        while True:
            missing = self.missing_resources()
            if not missing:
                return
            if time.time() - since > self.resource_timeout_s:
                raise JobFailed(self.no_resource_message(missing))
            time.sleep(1.0)

    def no_resource_message(self, missing: list[str]) -> str:
        import ray

        pools = ", ".join(f"{self.needed_resources[r]} pool needs {r}" for r in missing)
        return (f"no node of the Ray cluster provides {', '.join(missing)} ({pools}) and none came back within "
                f"{self.resource_timeout_s:.0f} s; cluster resources: "
                f"{ {k: v for k, v in ray.cluster_resources().items() if k.startswith('chip:')} }. "
                f"Committed output is intact: rerun the job once such a node is up.")

    def _wait_workers_up(self, report) -> None:
        """Every worker answers ping (placed, model loaded); bounded, and says which did not."""
        import ray

        keys = [(role, i) for role, ws in self.workers.items() for i in range(len(ws))]
        refs = [self.workers[role][i].ping.remote() for role, i in keys]
        limit = max(600.0, self.resource_timeout_s)
        deadline = time.time() + limit
        pending, missing_since = list(refs), None
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            missing = self.missing_resources()
            missing_since = (missing_since or time.time()) if missing else None
            if missing_since and time.time() - missing_since > self.resource_timeout_s:
                raise JobFailed(self.no_resource_message(missing))
            if time.time() > deadline:
                late = [f"{role} worker {i}" for (role, i), r in zip(keys, refs) if r in pending]
                raise JobFailed(f"{', '.join(late)} did not answer ping within {limit:.0f} s of being started (placed "
                                f"on a node with its chip resource, then loading {self.spec.model.name!r}); "
                                f"committed output is intact")
        infos = []
        for (role, i), r in zip(keys, refs):
            try:
                infos.append(ray.get(r, timeout=60))  # done: returns at once, or raises
            except Exception as e:
                raise JobFailed(f"{role} worker {i} failed to start (loading {self.spec.model.name!r}): "
                                f"{type(e).__name__}: {brief(e, 500)}") from e
        self.worker_pids = {k: info.get("pid") for k, info in zip(keys, infos)}
        report.note_worker_startup(infos)

    # ---- while the job runs ------------------------------------------------------------------
    def note_restart(self, key, pid: int) -> bool:
        """A worker answered again from process ``pid``; True when that is a new process whose
        RDT membership must be re-formed before more work is submitted."""
        if pid == self.worker_pids.get(key):
            return False
        self.worker_pids[key] = pid
        return self.pd and self.kv_via == "rdt"

    def reform_rdt_group(self, members: list) -> None:
        """Re-form the RDT group over ``members`` (the live workers' handles); raises when a
        member died meanwhile (the caller retries)."""
        from dlbatch.transfer import rdt

        old, self.rdt_group = self.rdt_group, None
        self.rdt_group = rdt.reform_group(old, members, device=self.rdt_device)
        self.rdt_regroups += 1

    def stats(self, timeout: float = 60.0) -> dict:
        """Every worker's ``stats()`` by role; {} when they cannot be had (the report does without)."""
        import ray

        try:
            return {role: ray.get([w.stats.remote() for w in ws], timeout=timeout) for role, ws in self.workers.items()}
        except Exception as e:
            log.warning("could not collect worker stats (waited %.0f s for every worker's stats()): %s", timeout,
                        brief(e))
            return {}

    # ---- shared memory -------------------------------------------------------------------------
    def _check_shm_same_node(self) -> None:
        """kv_transport=shm moves KV through one node's /dev/shm, and dlslime without
        cluster.dlslime_allow_network through loopback endpoints (`choose.one_node_reason`):
        every prefill and decode worker must be on one node. Checked once the workers are up,
        so a placement across nodes fails the job at start, naming the nodes, not every
        document later."""
        from dlbatch.transfer.choose import one_node_reason

        why = one_node_reason(self.kv_via, self.spec.cluster.dlslime_allow_network)
        if why is None or not self.pd:
            return
        import ray

        nodes: dict[str, set] = {}
        for role in ("prefill", "decode"):
            infos = ray.get([w.ping.remote() for w in self.workers.get(role, [])], timeout=60)
            for i, info in enumerate(infos):
                nodes.setdefault(info.get("node_id") or "?", set()).add(f"{role}[{i}]")
        if len(nodes) > 1:
            where = "; ".join(f"node {n[:12]}: {', '.join(sorted(ws))}" for n, ws in sorted(nodes.items()))
            raise JobFailed(f"cluster.kv_transport={self.kv_via!r} needs every prefill and decode worker on one "
                            f"node, but they were placed on {len(nodes)} nodes ({where}): {why}; or pools on one node")
        self._shm_cleanup(close=False)  # segments of processes killed in an earlier run

    def _shm_cleanup(self, close: bool) -> None:
        """kv_transport=shm: sweep stale segments on the workers' nodes (and this one); with
        ``close``, the workers also unlink their pooled segments (ray.kill skips their exit
        handlers). Best effort, bounded: a dead worker's segments are swept next time."""
        if self.kv_via != "shm" or not self.pd or not self.workers:
            return
        from dlbatch.transfer import shm

        swept = list(shm.sweep_stale_segments())
        try:
            import ray

            refs = [w.shm_cleanup.remote(close) for ws in self.workers.values() for w in ws]
            for r in ray.get(refs, timeout=10):
                swept += r
        except Exception as e:  # a worker already gone: nothing of its own left to close
            log.info("shm cleanup on the workers incomplete: %s", brief(e))
        if swept:
            log.info("swept %d stale shared-memory segments", len(set(swept)))

    # ---- stop ----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Workers' segments closed, actors killed, Ray shut down if we started it."""
        import ray

        from dlbatch.workers.session import shutdown_ray

        self._shm_cleanup(close=True)
        for ws in self.workers.values():
            for w in ws:
                try:
                    ray.kill(w)
                except Exception:  # already gone
                    pass
        shutdown_ray(self._ray_started)
