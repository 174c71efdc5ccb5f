"""Where training is: the counters a checkpoint must hold to continue exactly where it stopped."""

from dataclasses import asdict, dataclass
from typing import Iterator, Optional

from accelerate import Accelerator

from src.config import UsageError


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


def is_improvement(metrics: dict[str, float], state: TrainState, monitor: Optional[str], mode: str) -> bool:
    """Whether `metrics` beat the best `monitor` value so far; if so, `state` records it."""
    if monitor is None:
        return False
    if monitor not in metrics:
        raise UsageError(f"trainer.monitor={monitor} is not an evaluation metric; choose from {sorted(metrics)}")
    value = metrics[monitor]
    better = state.best_metric is None or (value < state.best_metric if mode == "min" else value > state.best_metric)
    if better:
        state.best_metric, state.best_step = value, state.step
    return better


def micro_batches(accelerator: Accelerator, loader, state: TrainState, max_steps: int) -> Iterator:
    """Micro-batches epoch after epoch, until max_steps optimizer steps, starting where `state` says.

    The shuffle order is a function of (seed, epoch) (accelerate's seedable sampler, set_epoch before
    iterating), so skipping the batches already consumed continues the interrupted epoch exactly.
    """
    while state.step < max_steps:
        loader.set_epoch(state.epoch)
        if hasattr(loader.dataset, "set_epoch"):  # accelerate forwards it only for some sampler layouts
            loader.dataset.set_epoch(state.epoch)
        epoch_loader = loader
        if state.batches_into_epoch:
            epoch_loader = accelerator.skip_first_batches(loader, state.batches_into_epoch)
        for batch in epoch_loader:
            if state.step >= max_steps:
                return
            state.batches_into_epoch += 1
            yield batch
        state.epoch += 1
        state.batches_into_epoch = 0
