"""What training minimises and evaluation reports: the `objective` config group.

An objective works on the model's logits and the batch's targets. It returns SUMS and COUNTS, never means,
because a mean per micro-batch weights samples wrongly when they hold different numbers of targets
(padding, ignored positions): the loop divides the sum over a whole optimizer step's global batch by that
batch's target count (src/loop/accumulation.py), and evaluation divides the sum over the whole validation set by
its count. So a loss and its metrics are exact on any number of processes and any accumulation.

Your own objective: subclass `Objective`, implement the three methods, and point a YAML at it
(`config/objective/NAME.yaml` with `_target_: your.module.YourObjective`). No other file changes.
"""

from typing import Annotated, ClassVar, Mapping

import torch

from src.schema.signature import Arg

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
