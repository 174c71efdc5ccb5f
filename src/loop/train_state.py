"""Where training is: the counters a checkpoint must hold to continue exactly where it stopped."""

import math
from dataclasses import asdict, dataclass
from typing import Optional


def improves(value: float, best: Optional[float], mode: str, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` (None: nothing yet) by more than min_delta, lower or higher as `mode`
    (min | max) says. A NaN or infinite value never does."""
    if not math.isfinite(value):
        return False
    return best is None or (value < best - min_delta if mode == "min" else value > best + min_delta)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    # Samples of `epoch` already consumed by all processes together: a position that means the same on any
    # number of processes, so a checkpoint written by N processes resumes on M (src/loop/accumulation.py).
    samples_into_epoch: int = 0
    best_metric: Optional[float] = None  # trainer.monitor's best value so far
    best_step: Optional[int] = None  # the step whose checkpoint holds it
    # Early stopping (src/loop/early_stopping.py): its own best (with min_delta) and the evaluations since.
    early_stopping_best: Optional[float] = None
    evals_without_improvement: int = 0
    # The layout that consumed them: per-process micro-batch x processes x accumulation = the global batch.
    batch_size: Optional[int] = None
    num_processes: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None

    @property
    def global_batch(self) -> Optional[int]:
        if None in (self.batch_size, self.num_processes, self.gradient_accumulation_steps):
            return None
        return self.batch_size * self.num_processes * self.gradient_accumulation_steps

    def layout(self) -> str:
        return (f"data.batch_size={self.batch_size} x {self.num_processes} process(es) x "
                f"trainer.gradient_accumulation_steps={self.gradient_accumulation_steps}")

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
