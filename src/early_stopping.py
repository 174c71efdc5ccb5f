"""Early stopping on trainer.monitor, as Lightning's EarlyStopping: stop after `patience` evaluations in a
row that did not beat the best value by more than `min_delta`.

Its counters live in TrainState, so they are checkpointed: a resumed run continues them, and a run that
already stopped early stays stopped. A non-finite metric never counts as an improvement.
"""

import logging
import math
from typing import Optional

import torch
from accelerate import Accelerator

from src.train_state import TrainState

log = logging.getLogger(__name__)


class EarlyStopping:
    def __init__(self, accelerator: Accelerator, monitor: Optional[str], mode: str, patience: Optional[int],
                 min_delta: float):
        self.accelerator, self.monitor, self.mode = accelerator, monitor, mode
        self.patience, self.min_delta = patience, min_delta

    def already_stopped(self, state: TrainState) -> bool:
        return self.patience is not None and state.evals_without_improvement >= self.patience

    def should_stop(self, metrics: Optional[dict[str, float]], state: TrainState) -> bool:
        """After each optimizer step, on every rank; `metrics` are the step's evaluation metrics, if any."""
        if self.patience is None or metrics is None:
            return False
        value, best = metrics[self.monitor], state.early_stopping_best
        margin = self.min_delta if self.mode == "min" else -self.min_delta
        improved = math.isfinite(value) and (
            best is None or (value < best - margin if self.mode == "min" else value > best - margin))
        if improved:
            state.early_stopping_best, state.evals_without_improvement = value, 0
        else:
            state.evals_without_improvement += 1
        stop = state.evals_without_improvement >= self.patience
        if self.accelerator.num_processes > 1:  # the metrics are reduced over all ranks already; made sure
            stop = bool(self.accelerator.reduce(torch.tensor(float(stop), device=self.accelerator.device), "max"))
        return stop

    def reason(self, state: TrainState) -> str:
        return (f"early stopping: {self.monitor} did not improve on {state.early_stopping_best:.6g} by more than "
                f"{self.min_delta:g} for {state.evals_without_improvement} evaluations "
                f"(trainer.early_stopping_patience={self.patience})")
