"""What training minimises and evaluation reports: the `objective` config group.

An objective works on the model's logits and the batch's targets. It returns SUMS and COUNTS, never means,
because a mean per micro-batch weights samples wrongly when they hold different numbers of targets
(padding, ignored positions): the loop divides the sum over a whole optimizer step's global batch by that
batch's target count (src/loop/accumulation.py), and evaluation divides the sum over the whole validation set by
its count. So a loss and its metrics are exact on any number of processes and any accumulation.

Your own objective: subclass `Objective`, implement the three methods, and point a YAML at it
(`config/objective/NAME.yaml` with `_target_: your.module.YourObjective`). No other file changes.
"""

from typing import Annotated, Any, ClassVar, Mapping

import torch

from src.loop.batches import call_model
from src.schema.signature import Arg

PerSample = tuple[torch.Tensor, torch.Tensor]  # (sum of a metric per sample, what it averages over per sample)


class Objective:
    # What evaluate() reports, as eval/<name> (trainer.monitor is checked against these before a run starts).
    metric_names: ClassVar[tuple[str, ...]] = ("loss",)
    # Whether the objective aligns targets that equal the inputs itself (Hugging Face's labels convention).
    shifts_targets: ClassVar[bool] = False
    # Whether a spike of train/loss means trouble (trainer.spike_factor watches it): not for a policy gradient's
    # loss, which is about 0 in value whatever the policy does (src/objectives/grpo.py).
    loss_spikes_matter: ClassVar[bool] = True

    def __init__(self, target_key: Annotated[str, Arg("the batch key holding the targets (mapping batches)")]
                 = "labels"):
        self.target_key = target_key

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """How many targets `loss_sum` sums over (a scalar tensor, or one per term where model_loss_sum returns
        several; known before the forward pass)."""
        raise NotImplementedError

    def throughput_count(self, targets: torch.Tensor) -> torch.Tensor:
        """The tokens (or samples) train/tokens_per_second and MFU count: the targets, unless the loss counts
        something else (pairs)."""
        return self.count(targets)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss summed over the counted targets of this micro-batch (a scalar tensor)."""
        raise NotImplementedError

    def metrics(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, PerSample]:
        """name -> (per-sample sums, per-sample weights), each of shape (batch,): evaluation averages
        sum(sums) / sum(weights) over the whole validation set, exactly across processes."""
        raise NotImplementedError

    def check_batch(self, inputs: Mapping, targets: torch.Tensor) -> None:
        """Called on the first training batch: stop on a batch this objective would silently mis-train on."""

    # An objective that needs more of the model than its logits of one batch (a reference model's, several terms)
    # overrides these; the others have nothing to change. src/objectives/preference.py is the example.

    def model_loss_sum(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The forward pass and loss_sum. May return one sum per term of the loss, as count() counts them: the
        loss is then the sum of each term's sum over its own count (the first count is what throughput counts)."""
        return self.loss_sum(call_model(model, inputs), targets)

    def model_metrics(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> dict[str, PerSample]:
        return self.metrics(call_model(model, inputs), targets)

    def completed_metrics(self, averages: dict[str, float]) -> dict[str, float]:
        """Evaluation's averages, with what is computed from several of them (a loss of terms with their own
        counts)."""
        return averages

    def start(self, accelerator, model: torch.nn.Module, data, run_dir, checkpoint) -> None:
        """Called once the model is prepared, before a resume loads `checkpoint` (None: a fresh run): the model as
        it starts."""

    def before_step(self, step: int) -> None:
        """Called before each optimizer step with its number (0 for the first): objective=grpo seeds its
        completions with it."""

    def prepare_window(self, model: torch.nn.Module, window: list[tuple[Any, torch.Tensor]]
                       ) -> list[tuple[Any, torch.Tensor]]:
        """Called once per optimizer step, before any of it trains, with its micro-batches as (inputs, targets):
        returns them, with what must exist for the whole window before its targets can be counted (objective=grpo:
        every completion of the step, written and scored, as inputs, and their labels as targets)."""
        return window

    def with_reference(self, model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> Any:
        """The inputs with what is computed outside the (compiled) step: a reference model's numbers
        (objective=grpo: in evaluation, the completions themselves, written and scored)."""
        return inputs

    def evaluation_texts(self) -> dict[str, str]:
        """name -> Markdown that the last evaluation showed this rank (objective=grpo: completions and their
        rewards), logged by rank 0 to TensorBoard's text tab; called after each evaluation on every rank."""
        return {}

    def rank_state(self) -> dict[str, Any]:
        """What this rank keeps in each checkpoint beside the training's state, for a resume to continue exactly
        (objective=grpo with num_iterations > 1: the completions that the next steps train on again), as
        objective_state_<rank>.safetensors; the objective reads it back itself (start's `checkpoint`). Nothing here."""
        return {}

    def training_metrics(self) -> dict[str, torch.Tensor]:
        """name -> this rank's sum over the samples trained on since the last call, for metrics besides the loss
        that training reports (averaged over the samples of those steps' global batches); or (sum, count), a
        metric averaged over a count of its own (objective=grpo's over tokens)."""
        return {}
