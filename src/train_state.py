"""Where training is: the counters a checkpoint must hold to continue exactly where it stopped."""

from dataclasses import asdict, dataclass
from typing import Iterator, Optional

from accelerate import Accelerator


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batches_into_epoch: int = 0  # micro-batches of `epoch` already consumed (per process)
    best_metric: Optional[float] = None

    # accelerator.register_for_checkpointing needs these two.
    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def micro_batches(accelerator: Accelerator, loader, state: TrainState) -> Iterator:
    """Micro-batches epoch after epoch, without end, starting where `state` says.

    The shuffle order is a function of (seed, epoch) (accelerate's seedable sampler, set_epoch before
    iterating), so skipping the batches already consumed continues the interrupted epoch exactly.
    """
    while True:
        loader.set_epoch(state.epoch)
        epoch_loader = loader
        if state.batches_into_epoch:
            epoch_loader = accelerator.skip_first_batches(loader, state.batches_into_epoch)
        for batch in epoch_loader:
            state.batches_into_epoch += 1
            yield batch
        state.epoch += 1
        state.batches_into_epoch = 0
