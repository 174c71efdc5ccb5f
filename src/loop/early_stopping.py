"""Early stopping on trainer.monitor, as Lightning's EarlyStopping: stop after `patience` evaluations in a
row that did not beat the best value by more than `min_delta`.

Its counters live in TrainState, so they are checkpointed: a resumed run continues them, and a run that
already stopped early stays stopped. A non-finite metric never counts as an improvement.
"""

from typing import Optional

from src.loop.train_state import TrainState, improves


class EarlyStopping:
    def __init__(self, monitor: Optional[str], mode: str, patience: Optional[int], min_delta: float):
        self.monitor, self.mode = monitor, mode
        self.patience, self.min_delta = patience, min_delta

    def already_stopped(self, state: TrainState) -> bool:
        return self.patience is not None and state.evals_without_improvement >= self.patience

    def should_stop(self, metrics: Optional[dict[str, float]], state: TrainState) -> bool:
        """After each optimizer step, on every rank; `metrics` are the step's evaluation metrics, if any.

        Every rank decides the same without a collective: evaluate() returns the same metrics on every rank
        (they are reduced over all of them), as the best-checkpoint choice already relies on."""
        if self.patience is None or metrics is None or self.monitor not in metrics:  # e.g. not a tasks' step
            return False
        value = metrics[self.monitor]
        if improves(value, state.early_stopping_best, self.mode, self.min_delta):
            state.early_stopping_best, state.evals_without_improvement = value, 0
        else:
            state.evals_without_improvement += 1
        return self.already_stopped(state)

    def reason(self, state: TrainState) -> str:
        return (f"early stopping: {self.monitor} did not improve on {state.early_stopping_best:.6g} by more than "
                f"{self.min_delta:g} for {state.evals_without_improvement} evaluations "
                f"(trainer.early_stopping_patience={self.patience})")
