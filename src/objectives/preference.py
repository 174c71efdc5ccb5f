"""Preference objectives: DPO and its siblings on pairs of answers (`objective=dpo`, `simpo`, `orpo`).

The data gives B pairs as 2B rows, chosen then rejected (src/data/preference.py), so both answers go through the
model in one forward pass, as TRL does; packed (data.packing=true), the answers share the model's rows, and
next_token_logps reads each one's back into the padded layout that everything after it sees. Each row's
log-probability is the sum of its answer tokens' (the labels that are not -100); the losses and the metrics are
TRL's (DPOTrainer's loss_type sigmoid / ipo / hinge / robust, CPOTrainer's simpo, ORPOTrainer's), with TRL's names:
rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected.

Exact over the global batch: as every objective here, these return sums and counts (src/objectives/base.py), so a
step's loss is the mean over the pairs of the whole global batch however it is split into processes and
micro-batches. The language-model term (ORPO's, and SimPO's and DPO's sft_weight) is a mean over tokens, not
pairs: a second term with its own count (the chosen rows' tokens), so it is exact too. The training metrics are
summed over the step's global batch the same way and read only at logging steps (no host sync per step). With
objective.chunk_tokens the log-probabilities come from the model's output layer a chunk of positions at a time
(src/objectives/chunked.py), never from a whole batch's logits.

DPO's reference model (`objective.reference`):
- `adapter`: the model with its LoRA adapter switched off (peft's disable_adapter, as TRL does): the base weights
  are the reference, with no second copy in memory. The default where the model has an adapter.
- `copy`: a frozen copy of the starting weights, on each process (TRL's ref_model). Not under FSDP, which would
  hold it whole on every rank: use `precomputed` or LoRA there.
- `precomputed`: the starting model's log-probabilities of every training and validation pair, computed once before
  the first step (on all processes, sharded as training is) and kept with the run (reference_logps.safetensors),
  so a resume reads them rather than computing them again with another batch layout. No reference in memory at
  all, at the cost of one forward pass over the data. The default under FSDP without an adapter.
The reference runs without dropout (eval mode) and without gradients.
"""

import math
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Mapping, Optional

import torch
import torch.nn.functional as F

from src.errors import UsageError
from src.loop.batches import call_model
from src.objectives.base import Objective, PerSample
from src.objectives.chunked import output_layer_token_logps
from src.schema.signature import Arg

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
REFERENCE_FILE = "reference_logps.safetensors"
NOT_MODEL_INPUTS = ("pair_index", "reference_logps", "packed_at")  # batch keys the objective reads, the model not


def next_token_logps(logits: torch.Tensor, inputs: Mapping) -> torch.Tensor:
    """(2B, T-1): each row's log-probability of its token t+1 at position t, in fp32 whatever the autocast dtype,
    in the padded layout of the labels (in_padded_layout)."""
    logits, ids = logits[:, :-1].float(), inputs["input_ids"][:, 1:]
    return in_padded_layout(logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1), inputs)


def in_padded_layout(per_token: torch.Tensor, inputs: Mapping) -> torch.Tensor:
    """Per-token values of the model's input rows in the padded layout of the labels: a packed batch's
    (data.packing=true, src/data/preference.py) read back through `packed_at` (what a row's last token predicts
    there is the next row's, never counted)."""
    if "packed_at" not in inputs:
        return per_token
    return F.pad(per_token, (0, 1)).flatten()[inputs["packed_at"][:, :-1]]


