"""trainer.spike_factor: a logged train/loss far above its recent median is reported as a spike, with the command
that rewinds past its data (trainer.skip_steps, src/loop/skip_steps.py).

Read at logging steps only, from the loss the log already holds: no host sync of its own. The median of the last
logged losses follows a falling curve, so a run that is still learning fast does not trip it; one report per
spike, re-armed once the loss is back under the bar.
"""

import logging
from collections import deque
from pathlib import Path
from statistics import median
from typing import Optional

from src.checkpointing.layout import newest_checkpoint_before

log = logging.getLogger(__name__)


class SpikeWatch:
    def __init__(self, factor: Optional[float], run_dir: Path, log_every: int, is_main_process: bool = True,
                 window: int = 20):
        self.factor, self.run_dir, self.log_every = factor, run_dir, log_every
        self.active = factor is not None and is_main_process
        self.recent: deque[float] = deque(maxlen=window)
        self.in_spike = False

    def logged(self, step: int, scalars: dict[str, float]) -> Optional[str]:
        """The report of a spike at this logging step, also logged (None: no spike, or not watching)."""
        loss = scalars.get("train/loss")
        if not self.active or loss is None:
            return None
        bar = self.factor * median(self.recent) if len(self.recent) >= 5 else None
        spiking = bar is not None and bar > 0 and loss > bar  # a loss around 0 or below has no scale to spike on
        report = None
        if spiking and not self.in_spike:
            report = self.report(step, loss, bar / self.factor)
            log.warning(report)
        self.in_spike = spiking
        if not spiking:  # a spike's losses stay out of the median it is measured against
            self.recent.append(loss)
        return report

    def report(self, step: int, loss: float, usual: float) -> str:
        first = max(step - self.log_every + 1, 1)  # the spike began after the last logged step
        before = newest_checkpoint_before(self.run_dir, first)
        what = (f"train/loss spiked at step {step}: {loss:.4g}, {loss / usual:.1f} times the median of the last "
                f"{len(self.recent)} logged ({usual:.4g}; trainer.spike_factor={self.factor:g}).")
        if before is None:
            return what + " No checkpoint before it to rewind to."
        path, saved = before
        return (what + f" If it does not come back down, rewind past its data (docs/checkpoints.md, 'Past a loss "
                f"spike'): resume={path} 'trainer.skip_steps=[[{saved + 1},{step}]]' hydra.run.dir={self.run_dir}")
