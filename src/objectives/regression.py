"""Squared error for real-valued targets."""

import torch

from src.errors import UsageError
from src.objectives.base import Objective


class MeanSquaredError(Objective):
    """Regression: outputs and targets of the same shape (or (B,) against (B, 1)). Every sample counts once,
    its squared error averaged over its output dimensions."""

    metric_names = ("loss", "mae")

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(targets), device=targets.device)

    def _errors(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if outputs.numel() != targets.numel():
            raise UsageError(f"objective=mse: the model returned shape {tuple(outputs.shape)} for targets of shape "
                             f"{tuple(targets.shape)}; they must hold the same number of values")
        return (outputs.float().reshape(len(targets), -1) - targets.float().reshape(len(targets), -1))

    def loss_sum(self, outputs, targets):
        return self._errors(outputs, targets).pow(2).mean(1).sum()

    def metrics(self, outputs, targets):
        errors, ones = self._errors(outputs, targets), torch.ones(len(targets), device=targets.device)
        return {"loss": (errors.pow(2).mean(1), ones), "mae": (errors.abs().mean(1), ones)}
