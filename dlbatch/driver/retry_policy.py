"""Who is to blame for a failed batch: the worker, or a document in it.

A failed batch (its worker died, was preempted, lost its node, or the engine returned
an error for some requests) says little about the documents in it: most of them are
healthy and were merely present. The policy therefore charges the failure to the
*worker* and only builds up evidence against a document:

- A *failure site* is one worker incarnation: (role, index, epoch) for each worker the
  batch ran on, where the epoch of a worker moves on each time it comes back after a
  failure. Every batch lost in one crash (a node loss takes many at once) shares one
  site, so a node loss is one piece of evidence, however many batches it took.
- A document becomes a *suspect* when it has been in failed batches at
  `suspect_after_sites` (2) different sites (two different workers, or one worker before
  and after a restart), or at one site when its batch ran on the only live worker of
  some role it used (e.g. the only decode worker: a retry would meet the same worker, so
  no other worker could tell the document from a worker fault). A suspect is
  run alone on a drained worker (nothing else in flight there), so its next failure is
  its own.
- Only a suspect's failures while run alone are *charged*; after `max_attempts` charged
  failures the document is dead-lettered. A healthy document in a lost batch is
  requeued and never charged: a worker or node loss costs it a rerun, not an attempt.

A worker whose batches keep failing (its failure streak, counted once per site, without
a success in between) is held back after it answers a ping again: `hold_s(streak)`
seconds of exponential back-off, then one batch at a time (probation) until a batch
succeeds on it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # charged (solo) failures before a document is dead-lettered
    suspect_after_sites: int = 2  # distinct failure sites that make a document a suspect
    hold_after_streak: int = 2  # a worker failing this many times in a row is held back
    hold_base_s: float = 1.0
    hold_max_s: float = 60.0

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if self.suspect_after_sites < 1:
            raise ValueError(f"suspect_after_sites must be >= 1, got {self.suspect_after_sites!r}")

    def is_suspect(self, n_sites: int, other_workers: bool = True) -> bool:
        """A document seen in failures at `n_sites` distinct sites is to be run alone. With no
        other worker to retry it on (one live worker in a role the batch used), a second site could only come
        from the same worker crashing again: one is enough, or a poison document would use up
        two of that worker's restarts before its first charged attempt."""
        return n_sites >= (self.suspect_after_sites if other_workers else 1)

    def dead(self, attempts: int) -> bool:
        """A suspect that failed alone `attempts` times is dead-lettered."""
        return attempts >= self.max_attempts

    def hold_s(self, streak: int) -> float:
        """Seconds a worker with `streak` failures in a row waits, after it answers again,
        before it is given work (then one batch at a time until one succeeds)."""
        if streak < self.hold_after_streak:
            return 0.0
        return min(self.hold_max_s, self.hold_base_s * 2 ** (streak - self.hold_after_streak))

    def on_probation(self, streak: int) -> bool:
        return streak >= self.hold_after_streak
