"""Gradient accumulation whose loss is exact however a global batch is split into micro-batches and processes.

The loss of one optimizer step is the sum of the per-target loss over every counted target of the global
batch, divided by the global batch's count (tokens that are not padding, samples, ...). A mean per
micro-batch would weight a target in a short micro-batch more than one in a long micro-batch (the bug
transformers fixed in #34191). So the loop takes a whole accumulation window of micro-batches first,
counts its targets on every rank (one all-reduce, no host sync), and scales each micro-batch's loss sum by
K x W / count: `accelerator.backward` divides by K (accumulation steps) and DDP averages over W (ranks).
This is the recipe of accelerate's guide "Gradient accumulation on training samples of variable size".
"""

import itertools
import logging
from collections.abc import Sized
from typing import Iterator, Optional

import torch
from accelerate import Accelerator

from src.data.base import FirstSamples
from src.data.sampling import RepeatedWindows
from src.errors import UsageError
from src.loop.read_ahead import EpochBatches
from src.loop.stream_position import StreamPosition
from src.loop.train_state import TrainState
from src.objectives.base import Objective

log = logging.getLogger(__name__)


def steps_per_epoch(dataset, global_batch: int, layout: str) -> Optional[int]:
    """Optimizer steps in one epoch: whole global batches only (None for a dataset without a length).

    Step s of an epoch then takes samples [s*G, (s+1)*G) of the epoch's shuffle order on every layout of the
    same global batch G: accelerate shards the sampler's batches round-robin over processes, so micro-step k
    of process r holds batch (s*K + k)*P + r. That is what lets a run resume on another number of processes.
    The tail of fewer than G samples is left to later epochs' shuffles, as drop_last does on one process.
    """
    if not isinstance(dataset, Sized):
        return None
    steps = len(dataset) // global_batch
    if steps == 0:
        raise UsageError(
            f"the training set ({len(dataset)} samples) is smaller than one global batch of {global_batch} "
            f"samples ({layout}): lower data.batch_size or trainer.gradient_accumulation_steps, or use more data"
        )
    return steps


def fit_run_to_data(data, trainer, layout: TrainState, repeats: int = 1) -> tuple[Optional[int], int]:
    """The optimizer steps of one epoch, after trainer.limit_train_batches has bounded the training set (and each
    global batch is taken `repeats` times in a row: objective.num_iterations), and the run's length in optimizer
    steps (trainer.max_epochs counted in steps), before the config's values that follow it (the LR schedule's
    length) are resolved."""
    if trainer.limit_train_batches is not None:
        data.train = FirstSamples(data.train, trainer.limit_train_batches * layout.global_batch)
    if repeats > 1:
        if not isinstance(data.train, Sized):
            raise UsageError(f"objective.num_iterations={repeats} trains each global batch {repeats} steps in a "
                             "row, which needs a training set with a length; this one is a stream")
        data.train = RepeatedWindows(data.train, layout.global_batch, repeats, trainer.seed)
    epoch_steps = steps_per_epoch(data.train, layout.global_batch, layout.layout())
    if trainer.max_epochs is None:
        return epoch_steps, trainer.max_steps
    if epoch_steps is None:
        raise UsageError("trainer.max_epochs needs a training set with a length (this one is iterable only): "
                         "use trainer.max_steps")
    log.info("trainer.max_epochs=%d: %d optimizer steps", trainer.max_epochs, trainer.max_epochs * epoch_steps)
    return epoch_steps, trainer.max_epochs * epoch_steps