def answer_logps(token_logps: torch.Tensor, labels: torch.Tensor, ignore_index: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its answer tokens (the labels that are not ignored; a label is its
    row's input token there), and how many there are."""
    counted = labels[:, 1:] != ignore_index
    return (token_logps * counted).sum(-1), counted.sum(-1)


def model_answer_logps(model: torch.nn.Module, inputs: Mapping, labels: torch.Tensor, ignore_index: int,
                       chunk_tokens: Optional[int] = None, keep_from: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's answer_logps of a batch of pairs, padded or packed, and its next_token_logps. `chunk_tokens`:
    computed by the model's output layer that many positions at a time (src/objectives/chunked.py), never from
    the logits of the whole batch. `keep_from` (padded rows, a model taking transformers' logits_to_keep): no
    target is counted before that position, whose output layer is not computed (0 there)."""
    model_inputs = {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS}
    ids = inputs["input_ids"]
    if keep_from:
        model_inputs["logits_to_keep"], ids = ids.shape[1] - keep_from, ids[:, keep_from:]
    if chunk_tokens is None:
        token_logps = next_token_logps(call_model(model, model_inputs), {**inputs, "input_ids": ids})
    else:
        with output_layer_token_logps(model, ids, chunk_tokens):
            token_logps = in_padded_layout(call_model(model, model_inputs), inputs)
    token_logps = F.pad(token_logps, (keep_from, 0)) if keep_from else token_logps
    return (*answer_logps(token_logps, labels, ignore_index), token_logps)


def halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rows, rejected rows) of a batch of pairs."""
    return values.chunk(2, dim=0)


class PreferenceObjective(Objective):
    """Pairs of answers; subclasses say how a pair's log-probabilities become its loss and rewards, and whether a
    language-model term on the chosen rows joins it (a mean over tokens: a second term with its own count)."""

    metric_names: ClassVar[tuple[str, ...]] = ("loss", *PAIR_METRICS)
    pair_metric_names: ClassVar[tuple[str, ...]] = PAIR_METRICS  # what metric_values gives, in its order
    shifts_targets = True
    trains_on_pairs: ClassVar[bool] = True  # checked against data.preference before the run starts
    lm_weight: float = 0.0  # the language-model term's weight (0: none)

    def __init__(self, beta: Annotated[float, Arg("the strength of the preference (TRL's beta)", gt=0)] = 0.1,
                 ignore_index: Annotated[int, Arg("label value that counts for nothing")] = -100,
                 chunk_tokens: Annotated[Optional[int], Arg(
                     "compute the answers' log-probabilities through the model's output layer this many tokens at a "
                     "time (each chunk's logits recomputed in the backward pass), so that the fp32 logits of a whole "
                     "micro-batch of pairs are never held (large vocabularies; src/objectives/chunked.py); null: at "
                     "once", ge=1)] = None, **base):
        super().__init__(**base)
        self.beta, self.ignore_index, self.chunk_tokens = beta, ignore_index, chunk_tokens
        # The training micro-batches' metric sums since the last read, on the device: one tensor added to, as a
        # list appended to inside a compiled step would recompile it for each micro-batch of an accumulation window
        # (the compiler guards on the list's length).
        self._sums: Optional[torch.Tensor] = None

    # What the loop calls -------------------------------------------------------------------------------------------

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        pairs = torch.tensor(targets.shape[0] // 2, device=targets.device)
        return torch.stack([pairs, self.lm_counted(targets).sum()]) if self.lm_weight else pairs

    def throughput_count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets[:, 1:] != self.ignore_index).sum()  # both answers' tokens, as causal_lm counts its targets

    def model_loss_sum(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> torch.Tensor:
        pairs = self.pairs(model, inputs, targets)
        sums = torch.stack([values.detach().sum() for values in self.metric_values(pairs)])
        self._sums = sums if self._sums is None else self._sums + sums
        pair_sum = self.pair_losses(pairs).sum()
        if not self.lm_weight:
            return pair_sum
        return torch.stack([pair_sum, self.lm_weight * self.lm_losses(pairs, inputs, targets).sum()])

    def model_metrics(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> dict[str, PerSample]:
        pairs = self.pairs(model, inputs, targets)
        losses = self.pair_losses(pairs)
        ones = torch.ones_like(losses)
        metrics = {name: (values, ones) for name, values in zip(self.pair_metric_names, self.metric_values(pairs))}
        if not self.lm_weight:
            return {"loss": (losses, ones), **metrics}
        lm_tokens = self.lm_counted(targets).sum(-1)  # the language-model term: a mean over its tokens
        return {"pair_loss": (losses, ones), "nll_loss": (self.lm_losses(pairs, inputs, targets), lm_tokens),
                **metrics}

    def completed_metrics(self, averages: dict[str, float]) -> dict[str, float]:
        if self.lm_weight and "pair_loss" in averages:  # each term averaged exactly over its own count
            averages = {"loss": averages["pair_loss"] + self.lm_weight * averages["nll_loss"], **averages}
        return averages

    def training_metrics(self) -> dict[str, torch.Tensor]:
        """name -> this rank's sum over the pairs trained on since the last call (on the device); the loop
        reduces them over processes and divides by the pairs at a logging step."""
        if self._sums is None:
            return {}
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        return dict(zip(self.pair_metric_names, sums))

    def start(self, accelerator, model: torch.nn.Module, data, run_dir: Path, checkpoint: Optional[Path]) -> None:
        # Before the first micro-batch, so that every (compiled) step adds to a tensor: one graph, not two.
        self._sums = torch.zeros(len(self.pair_metric_names), device=accelerator.device)

    def check_batch(self, inputs: Mapping, targets: torch.Tensor) -> None:
        if not isinstance(inputs, Mapping) or "pair_index" not in inputs or targets.shape[0] % 2:
            raise UsageError(f"objective={type(self).__name__.lower()} trains on preference pairs: use data=jsonl or "
                             "data=hf_dataset with data.preference=true (rows with chosen, rejected and a prompt)")

    # The pairs' numbers ----------------------------------------------------------------------------------------------

    def pairs(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's per-row answer log-probabilities and token counts, and its per-token log-probabilities."""
        logps, tokens, token_logps = self.model_logps(model, inputs, targets)
        return {"logps": logps, "tokens": tokens, "token_logps": token_logps, **{
            k: inputs[k] for k in ("reference_logps",) if k in inputs}}

    def model_logps(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """model_answer_logps as this objective computes them: the policy's, and a reference model's."""
        return model_answer_logps(model, inputs, targets, self.ignore_index, self.chunk_tokens)

    def metric_values(self, pairs: dict) -> list[torch.Tensor]:
        """Per pair, in the order of pair_metric_names."""
        chosen_reward, rejected_reward, chosen_logps, rejected_logps = self.rewards(pairs)
        return [chosen_reward, rejected_reward, (chosen_reward > rejected_reward).float(),
                chosen_reward - rejected_reward, chosen_logps, rejected_logps]

    def mean_logps(self, pairs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) answers' log-probability per token: the reference-free objectives' rewards."""
        return halves(pairs["logps"] / pairs["tokens"].clamp(min=1))

    def pair_losses(self, pairs: dict) -> torch.Tensor:
        raise NotImplementedError

    def rewards(self, pairs: dict) -> tuple[torch.Tensor, ...]:
        """(chosen reward, rejected reward, chosen logps, rejected logps) per pair, as TRL logs them."""
        raise NotImplementedError

    def lm_counted(self, targets: torch.Tensor) -> torch.Tensor:
        """Which (shifted) positions of the chosen rows the language-model term counts: their answer tokens."""
        return halves(targets)[0][:, 1:] != self.ignore_index

    def lm_losses(self, pairs: dict, inputs: Mapping, targets: torch.Tensor) -> torch.Tensor:
        """The language-model term summed per chosen row over lm_counted's tokens: the answer's, here."""
        return -halves(pairs["logps"])[0]


class DPO(PreferenceObjective):
    """Direct preference optimisation against a reference model: TRL's DPOTrainer and its loss_types."""

    def __init__(self,
                 loss_type: Annotated[Literal["sigmoid", "ipo", "hinge", "robust"], Arg(
                     "TRL's loss_type: sigmoid (DPO), ipo (per-token log-ratios, squared), hinge (SLiC), robust "
                     "(rDPO: labels flipped with probability label_smoothing)")] = "sigmoid",
                 label_smoothing: Annotated[float, Arg("loss_type=robust: the probability that a pair's preference "
                                                       "is flipped", ge=0, lt=0.5)] = 0.0,
                 reference: Annotated[Literal["auto", "adapter", "copy", "precomputed"], Arg(
                     "the reference model: adapter (the LoRA adapter switched off), copy (a frozen copy of the "
                     "starting weights), precomputed (the starting weights' log-probabilities, computed once before "
                     "training); auto: adapter with a LoRA adapter, else precomputed under FSDP, else copy"
                     )] = "auto",
                 sft_weight: Annotated[float, Arg(
                     "the weight of a language-model loss on the chosen answers' tokens, added to the preference "
                     "loss (RPO; Llama 3's DPO used 0.2; TRL's loss_type [..., sft] with this loss_weight)", ge=0)
                 ] = 0.0,
                 **preference):
        super().__init__(**preference)
        if label_smoothing and loss_type != "robust":
            raise UsageError(f"objective.label_smoothing={label_smoothing} is for objective.loss_type=robust (TRL's "
                             f"{loss_type} loss has none)")
        self.loss_type, self.label_smoothing, self.reference_kind = loss_type, label_smoothing, reference
        self.reference = None  # src/objectives/reference.py, set by start()
        self.lm_weight = sft_weight  # a mean over the chosen answers' tokens: a second term with its own count
        if sft_weight:
            self.metric_names = ("loss", *PAIR_METRICS, "nll_loss", "pair_loss")

    def pair_losses(self, pairs: dict) -> torch.Tensor:
        chosen, rejected = halves(pairs["logps"] - pairs["reference_logps"])  # log-ratios against the reference
        delta, beta = chosen - rejected, self.beta
        if self.loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if self.loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if self.loss_type == "ipo":  # TRL's: per answer token, so that beta means the same for any length
            chosen_tokens, rejected_tokens = halves(pairs["tokens"].clamp(min=1))
            return (chosen / chosen_tokens - rejected / rejected_tokens - 1 / (2 * beta)) ** 2
        eps = self.label_smoothing  # robust
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)

    def rewards(self, pairs: dict) -> tuple[torch.Tensor, ...]:
        chosen, rejected = halves(pairs["logps"].detach() - pairs["reference_logps"])
        return (self.beta * chosen, self.beta * rejected, *halves(pairs["logps"].detach()))

    def start(self, accelerator, model: torch.nn.Module, data, run_dir: Path, checkpoint: Optional[Path]) -> None:
        from src.objectives.reference import Reference  # it reads answer_logps from here

        super().start(accelerator, model, data, run_dir, checkpoint)
        self.reference = Reference.build(self.reference_kind, accelerator, model, data, run_dir, checkpoint, self)

    def with_reference(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> Mapping:
        if self.reference is None:
            raise RuntimeError("objective=dpo: start() was not called, so there is no reference model")
        return {**inputs, "reference_logps": self.reference(model, inputs, targets)}


class SimPO(PreferenceObjective):
    """Simple preference optimisation, reference-free: each answer's mean log-probability per token is its reward,
    with a target margin (TRL's CPOTrainer with loss_type=simpo; sft_weight is its cpo_alpha)."""

    def __init__(self, beta: Annotated[float, Arg("the reward's scale (SimPO's beta)", gt=0)] = 2.0,
                 simpo_gamma: Annotated[float, Arg("the target reward margin (SimPO's gamma)")] = 0.5,
                 label_smoothing: Annotated[float, Arg("the probability that a pair's preference is flipped "
                                                       "(conservative)", ge=0, lt=0.5)] = 0.0,
                 sft_weight: Annotated[float, Arg("the weight of a language-model loss on the chosen answers' tokens "
                                                  "(TRL's cpo_alpha; 0: SimPO as published)", ge=0)] = 0.0,
                 **preference):
        super().__init__(beta=beta, **preference)
        self.simpo_gamma, self.label_smoothing, self.lm_weight = simpo_gamma, label_smoothing, sft_weight
        if sft_weight:
            self.metric_names = ("loss", *PAIR_METRICS, "nll_loss", "pair_loss")

    def pair_losses(self, pairs: dict) -> torch.Tensor:
        chosen, rejected = self.mean_logps(pairs)
        margin = chosen - rejected - self.simpo_gamma / self.beta
        eps = self.label_smoothing
        return -F.logsigmoid(self.beta * margin) * (1 - eps) - F.logsigmoid(-self.beta * margin) * eps

    def rewards(self, pairs: dict) -> tuple[torch.Tensor, ...]:
        chosen, rejected = (m.detach() for m in self.mean_logps(pairs))
        return self.beta * chosen, self.beta * rejected, chosen, rejected


class ORPO(PreferenceObjective):
    """Odds-ratio preference optimisation, reference-free: a language-model loss on the chosen rows (prompt and
    answer, as TRL's ORPOTrainer) plus beta times minus the log-sigmoid of the answers' log odds ratio (from their
    per-token mean log-probabilities)."""

    pair_metric_names = (*PAIR_METRICS, "log_odds_ratio", "log_odds_chosen")
    metric_names = ("loss", *pair_metric_names, "nll_loss", "pair_loss")
    lm_weight = 1.0

    def pair_losses(self, pairs: dict) -> torch.Tensor:
        return -self.beta * F.logsigmoid(self._log_odds(pairs))

    def _log_odds(self, pairs: dict) -> torch.Tensor:
        chosen, rejected = self.mean_logps(pairs)
        return (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))

    def rewards(self, pairs: dict) -> tuple[torch.Tensor, ...]:
        chosen, rejected = (m.detach() for m in self.mean_logps(pairs))
        return self.beta * chosen, self.beta * rejected, chosen, rejected

    def metric_values(self, pairs: dict) -> list[torch.Tensor]:
        log_odds = self._log_odds(pairs).detach()
        return [*super().metric_values(pairs), F.logsigmoid(log_odds), log_odds]

    def lm_counted(self, targets: torch.Tensor) -> torch.Tensor:
        """Every token of the chosen rows up to the answer's end, the prompt's too (shifted): a row ends at its
        last answer label, and what follows is padding."""
        chosen, _ = halves(targets)
        positions = torch.arange(chosen.shape[1], device=chosen.device)
        last = torch.where(chosen != self.ignore_index, positions, -1).amax(-1, keepdim=True)
        return (positions <= last)[:, 1:]

    def lm_losses(self, pairs: dict, inputs: Mapping, targets: torch.Tensor) -> torch.Tensor:
        return -(halves(pairs["token_logps"])[0] * self.lm_counted(targets)).sum(-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (as TRL's)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
