"""What training minimises and evaluation reports: the `objective` config group.

An objective works on the model's logits and the batch's targets. It returns SUMS and COUNTS, never means,
because a mean per micro-batch weights samples wrongly when they hold different numbers of targets
(padding, ignored positions): the loop divides the sum over a whole optimizer step's global batch by that
batch's target count (src/accumulation.py), and evaluation divides the sum over the whole validation set by
its count. So a loss and its metrics are exact on any number of processes and any accumulation.

Your own objective: subclass `Objective`, implement the three methods, and point a YAML at it
(`config/objective/NAME.yaml` with `_target_: your.module.YourObjective`). No other file changes.
"""

import logging
from typing import Annotated, ClassVar, Mapping

import torch
import torch.nn.functional as F

from src.schema import Arg, UsageError

log = logging.getLogger(__name__)

PerSample = tuple[torch.Tensor, torch.Tensor]  # (sum of a metric per sample, what it averages over per sample)


class Objective:
    # What evaluate() reports, as eval/<name> (trainer.monitor is checked against these before a run starts).
    metric_names: ClassVar[tuple[str, ...]] = ("loss",)
    # Whether the objective aligns targets that equal the inputs itself (Hugging Face's labels convention).
    shifts_targets: ClassVar[bool] = False

    def __init__(self, target_key: Annotated[str, Arg("the batch key holding the targets (mapping batches)")]
                 = "labels"):
        self.target_key = target_key

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """How many targets `loss_sum` sums over (a scalar tensor; known before the forward pass)."""
        raise NotImplementedError

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss summed over the counted targets of this micro-batch (a scalar tensor)."""
        raise NotImplementedError

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, PerSample]:
        """name -> (per-sample sums, per-sample weights), each of shape (batch,): evaluation averages
        sum(sums) / sum(weights) over the whole validation set, exactly across processes."""
        raise NotImplementedError

    def check_batch(self, inputs: Mapping, targets: torch.Tensor) -> None:
        """Called on the first training batch: stop on a batch this objective would silently mis-train on."""


class CrossEntropy(Objective):
    """Class or next-token targets given by the data: logits (..., C) against targets (...).
    Targets equal to `ignore_index` count for nothing."""

    metric_names = ("loss", "accuracy")

    def __init__(self, ignore_index: Annotated[int, Arg("target value that counts for nothing")] = -100, **base):
        super().__init__(**base)
        self.ignore_index = ignore_index

    def aligned(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits, targets

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (self.aligned(None, targets)[1] != self.ignore_index).sum()

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, targets = self.aligned(logits, targets)
        # fp32 whatever the autocast dtype: a bf16 log-softmax over a large vocabulary loses the loss's digits.
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index,
                               reduction="sum")

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, PerSample]:
        logits, targets = self.aligned(logits, targets)
        counted = targets != self.ignore_index
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index,
                               reduction="none").view(targets.shape)
        correct = (logits.argmax(-1) == targets) & counted
        dims = tuple(range(1, targets.dim()))
        per_sample = (lambda t: t.sum(dims)) if dims else (lambda t: t)
        weight = per_sample(counted.float())
        return {"loss": (per_sample(loss), weight), "accuracy": (per_sample(correct.float()), weight)}

    def check_batch(self, inputs: Mapping, targets: torch.Tensor) -> None:
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if self.shifts_targets or ids is None or ids.shape != targets.shape:
            return
        counted = targets != self.ignore_index  # padding is -100 in the labels, a pad id in the inputs
        if counted.any() and torch.equal(ids[counted], targets[counted]):
            raise UsageError(
                "The batch's targets equal its input_ids: Hugging Face's convention, where the loss shifts them "
                "by one. objective=cross_entropy does not shift, so the model would learn to copy its input. "
                "Use objective=causal_lm."
            )


class CausalLM(CrossEntropy):
    """Hugging Face's convention: `labels` aligned with `input_ids`; position t predicts label t+1.
    Labels equal to `ignore_index` (-100: padding, prompts) count for nothing."""

    shifts_targets = True

    def aligned(self, logits, targets):
        return (None if logits is None else logits[..., :-1, :]), targets[..., 1:]


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
