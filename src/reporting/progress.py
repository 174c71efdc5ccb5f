"""Progress fit for where it is read: a tqdm bar on a terminal; in a log file (a SLURM .out, CI) one plain line
every `trainer.progress_interval_s` seconds instead of a single line of carriage returns."""

import logging
import sys
import time
from datetime import timedelta
from typing import Optional

from accelerate import Accelerator
from tqdm import tqdm

log = logging.getLogger("progress")


class Progress:
    def __init__(self, accelerator: Accelerator, total: int, initial: int, interval_s: float):
        self.accelerator = accelerator
        self.total, self.step, self.first = total, initial, initial
        self.enabled, self.interval_s = accelerator.is_main_process, interval_s
        self.bar = tqdm(total=total, initial=initial) if self.enabled and sys.stderr.isatty() else None
        self.started = self.last_line = time.monotonic()
        self.loss: Optional[float] = None  # the last logged
        self.tokens_per_second: Optional[float] = None

    def report(self, step: int, logged: dict[str, float]) -> None:
        """A step finished: its scalars to the trackers (`logged`: {} for a step that logs nothing), then the bar
        or the line."""
        if logged:
            self.accelerator.log(logged, step=step)
        loss, tokens_per_second = logged.get("train/loss"), logged.get("train/tokens_per_second")
        self.step = step
        self.loss = loss if loss is not None else self.loss
        self.tokens_per_second = tokens_per_second if tokens_per_second is not None else self.tokens_per_second
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}")
        elif time.monotonic() - self.last_line >= self.interval_s or step == self.total:
            self.last_line = time.monotonic()
            log.info(self.line())

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        done = self.step - self.first
        eta = elapsed / done * (self.total - self.step) if done else None
        parts = [f"step {self.step}/{self.total} ({self.step / self.total:.0%})"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:,.0f} tokens/s")
        parts.append(f"elapsed {timedelta(seconds=round(elapsed))}")
        parts.append(f"ETA {timedelta(seconds=round(eta)) if eta is not None else '?'}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
