"""Learning-rate schedules as LambdaLR multipliers of optimizer.lr, one scheduler.step() per optimizer step."""

import math
from typing import Annotated, Literal, Optional

from omegaconf import DictConfig
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from src.schema.signature import Arg


def warmup_cosine(
    optimizer: Optimizer,
    total_steps: Annotated[int, Arg("optimizer steps the cosine spans (config: trainer.max_steps)", ge=1)],
    warmup_steps: Annotated[int, Arg("optimizer steps of linear warm-up", ge=0)] = 100,
    min_lr_ratio: Annotated[float, Arg("final LR as a fraction of optimizer.lr", ge=0, le=1)] = 0.1,
) -> LambdaLR:
    """Linear warm-up to the peak, then cosine decay to min_lr_ratio * peak at total_steps, flat after."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, multiplier)


def constant(
    optimizer: Optimizer,
    warmup_steps: Annotated[int, Arg("optimizer steps of linear warm-up", ge=0)] = 0,
) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0)


# The decay's shape, from 1 at its start (progress 0) to 0 at the run's end (progress 1).
DECAY_SHAPES = {
    "linear": lambda progress: 1 - progress,
    "sqrt": lambda progress: 1 - math.sqrt(progress),  # "1-sqrt", Hägele et al. 2024: the best of those they tried
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
}


def warmup_stable_decay(
    optimizer: Optimizer,
    total_steps: Annotated[int, Arg("optimizer steps the schedule spans (config: trainer.max_steps)", ge=1)],
    warmup_steps: Annotated[int, Arg("optimizer steps of linear warm-up", ge=0)] = 100,
    decay_fraction: Annotated[float, Arg("the share of total_steps, at the end, spent decaying", ge=0, le=1)] = 0.2,
    decay_steps: Annotated[Optional[int], Arg(
        "optimizer steps spent decaying, at the end, instead of decay_fraction (null: decay_fraction)", ge=0)] = None,
    decay_shape: Annotated[Literal["linear", "sqrt", "cosine"], Arg(
        "how the rate falls: linearly, as 1 - sqrt(progress), or as a half cosine")] = "linear",
    min_lr_ratio: Annotated[float, Arg("final LR as a fraction of optimizer.lr", ge=0, le=1)] = 0.0,
) -> LambdaLR:
    """Linear warm-up, the peak rate held, then a decay over the run's last decay_fraction (or decay_steps) to
    min_lr_ratio * peak at total_steps, flat after (WSD: MiniCPM, DeepSeek, modded-nanogpt, torchtitan).

    Until its decay starts, the rates do not depend on the run's length: a run resumed in that phase with a longer
    (or shorter) trainer.max_steps trains what a run of that length from the start trains, and a checkpoint of
    that phase can be decayed in a run of its own (docs/checkpoints.md).
    """
    decay_from, shape = decay_start(total_steps, decay_fraction, decay_steps), DECAY_SHAPES[decay_shape]

    def multiplier(step: int) -> float:
        warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
        if step < decay_from or decay_from == total_steps:  # decay_fraction=0: the peak held, to decay later
            return warm
        progress = min(1.0, (step - decay_from) / (total_steps - decay_from))
        return min(warm, min_lr_ratio + (1 - min_lr_ratio) * shape(progress))  # a warm-up into the decay: the lower

    return LambdaLR(optimizer, multiplier)


def decay_start(total_steps: int, decay_fraction: float, decay_steps: Optional[int] = None) -> int:
    """The step the decay starts from (still at the peak): decay_steps, else round(decay_fraction * total_steps),
    before the end (the start, where that is before it)."""
    return max(0, total_steps - (round(decay_fraction * total_steps) if decay_steps is None else decay_steps))


def decay_begins(scheduler: DictConfig) -> Optional[int]:
    """The step a warmup_stable_decay config's decay starts from, strictly inside the run: its checkpoint there
    resumes into a run of any greater length (the loop keeps it, src/checkpointing/checkpointer.py). None for
    another schedule."""
    if scheduler.get("_target_") != f"{__name__}.warmup_stable_decay":
        return None
    start = decay_start(scheduler.total_steps, scheduler.decay_fraction, scheduler.get("decay_steps"))
    return start if 0 < start < scheduler.total_steps else None
