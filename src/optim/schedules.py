"""Learning-rate schedules as LambdaLR multipliers of optimizer.lr, one scheduler.step() per optimizer step."""

import math
from typing import Annotated

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
