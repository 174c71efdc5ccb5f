"""Gradient accumulation whose loss is exact however a global batch is split into micro-batches and processes.

The loss of one optimizer step is the sum of the per-target loss over every counted target of the global
batch, divided by the global batch's count (tokens that are not padding, samples, ...). A mean per
micro-batch would weight a target in a short micro-batch more than one in a long micro-batch (the bug
transformers fixed in #34191). So the loop takes a whole accumulation window of micro-batches first,
counts its targets on every rank (one all-reduce, no host sync), and scales each micro-batch's loss sum by
K x W / count: `accelerator.backward` divides by K (accumulation steps) and DDP averages over W (ranks).
This is the recipe of accelerate's guide "Gradient accumulation on training samples of variable size".
"""

from typing import Iterator

import torch
from accelerate import Accelerator

from src.objectives import Objective
from src.train_state import TrainState


def accumulation_windows(accelerator: Accelerator, loader, state: TrainState, max_steps: int,
                         accumulation: int) -> Iterator[list]:
    """Lists of `accumulation` micro-batches, one per optimizer step, epoch after epoch until max_steps,
    starting where `state` says. Windows run across epoch ends, so each has exactly `accumulation` batches."""
    window = []
    for batch in _micro_batches(accelerator, loader, state, max_steps):
        window.append(batch)
        if len(window) == accumulation:
            yield window
            window = []


def _micro_batches(accelerator: Accelerator, loader, state: TrainState, max_steps: int) -> Iterator:
    """The shuffle order is a function of (seed, epoch) (accelerate's seedable sampler, set_epoch before
    iterating), so skipping the batches already consumed continues an interrupted epoch exactly."""
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


def global_target_count(accelerator: Accelerator, objective: Objective, window_targets: list) -> torch.Tensor:
    """How many targets the whole global batch of this optimizer step counts, on every rank."""
    local = sum(objective.count(targets) for targets in window_targets)
    local = torch.as_tensor(local, device=accelerator.device).float()
    return accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local


def loss_for_backward(accelerator: Accelerator, loss_sum: torch.Tensor, global_count: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's loss, pre-multiplied by what backward and DDP divide by."""
    scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
    return loss_sum * scale / global_count.clamp(min=1)  # a window of only ignored targets adds no gradient
