"""The transport's watcher: a thread that waits on the ready events a sender hands over with its
layers, so that each layer is posted once its KV is in the pool and not before, while the
forward goes on.

It blocks on the oldest event not yet seen complete (``synchronize``, which releases the GIL),
stamps the host's monotonic clock the moment it returns (the device's completion, as the host
sees it) and calls back, under the transport's lock, to post that send's ready layers. Events
recorded on one stream complete in order, so waiting on the oldest first delays none; an event
shared by several sends (one layer of a batch) is waited for once. The thread starts with the
first event handed to it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from tandem.kvtransfer.nixl_records import Layers, Send
from tandem.kvtransfer.types import ReadyEvent

# called under the lock once ``layers`` is stamped; the exception if waiting for it failed
OnComplete = Callable[[Send, Layers, Exception | None], None]


class EventWatcher:
    def __init__(self, lock: threading.RLock, name: str, on_complete: OnComplete) -> None:
        self._lock = lock  # the transport's: guards the sends and this queue
        self._wake = threading.Condition(lock)
        self._queue: deque[tuple[Send, Layers]] = deque()  # oldest first
        self._name = name
        self._on_complete = on_complete
        self._thread: threading.Thread | None = None
        self._closing = False

    def watch(self, send: Send, entry: Layers) -> None:
        """Wait for ``entry``'s event (called with the lock held)."""
        self._queue.append((send, entry))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._wake.notify()

    def _run(self) -> None:
        last: tuple[ReadyEvent, float] | None = None  # the event waited for last, and its stamp
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                send, entry = self._queue.popleft()
                if send.error is not None or entry not in send.waiting:
                    continue  # aborted or failed: nothing of it will be posted
            failure: Exception | None = None
            if last is not None and last[0] is entry.ready:
                done_s = last[1]
            else:
                try:
                    entry.ready.synchronize()
                except Exception as exc:  # the device failed: its KV will never be there
                    failure = exc
                done_s = time.monotonic()  # the device's completion, as this host sees it
                last = (entry.ready, done_s)
            with self._lock:
                if self._closing:
                    return
                entry.done_s = done_s
                self._on_complete(send, entry, failure)

    def close(self, join_s: float) -> None:
        """Stop the thread. One still blocked on an event after ``join_s`` (a device that never
        finishes) is left to end by itself: once the event completes it sees the watcher closed
        and calls nothing back. Called without the lock."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(join_s)
        with self._lock:
            self._queue.clear()
