"""Batches prepared ahead in a background thread, so the training step does not wait on data.

The producer runs an iterator of ``(batch, state_after)`` in a daemon thread and keeps up to
``depth`` items queued (pinned on CUDA hosts). The consumer takes them in order and measures
how long it blocked. Errors raised by the producer (a bad file, a ConfigError) are re-raised
in the consumer. ``close()`` stops the thread; the next ``get()`` needs a new prefetcher.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_STOP_POLL_S = 0.1


class Prefetcher:
    """Run ``make_iter()`` ahead of the consumer in one background thread."""

    def __init__(self, make_iter: Callable[[], Iterator[tuple[Any, Any]]], depth: int, pin: bool) -> None:
        self._make_iter, self._pin = make_iter, pin
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshwright-data", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_STOP_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch, state in self._make_iter():
                if self._pin:
                    batch = batch.pin_memory()
                if not self._put(("ok", (batch, state))):
                    return
            self._put(("end", None))
        except BaseException as err:  # handed to the consumer, raised there
            self._put(("error", err))

    def get(self) -> tuple[Any, Any, float]:
        """The next ``(batch, state_after, seconds waited)``; raises what the producer raised."""
        start = time.perf_counter()
        kind, payload = self._queue.get()
        waited = time.perf_counter() - start
        if kind == "error":
            raise payload
        if kind == "end":
            raise StopIteration("the data iterator ended")
        return payload[0], payload[1], waited

    def close(self) -> None:
        """Stop the producer and wait for it (it polls the stop flag while the queue is full)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)
