"""Reading and tokenizing the next training batches while the current step runs.

A streamed source (FineWeb) is tokenized on the fly: at the paper's shape a rank needs 131,072 tokens per step,
most of a second of tokenization on a CPU core. :class:`PrefetchedStream` takes that off the step: a background
thread calls the stream's ``next`` ``depth`` batches ahead (the Rust tokenizer releases the GIL while it
encodes) and records the stream's ``state_dict()`` right after each batch. What the trainer sees, batches and
checkpointed state alike, is exactly the stream without prefetching: a checkpoint saves the state after the last
batch served, not after the ones read ahead, so a resume continues with the first batch not trained on.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class PrefetchedStream:
    """``stream``'s batches, ``depth`` read ahead in a thread (see module doc)."""

    def __init__(self, stream, depth: int = 2):
        self._stream, self._depth = stream, depth
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._served: tuple[dict, int] | None = None  # (state, epoch) after the last batch served

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                batch = next(self._stream)
                item = (batch, self._stream.state_dict(), self._stream.epoch, None)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                item = (None, None, None, err)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[3] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self):
        if self._thread is None:
            self._queue, self._stop = queue.Queue(maxsize=self._depth), threading.Event()
            self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop), daemon=True,
                                            name="hif8qat-prefetch")
            self._thread.start()
        batch, state, epoch, err = self._queue.get()
        if err is not None:
            self.close()
            raise err
        self._served = (state, epoch)
        return batch

    def close(self, rewind: bool = True) -> None:
        """Stop reading ahead; with ``rewind`` the stream is set back to its state after the last batch served
        (the batches read ahead are dropped), as if it had never read ahead.

        Args:
            rewind: set the stream back to the last batch served.
        """
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread = self._queue = self._stop = None
        if rewind and self._served is not None:
            self._stream.load_state_dict(self._served[0])

    @property
    def epoch(self) -> int:
        return self._served[1] if self._thread is not None and self._served else self._stream.epoch

    def state_dict(self) -> dict:
        """The state after the last batch served (not after the batches read ahead).

        Returns:
            The wrapped stream's state.
        """
        return self._served[0] if self._thread is not None and self._served else self._stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Stop reading ahead and resume the wrapped stream at ``state``.

        Args:
            state: a saved state.
        """
        self.close()
        self._served = None
        self._stream.load_state_dict(state)

    def resize(self, states: list[dict]) -> str:
        """Stop reading ahead and continue saved ranks' epoch on this world size (the wrapped stream's
        ``resize``).

        Args:
            states: every saved rank's ``state_dict()``.

        Returns:
            A note for the log.
        """
        self.close()
        self._served = None
        return self._stream.resize(states)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
