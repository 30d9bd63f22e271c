"""The Ray side of dispatch: batches to actor calls, call outcomes and worker health back.

`WorkerCalls` does only what needs Ray: submit a `dlbatch.driver.batches.Batch` to its workers
(`generate`, or `prefill` -> `decode` / `rdt_export` -> `decode_rdt`), wait for calls,
ping workers the dispatcher marked unhealthy until they answer, read the actor table to
tell a restarting worker from a dead one, and re-form the RDT collective group after a
worker restart. Every decision (where, what a failure means) is the `Dispatcher`'s.
"""
from __future__ import annotations

import logging
import time

from dlbatch.transfer.errors import brief

log = logging.getLogger("dlbatch.run")


def actor_state(actor) -> str | None:
    """ALIVE / RESTARTING / DEAD / PENDING_CREATION ... from the GCS actor table (no dashboard
    needed); None when it cannot be read."""
    try:
        from ray._private import state as ray_state

        info = ray_state.actors(actor_id=actor._actor_id.hex())
        return info.get("State") if isinstance(info, dict) else None
    except Exception:  # internal API moved: the stall timeout still bounds every wait
        return None


class WorkerCalls:
    """Actor calls for a Dispatcher over the actors of `pools` (`dlbatch.workers.pools.WorkerPools`,
    which keeps the workers' pids and the RDT group)."""

    def __init__(self, pools, dispatcher, items_for):
        self.pools = pools
        self.workers = pools.workers
        self.d = dispatcher
        self.items_for = items_for
        self.refs: dict = {}  # ObjectRef -> Batch
        self.started: dict = {}  # ObjectRef -> (submit time, the prefill call's ref in PD)
        self.killed: dict = {}  # (role, idx) -> pid of a process `expire` killed: its answers do not count
        self.probes: dict = {}  # (role, idx) -> {"ref", "next"}
        # kv_transport=rdt: a worker Ray restarted is a new process outside the collective
        # group; nothing is submitted until the group is re-formed over the live workers,
        # which waits for the batches in flight to end (it tears down every communicator)
        self.regroup = {"needed": False, "next": 0.0, "why": ""}
        self.last_progress = time.time()

    def actor(self, key):
        return self.workers[key[0]][key[1]]

    def submit(self, b) -> None:
        items = self.items_for(b.rows)
        front = self.actor(b.front)
        pref = None
        if b.decode is not None:
            dec = self.actor(b.decode)
            pref = front.prefill.remote(items)
            if self.pools.kv_via == "rdt":  # the tensors go prefill worker -> decode worker directly
                kv = front.rdt_export.options(tensor_transport=self.pools.rdt_backend).remote(pref)
                ref = dec.decode_rdt.remote(kv, pref, items)
            else:
                ref = dec.decode.remote(pref, items)
        else:
            ref = front.generate.remote(items)
        self.refs[ref] = b
        self.started[ref] = (time.time(), pref)

    def expire(self, bound_s: float) -> int:
        """Fail every batch in flight for longer than ``bound_s`` and restart the worker it
        hangs on (the decode worker once its prefill returned, else the front worker): a
        killed process is the only way to stop a call that never returns, and the batches
        it held fail as in a crash (requeued; a document that hangs again and again is
        isolated, then dead-lettered). Returns the batches failed."""
        import ray

        now, n = time.time(), 0
        for ref, (t0, pref) in list(self.started.items()):
            if now - t0 <= bound_s or ref not in self.refs:
                continue
            b = self.refs.pop(ref)
            self.started.pop(ref, None)
            hung = b.front
            if pref is not None and ray.wait([pref], timeout=0)[0]:
                hung = b.decode
            log.error("batch %d (%d requests) has not returned after %.0f s on %s worker %d "
                      "(batching.batch_timeout_s=%g): restarting the worker", b.id, len(b.rows), now - t0,
                      hung[0], hung[1], bound_s)
            self.d.batch_failed(b.id, f"BatchTimeout: no result after {now - t0:.0f} s on {hung[0]} worker "
                                f"{hung[1]} (batching.batch_timeout_s={bound_s:g})", "WorkerCrash")
            try:
                self.killed[hung] = self.pools.worker_pids.get(hung)
                ray.kill(self.actor(hung), no_restart=False)
            except Exception as e:  # already dead: its other calls fail and are handled as a crash
                log.warning("could not restart %s worker %d: %s", hung[0], hung[1], brief(e))
            n += 1
        return n

    def wait(self, timeout: float) -> list:
        """(batch, results or the exception of the failed call) of calls that ended."""
        import ray

        if not self.refs:
            return []
        done, _ = ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        out = []
        for ref in done:
            b = self.refs.pop(ref)
            self.started.pop(ref, None)
            self.last_progress = time.time()
            try:
                out.append((b, ray.get(ref, timeout=60)))  # done: returns at once
            except Exception as e:  # worker died (restarted by Ray), node lost, KV payload lost
                out.append((b, e))
        return out

    def handle(self, b, outcome) -> None:
        if isinstance(outcome, BaseException):
            self.d.batch_failed(b.id, f"{type(outcome).__name__}: {brief(outcome, 300)}", "WorkerCrash")
            for key in b.workers:  # gone for good, or restarting (then pinged until it answers)
                if self.d.workers[key].state != "dead" and actor_state(self.actor(key)) == "DEAD":
                    self._dead(key, "state DEAD")
        else:
            self.d.batch_done(b.id, outcome)

    def _dead(self, key, why: str) -> None:
        self.d.worker_dead(key)
        self.probes.pop(key, None)
        log.error("%s worker %d is dead and will not be restarted (%s)", key[0], key[1], why)

    def probe(self) -> None:
        """Ping each unhealthy worker until it answers (then it is back) or is DEAD."""
        import ray

        for w in self.d.unhealthy():
            key = w.key
            p = self.probes.setdefault(key, {"ref": None, "next": 0.0, "t0": time.time()})
            if p["ref"] is None:
                if time.time() >= p["next"]:
                    p["ref"] = self.actor(key).ping.remote()
                continue
            ready, _ = ray.wait([p["ref"]], timeout=0)
            if not ready:
                continue
            try:
                info = ray.get(p["ref"], timeout=10)
            except Exception as e:  # still restarting, or dead for good
                p["ref"], p["next"] = None, time.time() + 1.0
                if actor_state(self.actor(key)) == "DEAD":
                    self._dead(key, brief(e))
                continue
            if key in self.killed and info.get("pid") == self.killed[key]:  # the kill has not landed yet
                p["ref"], p["next"] = None, time.time() + 0.5
                continue
            self.killed.pop(key, None)
            self.probes.pop(key, None)
            self.d.worker_back(key)
            log.info("%s worker %d is back after %.1f s", key[0], key[1], time.time() - p["t0"])
            if self.pools.note_restart(key, info["pid"]):  # a new process, outside the RDT group
                self.regroup.update(needed=True, why=f"{key[0]} worker {key[1]} restarted")
                self.d.pause()

    def reform_rdt_group(self) -> None:
        """Re-form the RDT group over the live workers once nothing is in flight."""
        rg = self.regroup
        if not rg["needed"] or self.refs or self.d.unhealthy() or time.time() < rg["next"]:
            return
        members = [self.actor(w.key) for role in ("prefill", "decode") for w in self.d.workers.live(role)]
        t0 = time.time()
        try:
            self.pools.reform_rdt_group(members)
        except Exception as e:  # a member died meanwhile: its crash is noted, and we try again
            rg["next"] = time.time() + 1.0
            log.warning("re-forming the RDT group over %d workers failed, retrying: %s", len(members), brief(e))
            return
        rg["needed"] = False
        self.d.resume()
        log.info("re-formed the RDT collective group over %d workers in %.1f s (%s)", len(members),
                 time.time() - t0, rg["why"])
