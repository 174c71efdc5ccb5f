"""A reward model trained on preference pairs (objective=reward with model.head=reward): the Bradley-Terry loss of
TRL's RewardTrainer and InstructGPT's reward model.

The model gives one value per position (model.head=reward: the output layer of a language model, one wide); an
answer's reward is its value at the answer's last token, where the model has read the prompt and the whole answer.
Per pair, the loss is -log sigmoid(r_chosen - r_rejected), plus center_rewards_coefficient x (r_chosen +
r_rejected)² (TRL's, after Eisenstein et al. 2023), which keeps the rewards centred on zero. Pairs are the data's
as for DPO (data.preference=true: chosen rows then rejected, padded or packed); like every objective here it
returns sums over the pairs, so it is exact on any number of processes and micro-batches. Metrics are TRL's:
rewards/chosen, rewards/rejected, rewards/accuracies (how often the chosen answer scores higher), rewards/margins.

The export of a transformers model is a sequence classifier with one label
(`AutoModelForSequenceClassification.from_pretrained(RUN/model)`, src/checkpointing/reward_export.py), the form
TRL's and OpenRLHF's online trainers read a reward model in.
"""

from typing import Annotated, ClassVar, Mapping

import torch
import torch.nn.functional as F

from src.errors import UsageError
from src.loop.batches import call_model
from src.objectives.preference import NOT_MODEL_INPUTS, PreferenceObjective, halves
from src.schema.signature import Arg

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


class Reward(PreferenceObjective):
    pair_metric_names: ClassVar[tuple[str, ...]] = REWARD_METRICS
    metric_names: ClassVar[tuple[str, ...]] = ("loss", *REWARD_METRICS)

    def __init__(self,
                 center_rewards_coefficient: Annotated[float, Arg(
                     "weight of (r_chosen + r_rejected)² in the loss, keeping the rewards centred on zero (TRL's; "
                     "0: none)", ge=0)] = 0.0,
                 ignore_index: Annotated[int, Arg("label value that counts for nothing")] = -100,
                 target_key: Annotated[str, Arg("the batch key holding the targets (mapping batches)")] = "labels"):
        super().__init__(ignore_index=ignore_index, target_key=target_key)
        self.center_rewards_coefficient = center_rewards_coefficient

    def pairs(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each row's reward: the model's value at its answer's last token (in fp32)."""
        values = call_model(model, {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS})
        if values.shape[-1] != 1:
            raise UsageError(f"objective=reward reads one value per position, but the model gives {values.shape[-1]}: "
                             "use model.head=reward (a language model's output layer, one value wide)")
        values = values[..., 0].float()
        if "packed_at" in inputs:  # packed answers: each padded row's positions read back from the packed rows
            values = values.flatten()[inputs["packed_at"]]
        positions = torch.arange(targets.shape[1], device=targets.device)
        last = torch.where(targets != self.ignore_index, positions, -1).amax(-1)
        return {"rewards": values.gather(1, last.clamp(min=0)[:, None])[:, 0]}

    def pair_losses(self, pairs: dict) -> torch.Tensor:
        chosen, rejected = halves(pairs["rewards"])
        losses = -F.logsigmoid(chosen - rejected)
        if self.center_rewards_coefficient:
            losses = losses + self.center_rewards_coefficient * (chosen + rejected) ** 2
        return losses

    def metric_values(self, pairs: dict) -> list[torch.Tensor]:
        chosen, rejected = halves(pairs["rewards"].detach())
        return [chosen, rejected, (chosen > rejected).float(), chosen - rejected]
