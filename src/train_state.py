"""Where training is: the counters a checkpoint must hold to continue exactly where it stopped."""

from dataclasses import asdict, dataclass
from typing import Optional


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batches_into_epoch: int = 0  # micro-batches of `epoch` already consumed (per process)
    best_metric: Optional[float] = None  # trainer.monitor's best value so far
    best_step: Optional[int] = None  # the step whose checkpoint holds it

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
