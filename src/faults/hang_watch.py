"""Where a stuck run is stuck: when nothing has progressed for `trainer.hang_report_s` (no optimizer step
finished, no evaluation batch, no sample, no part of a save or an export), every rank that
is still alive logs the Python stack of each of its threads, naming itself. Long work between steps reports
its progress (`alive`), so a rank busy in a long evaluation is not reported; one stopped inside it still is,
by the others, which then wait in its collectives. A rank that died or stopped says
nothing, which is how it shows; the others typically wait in a collective (all-reduce, barrier) until
`trainer.dist_timeout_s` ends the job with an error. Without this the job would sit silently until then.

A daemon thread does the watching: collectives release the GIL while they wait, so it runs while the main
thread is blocked. Cost when nothing hangs: one timestamp per step, and on several processes one small write
to the launch's key-value store per second from that thread.

Through that store each rank's watcher tells the others its last finished step, its last progress and that it
is still alive, so a report also names the ranks that stopped answering and the step each last finished, and a
rank that waits for a peer still progressing (the others while rank 0 alone samples text) is not reported: that
peer reports itself if it stops.
"""

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)


class HangWatch:
    def __init__(self, rank: int, report_after_s: float, world_size: int = 1):
        self.rank, self.report_after_s, self.world_size = rank, report_after_s, world_size
        self.store = _launch_store() if world_size > 1 else None
        self.last_beat: float | None = None  # armed by the first beat
        self.progressed = 0.0  # wall-clock time of the last beat or progress, as the other ranks compare it
        self.step, self.doing = 0, None
        self.reported = False
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="hang-watch", daemon=True).start()

    def stop(self) -> None:
        """The run is over (the next job of an in-process sweep must not be reported as this one's hang)."""
        self.stopped.set()

    def beat(self, step: int) -> None:
        """The loop made progress (a step finished, or its evaluation and checkpoint)."""
        self.last_beat, self.step, self.doing, self.reported = time.monotonic(), step, None, False
        self.progressed = time.time()

    def alive(self, doing: str) -> None:
        """Long work between optimizer steps progressed (an evaluation batch, a sample, a part of a save): this
        rank is busy, not stuck. Before the first step, nothing is watched yet."""
        if self.last_beat is not None:
            self.last_beat, self.doing, self.reported = time.monotonic(), doing, False
            self.progressed = time.time()

    def _watch(self) -> None:
        self._tell_the_others()
        while not self.stopped.wait(min(1.0, self.report_after_s / 4)):
            self._tell_the_others()
            if self.last_beat is None or self.reported:
                continue
            stalled = time.monotonic() - self.last_beat
            if stalled >= self.report_after_s and not self._a_peer_progresses():
                self.reported = True  # once per stall: the next beat re-arms it
                log.error("%s", self.report(stalled))

    def report(self, stalled: float) -> str:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        stacks = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this watcher
            stacks.append(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
        doing = f", the last progress: {self.doing}" if self.doing else ""
        return (f"HANG? rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}): no optimizer step finished "
                f"and nothing progressed for {stalled:.0f} s after step {self.step}{doing} "
                f"(trainer.hang_report_s={self.report_after_s:g}). "
                f"A rank that prints no such report is the one that stopped.{self._others()} Stacks of this rank's "
                f"threads:\n" + "\n".join(stacks))

    def _tell_the_others(self) -> None:
        if self.store is None:
            return
        news = {"step": self.step, "pid": os.getpid(), "host": socket.gethostname(), "heard": time.time(),
                "progressed": self.progressed}
        try:
            self.store.set(f"hang_watch/{self.rank}", json.dumps(news))
        except Exception:  # noqa: BLE001 (the store's host may be gone: the report then says less)
            self.store = None

    def _a_peer_progresses(self) -> bool:
        """Whether another rank made progress within trainer.hang_report_s (this rank then waits for it)."""
        for rank in range(self.world_size):
            if rank == self.rank or self.store is None:
                continue
            try:
                news = _news(self.store, rank)
            except Exception:  # noqa: BLE001 (the store's host may be gone: report, as without the store)
                return False
            if news and time.time() - news.get("progressed", 0.0) < self.report_after_s:
                return True
        return False

    def _others(self) -> str:
        silent = self.silent()
        return f" Not answering: {silent}." if silent else (" Every rank still answers." if self.store else "")

    def silent(self) -> str:
        return _silent(self.store, self.world_size, self.report_after_s)


def _launch_store():
    """The key-value store every rank of the launch reaches (torch's default process group store)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (no process group: a single process)
        return None


def silent_ranks(report_after_s: float) -> str:
    """What the watches told each other of ranks that stopped answering, read from the launch's store by an
    error handler outside the loop ("" when nothing, or no watch ever ran in this process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ""
    store, rank = _launch_store(), dist.get_rank()
    try:
        if store is None or not store.check([f"hang_watch/{rank}"]):  # this rank's watch never ran
            return ""
    except Exception:  # noqa: BLE001 (the store's host may be gone)
        return ""
    return _silent(store, dist.get_world_size(), report_after_s)


def _silent(store, world_size: int, report_after_s: float) -> str:
    """The ranks that stopped answering, with the step each last finished ("" if none, or unknown)."""
    if store is None:
        return ""
    silent = []
    for rank in range(world_size):
        try:
            news = _news(store, rank)
        except Exception:  # noqa: BLE001
            return ""
        if news is None:
            silent.append(f"rank {rank} (never heard from)")
        elif time.time() - news["heard"] > max(3 * min(1.0, report_after_s / 4), 2.0):  # missed 3 beats
            silent.append(f"rank {rank} (pid {news['pid']} on {news['host']}: last finished step {news['step']}, "
                          f"silent for {time.time() - news['heard']:.0f} s)")
    return "; ".join(silent)


def _news(store, rank: int) -> dict | None:
    """What rank `rank`'s watcher last told the store (None if it never did); raises if the store is gone."""
    key = f"hang_watch/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None
