"""Where a stuck run is stuck: when no optimizer step has finished for `trainer.hang_report_s`, every rank that
is still alive logs the Python stack of each of its threads, naming itself. A rank that died or stopped says
nothing, which is how it shows; the others typically wait in a collective (all-reduce, barrier) until
`trainer.dist_timeout_s` ends the job with an error. Without this the job would sit silently until then.

A daemon thread does the watching: collectives release the GIL while they wait, so it runs while the main
thread is blocked. Cost when nothing hangs: one timestamp per step.
"""

import logging
import os
import socket
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)


class HangWatch:
    def __init__(self, rank: int, report_after_s: float):
        self.rank, self.report_after_s = rank, report_after_s
        self.last_beat: float | None = None  # armed by the first beat
        self.step = 0
        self.reported = False
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="hang-watch", daemon=True).start()

    def stop(self) -> None:
        """The run is over (the next job of an in-process sweep must not be reported as this one's hang)."""
        self.stopped.set()

    def beat(self, step: int) -> None:
        """The loop made progress (a step finished, or its evaluation and checkpoint)."""
        self.last_beat, self.step, self.reported = time.monotonic(), step, False

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.report_after_s / 4)):
            if self.last_beat is None or self.reported:
                continue
            stalled = time.monotonic() - self.last_beat
            if stalled >= self.report_after_s:
                self.reported = True  # once per stall: the next beat re-arms it
                log.error("%s", self.report(stalled))

    def report(self, stalled: float) -> str:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        stacks = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this watcher
            stacks.append(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
        return (f"HANG? rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}): no optimizer step finished "
                f"for {stalled:.0f} s after step {self.step} (trainer.hang_report_s={self.report_after_s:g}). "
                f"A rank that prints no such report is the one that stopped. Stacks of this rank's threads:\n"
                + "\n".join(stacks))
