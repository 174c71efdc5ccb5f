"""Optimizer parameter groups."""

from torch import nn


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices and conv kernels only; biases, norms and 1-D gains are left alone.

    The first group takes the optimizer's configured weight_decay; the second overrides it with 0.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
