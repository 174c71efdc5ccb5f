"""Cross-entropy over classes, and its language-model form (targets shifted by one)."""

from typing import Annotated, Any, Mapping, Optional

import torch
import torch.nn.functional as F

from src.errors import UsageError
from src.loop.batches import call_model
from src.objectives.base import Objective, PerSample
from src.schema.signature import Arg


class CrossEntropy(Objective):
    """Class or next-token targets given by the data: logits (..., C) against targets (...).
    Targets equal to `ignore_index` count for nothing."""

    metric_names = ("loss", "accuracy")

    def __init__(self, ignore_index: Annotated[int, Arg("target value that counts for nothing")] = -100,
                 chunk_tokens: Annotated[Optional[int], Arg(
                     "training: compute the loss through the model's output layer this many tokens at a time, "
                     "recomputing each chunk's logits in the backward pass, so that the fp32 logits of a whole "
                     "micro-batch are never held (large vocabularies; src/objectives/chunked.py); null: at once",
                     ge=1)] = None, **base):
        super().__init__(**base)
        self.ignore_index, self.chunk_tokens = ignore_index, chunk_tokens

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
        loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index,
                               reduction="none").view(targets.shape)
        return self._per_sample(loss, logits.argmax(-1) == targets, targets)

    # objective.chunk_tokens: the model's output layer computes the loss a chunk of tokens at a time
    # (src/objectives/chunked.py). Within output_layer_loss(model, self, self.output_layer_targets(...)) the model
    # returns what chunked_loss_sum (training) or chunked_token_scores (evaluation) gives, and the two methods
    # after them read it. Distillation has its own (src/objectives/distillation.py).

    def output_layer_targets(self, inputs: Any, targets: torch.Tensor) -> Any:
        return targets

    def chunked_loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         targets: torch.Tensor) -> torch.Tensor:
        from src.objectives.chunked import chunked_loss_sum

        return chunked_loss_sum(hidden, weight, bias, targets, self)

    def chunked_token_scores(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             targets: torch.Tensor) -> torch.Tensor:
        from src.objectives.chunked import chunked_token_scores

        return chunked_token_scores(hidden, weight, bias, targets, self)

    def loss_sum_from_output_layer(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return call_model(model, inputs)

    def metrics_from_output_layer(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor
                                  ) -> dict[str, PerSample]:
        return self.metrics_of_token_scores(call_model(model, inputs), targets)

    def metrics_of_token_scores(self, scores: torch.Tensor, targets: torch.Tensor) -> dict[str, PerSample]:
        """metrics() from each aligned target's (loss, likeliest token is it), as objective.chunk_tokens computes
        them through the output layer (src/objectives/chunked.py)."""
        _, targets = self.aligned(targets, targets)
        return self._per_sample(scores[..., 0], scores[..., 1].bool(), targets)

    def _per_sample(self, loss: torch.Tensor, correct: torch.Tensor, targets: torch.Tensor) -> dict[str, PerSample]:
        counted = targets != self.ignore_index
        correct = correct & counted
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
