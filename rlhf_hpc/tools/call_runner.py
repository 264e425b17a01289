"""Tool calls run on daemon threads, a bounded number at once, each answered by its deadline or
abandoned. A thread pool's workers are joined when the process exits, so one tool that never returned
would keep the rank from ever exiting (at the end of the run, or on a preemption's checkpoint and
requeue). A daemon thread does not. A Python thread cannot be killed, so an abandoned call runs on;
it frees its slot and is counted as stuck while it runs. The code tool's programs never get stuck
this way: the sandbox kills their process tree at its time limit."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, TypeVar

__all__ = ["CallRunner"]

T = TypeVar("T")


class CallRunner:
    def __init__(self, workers: int):
        self.workers = workers
        self._stuck: list[threading.Thread] = []

    def run(self, calls: list[Callable[[], T]], timeout_s: float) -> list[Optional[T]]:
        """Each call's result, or None where it had no result ``timeout_s`` from now (it raised,
        ran late, or never got a slot)."""
        deadline = time.monotonic() + timeout_s
        results: list[Optional[T]] = [None] * len(calls)
        threads: list[threading.Thread] = []
        finished = threading.Condition()
        done = [False] * len(calls)

        def target(i: int) -> None:
            try:
                results[i] = calls[i]()
            finally:
                with finished:
                    done[i] = True
                    finished.notify_all()

        with finished:
            while True:
                running = sum(1 for i in range(len(threads)) if not done[i])
                while len(threads) < len(calls) and running < self.workers:
                    thread = threading.Thread(target=target, args=(len(threads),), daemon=True, name="tool-call")
                    threads.append(thread)
                    thread.start()
                    running += 1
                left = deadline - time.monotonic()
                if all(done) or left <= 0:
                    break
                finished.wait(timeout=left)
            late = [t for i, t in enumerate(threads) if not done[i]]
            return_now = [results[i] if done[i] else None for i in range(len(calls))]
        self._stuck = [t for t in self._stuck if t.is_alive()] + late
        return return_now

    def stuck(self) -> int:
        """Abandoned calls still running."""
        self._stuck = [t for t in self._stuck if t.is_alive()]
        return len(self._stuck)
