"""Why a run stops, decided in one place after every optimizer step: its length reached, early stopping on
trainer.monitor, or a stop the ranks agreed on (a preemption signal, Ctrl-C). Every rank decides the same
without a collective of its own: the metrics are already reduced over ranks, and the signal's vote is
(src/faults/preemption.py)."""

import logging
from typing import Optional

from omegaconf import DictConfig

from src.faults.preemption import PreemptionWatch
from src.loop.early_stopping import EarlyStopping
from src.loop.train_state import TrainState

log = logging.getLogger("train")  # its lines are the training log's

FINISHED, PREEMPTED = "finished", "preempted"  # the other reasons are early stopping's own sentence


class StopDecision:
    def __init__(self, trainer: DictConfig, preemption: PreemptionWatch):
        self.max_steps, self.preemption = trainer.max_steps, preemption
        self.early_stopping = EarlyStopping(trainer.monitor, trainer.monitor_mode, trainer.early_stopping_patience,
                                            trainer.early_stopping_min_delta)

    def before_training(self, state: TrainState) -> Optional[str]:
        """A run resumed from the checkpoint of an early stop has nothing left to train."""
        if not self.early_stopping.already_stopped(state):
            return None
        reason = self.early_stopping.reason(state)
        log.info("%s at step %d: nothing left to train", reason, state.step)
        return reason

    def after_step(self, state: TrainState, metrics: Optional[dict[str, float]], signalled: bool) -> Optional[str]:
        """`metrics`: the step's evaluation, if it had one; `signalled`: the ranks agreed to stop after it."""
        if state.step >= self.max_steps:  # the length wins: the final save and export follow as usual
            return FINISHED
        if self.early_stopping.should_stop(metrics, state):
            reason = self.early_stopping.reason(state)
            log.info("%s: stopped at step %d of %d", reason, state.step, self.max_steps)
            return reason
        if signalled:
            log.warning("stopping at step %d on %s: saving a checkpoint", state.step, self.preemption.describe())
            return PREEMPTED
        return None
