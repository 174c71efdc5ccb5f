"""data.read_ahead: the next optimizer step's micro-batches are read, pinned and sent to the device by a background
thread while the current step runs, so that the training process only takes them from a queue.

On a GPU the host launches a step's kernels and runs ahead of the device; what it spends in the loader (reading
the windows, pinning them, starting their copy) is host time the telemetry counts as data wait (about 0.55 ms a
micro-batch at GPT-2-124M's shape on an H100, 2 % of the step). The DataLoader's own pinning thread exists only
with worker processes, whose batches cross to the training process through shared memory and pickles (2.3 ms a
12 x 1,025 batch measured on CPU, more than reading it): for a memory-mapped token file, one thread of the
training process reads ahead for less.

Exact: one reader takes the same batches in the same order, and the position a checkpoint saves is counted from
the micro-batches the loop took (src/loop/accumulation.py), never from the reader's. The reader never reads past
the micro-batches the epoch will take, and touches nothing the training thread uses but the loader it was
handed: the loader's start (accelerate's seeding broadcast, a collective) runs in the training thread, before the
reader starts. A dataset whose samples draw from a global random generator (torch's, numpy's, Python's) would
interleave those draws with the training's (dropout) in an order set by the threads' timing; such a dataset is
read in the training thread instead, and the log says why (draw from a generator of (seed, epoch, index), as
src/data/cifar10.py does).
"""

import collections
import logging
import queue
import random
import threading
from typing import Any, Iterator

import numpy as np
import torch

log = logging.getLogger(__name__)


class ReadAhead:
    """`count` items of `items`, taken by a background thread `chunk` at a time (an optimizer step's micro-batches,
    handed over at once: the training thread then waits for the reader once a step, not once a micro-batch), one
    chunk ready while it reads the next."""

    def __init__(self, items: Iterator, count: int, chunk: int, device: torch.device):
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._ready: collections.deque = collections.deque()
        self._ended: BaseException | None = None  # the reader's last word: StopIteration or the error it met
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(items, count, max(chunk, 1), device),
                                        name="read-ahead", daemon=True)
        self._thread.start()

    def _read(self, items: Iterator, count: int, chunk: int, device: torch.device) -> None:
        # As the DataLoader's pinning thread does: CUDA's current device is per thread (pinned memory and the copy
        # belong to this rank's GPU, not GPU 0), and one CPU thread is enough to copy a batch.
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(1)
        taken: list = []
        try:
            for _ in range(count):
                taken.append(next(items))
                if len(taken) == chunk:
                    if not self._put(taken):
                        return
                    taken = []
            ended: BaseException = StopIteration()
        except StopIteration as end:
            ended = end
        except BaseException as error:  # raised in the training thread after the items read before it
            ended = error
        if taken and not self._put(taken):
            return
        self._put(ended)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> Any:
        while not self._ready:
            if self._ended is not None:
                raise self._ended
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._ended = item
            else:
                self._ready.extend(item)
        return self._ready.popleft()

    def close(self) -> None:
        """Stops the reader after the item it is reading (if any) and waits for it: the loader is then the
        training thread's again."""
        self._stop.set()
        self._thread.join()


def global_random_states() -> tuple:
    return torch.random.get_rng_state(), np.random.get_state(), random.getstate()


def same_random_states(before: tuple, after: tuple) -> bool:
    (torch_before, numpy_before, python_before), (torch_after, numpy_after, python_after) = before, after
    return (torch.equal(torch_before, torch_after) and python_before == python_after
            and numpy_before[0] == numpy_after[0] and np.array_equal(numpy_before[1], numpy_after[1])
            and numpy_before[2:] == numpy_after[2:])


class EpochBatches:
    """An epoch's `count` micro-batches, `step` an optimizer step: the first step (two if a step is one micro-batch)
    read by the training thread (the loader's start, which may draw random numbers and broadcast a seed, then at
    least one batch read to see whether reading draws from a global random generator), the rest by a reader a step
    ahead."""

    def __init__(self, batches: Iterator, count: int, step: int, device: torch.device):
        self.batches, self.count, self.step, self.device = batches, count, step, device
        self.in_training_thread = step * -(-2 // step)  # whole steps, at least two micro-batches
        self.taken, self.reading_draws, self.reader = 0, False, None

    def __iter__(self) -> "EpochBatches":
        return self

    def __next__(self) -> Any:
        if self.taken == self.in_training_thread and self.count > self.taken:
            if not self.reading_draws:
                self.reader = ReadAhead(self.batches, self.count - self.taken, self.step, self.device)
            _tell_once(reading=not self.reading_draws)
        if self.reader is not None or self.taken == 0 or self.taken >= self.in_training_thread:
            item = next(self.reader or self.batches)
        else:  # a batch after the loader's start: do reads alone (not the training steps between) draw?
            before = global_random_states()
            item = next(self.batches)
            self.reading_draws |= not same_random_states(before, global_random_states())
        self.taken += 1
        return item

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


_told: set[bool] = set()  # once a run each: the reader started, or a dataset kept it from starting


def _tell_once(reading: bool) -> None:
    if reading in _told:
        return
    _told.add(reading)
    if reading:
        log.info("data.read_ahead=true: a thread of this process reads the next optimizer step's micro-batches while "
                 "a step runs")
    else:
        log.warning("data.read_ahead=true: reading a batch drew from a global random generator (torch's, numpy's or "
                    "Python's), so the data is read in the training thread, not ahead: a background thread would "
                    "interleave those draws with the training's in an order set by timing. Draw from a generator of "
                    "(seed, epoch, index) instead, as src/data/cifar10.py does.")