def accumulation_windows(accelerator: Accelerator, loader, state: TrainState, max_steps: int, accumulation: int,
                         epoch_steps: Optional[int], position: Optional[StreamPosition] = None,
                         read_ahead: bool = False) -> Iterator[list]:
    """Lists of `accumulation` micro-batches, one per optimizer step, `epoch_steps` per epoch, until
    max_steps, starting where `state` says.

    The shuffle order is a function of (seed, epoch) (accelerate's seedable sampler, set_epoch before
    iterating), so skipping the samples already consumed continues an interrupted epoch exactly. The
    position is counted in samples of all processes together, so it means the same on any layout. A stream
    whose loader keeps its own position (`position`, src/loop/stream_position.py) continues from that instead.
    With `read_ahead` (a dataset with a length), a background thread reads each next window while a step runs
    (src/loop/read_ahead.py); the position still counts the windows taken here.
    """
    # Samples all processes take in one micro-step (accelerate knows it from the batch sampler, which a dataset
    # without a length has not: each process then takes its own batch of its shard of the stream).
    per_micro_step = getattr(loader, "total_batch_size", None) or loader.batch_size * accelerator.num_processes
    while state.step < max_steps:
        loader.set_epoch(state.epoch)
        if hasattr(loader.dataset, "set_epoch"):  # accelerate forwards it only for some sampler layouts
            loader.dataset.set_epoch(state.epoch)
        continued = position is not None and (position.restored or position.per_process_parts)
        # Micro-steps already taken (each process's batches to skip): whole windows of this layout, or of the
        # checkpoint's where a resume changed the global batch (load_checkpoint rounded the position to micro-steps).
        done = 0 if continued else state.samples_into_epoch // per_micro_step
        fresh = done == 0 and not (position is not None and position.restored)
        window_samples = per_micro_step * accumulation
        remaining = itertools.count() if epoch_steps is None else range(
            max(0, epoch_steps * window_samples - done * per_micro_step) // window_samples)
        if len(remaining if epoch_steps is not None else [1]) == 0:  # a larger global batch resumed near its end
            state.epoch, state.samples_into_epoch = state.epoch + 1, 0
            continue
        if done and epoch_steps is None and accelerator.is_main_process:
            log.info("resuming %d samples into pass %d of a dataset without a length (a stream): reading it again "
                     "up to there", state.samples_into_epoch, state.epoch)
        epoch_loader = accelerator.skip_first_batches(loader, done) if done else loader
        batches = iter(epoch_loader)
        if read_ahead and epoch_steps is not None:
            batches = EpochBatches(batches, len(remaining) * accumulation, accumulation, accelerator.device)
        too_short = UsageError(f"the training data ended before one global batch ({per_micro_step * accumulation} "
                               "samples): a dataset without a length and without samples enough to train on (check "
                               "data.path, and what validation holds out of it: data.val_documents with data=stream)")
        try:
            for taken in remaining:
                try:
                    window = list(itertools.islice(batches, accumulation))
                except ValueError as error:  # accelerate's words for an iterable that gave nothing at all
                    raise too_short if "does not contain any data" in str(error) else error from None
                if len(window) < accumulation:  # a dataset without a length ended: its partial window waits
                    if taken == 0 and fresh:  # and it would end every epoch so: the run would never end
                        raise too_short
                    break
                state.samples_into_epoch += per_micro_step * accumulation
                yield window
                if state.step >= max_steps:
                    return
        finally:  # the loader is the training thread's again (also when the loop stops early)
            if isinstance(batches, EpochBatches):
                batches.close()
        epoch_loader.end()  # an epoch cut at whole global batches never reaches the loader's own end
        if position is not None:
            position.pass_ended(state)
        else:
            state.epoch += 1
            state.samples_into_epoch = 0


def global_target_count(accelerator: Accelerator, objective: Objective, window_targets: list
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """How many targets the whole global batch of this optimizer step counts (one count per term of the loss),
    and how many tokens throughput counts of it, on every rank (one all-reduce)."""
    counts = sum(torch.as_tensor(objective.count(t), device=accelerator.device).float() for t in window_targets)
    tokens = sum(torch.as_tensor(objective.throughput_count(t), device=accelerator.device).float()
                 for t in window_targets)
    both = torch.cat([counts.reshape(-1), tokens.reshape(1)])
    if accelerator.num_processes > 1:
        both = accelerator.reduce(both, "sum")
    return both[:-1].reshape(counts.shape), both[-1]


def loss_for_backward(accelerator: Accelerator, loss_sum: torch.Tensor, global_count: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's loss, pre-multiplied by what backward and DDP divide by (a loss of
    several terms: each over its own count, src/objectives/base.py's model_loss_sum)."""
    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
    return (loss_sum * scale / global_count.clamp(min=1)).sum()  # a window of only ignored targets adds no gradient
