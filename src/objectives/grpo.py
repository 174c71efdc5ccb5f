"""Group relative policy optimisation (`objective=grpo` with `data=prompts`): reinforcement learning from a reward
function, on completions the model being trained writes itself (DeepSeekMath's GRPO, as TRL's GRPOTrainer computes
it with its defaults: loss_type=dapo, scale_rewards=group, num_iterations=1, beta=0).

Each step, for every prompt of the batch the model writes `num_generations` completions; the reward function scores
them; a completion's advantage is its reward less the mean of its prompt's group (divided by the group's standard
deviation, or the global batch's: `scale_rewards`), and the loss raises the log-probability of the completions that
did better than their group and lowers the others'. Each token's loss is -exp(logp_t - sg(logp_t)) A, and the step's
loss (`loss_type`):

    dapo:     the sum over every completion token of the global batch / their number   (DAPO: no length bias)
    grpo:     the mean over completions of each one's mean over its tokens    (a short right answer weighs more)
    dr_grpo:  the sum over tokens / (completions x max_completion_tokens)     (Dr. GRPO: no length bias)

The denominators are counts of the whole global batch (src/loop/accumulation.py), so the loss is exact on any
layout: every completion of the step is written before any of it trains (prepare_window; the weights do not change
within a step, so that is what writing each before its own micro-step would draw), and dapo counts their tokens.

Each token's loss is PPO's clipped surrogate, -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A), ratio
the token's probability over that of the policy that wrote it. By default (num_iterations=1) that policy is the one
training, so the ratio is exp(logp - sg(logp)): 1 in value, nothing clipped, its gradient the policy gradient. With
num_iterations=mu each batch of completions trains mu steps in a row (TRL's num_iterations): the data gives each
global batch's prompts mu times (src/data/sampling.py's RepeatedWindows: an epoch is mu times as many steps), the
first of those steps writes the completions and keeps the log-probabilities of the policy that wrote them, the next
ones reuse both, and the clip bounds how far each may move from it (train/clip_ratio/low and /high: the tokens it
held back). Each process keeps its own micro-batches' completions in every checkpoint taken within such a cycle
(they cannot be written again: the policy that wrote them is gone), so a resume there continues exactly on the same
layout and is refused on another. importance_sampling_level=sequence (GSPO) uses each completion's mean log-ratio
for all its tokens. With objective.beta > 0 each token's loss
adds beta x its KL divergence from a reference model (TRL's k3 estimate: exp(r) - r - 1, r the reference's log-
probability less the policy's, times the importance ratio (1 in value with num_iterations=1), for the unbiased gradient:
use_bias_correction_kl, TRL's default): the LoRA base with the adapter off, or a frozen copy of the starting
weights. The default is none (TRL's beta=0, after DAPO and Dr. GRPO). `mask_truncated_completions` (DAPO) trains on
no completion cut at max_completion_tokens.

Exact, as everything here: a prompt's completions are drawn from its own random stream, seeded by (objective.seed,
the step, the prompt's number) alone, so the same prompt gets the same completions on any number of processes and
micro-steps, a resumed run draws what the run it continues would have drawn, and training's own random state
(dropout, data order) is left untouched.

Generation, without gradients or dropout, in the run's precision, through the model's own forward (under FSDP the
root module's, which gathers the weights: with gather_for_generation, the default, each block's once for the whole
generation, kept gathered until it ends, instead of again for every token), with a KV cache (a transformers
model's, or src/models/gpt.py's).
The micro-batch's prompts are written together, left-padded to the longest, each from its own stream (2.2 times the
walkthrough's tokens/s of one prompt's group at a time, the same draws): a micro-batch holds the same prompts on
every layout of the same data.batch_size, so the padding, and what rounding it brings, is the same there too.
generation_batch=prompt writes one prompt's group at a time (unpadded; a model without position_ids does so).
With packing, the training passes read each micro-batch's rows packed (src/data/preference.py's packed_rows, as
data.packing=true packs pairs; each row attends to itself), read back into the padded layout; rows that train
nothing (completions cut with mask_truncated_completions) are left out. Unpacked, the output layer computes the
positions from the shortest prompt's last token on alone (transformers' logits_to_keep, which the template's GPT
takes too): no completion token is predicted before it.
A completion ends at the tokenizer's end-of-text token, which it is trained to write, or after
max_completion_tokens; under FSDP without gather_for_generation every rank writes max_completion_tokens (each pass
is a collective), and what follows an end is dropped. Generation is a step's slow part: TRL and OpenRLHF hand it to
vLLM for large models; here it stays in the training process (one copy of the weights, nothing to synchronise), which
suits small models.

The reward function (`objective.reward`, a dotted path) has TRL's signature: reward(prompts, completions,
**columns) -> one float per completion. `prompts` are the rows' prompts as the file writes them (strings or message
lists), each repeated for its group; `completions` the texts written (the end-of-text token left out); `columns`
the rows' other columns, lists aligned with the completions. src/objectives/rewards.py has examples.

Training reports TRL's numbers: train/reward, train/reward_std (the groups' mean standard deviation: zero means
nothing to learn from), train/completion_length, train/clipped_ratio (completions cut at max_completion_tokens),
train/entropy (the mean entropy per token written of the policy's distribution it was drawn from: a collapse
towards 0 means little left to explore),
with beta train/kl (the mean divergence per token trained on, as TRL's), with num_iterations > 1
train/clip_ratio/low and /high (the share of the tokens trained on whose ratio the clip held back), with several
rewards train/rewards/NAME (each one's mean, unweighted).
Evaluation writes eval_generations completions per validation prompt from a stream seeded without the step, and
reports eval/reward (the default trainer.monitor, higher better), eval/completion_length, eval/clipped_ratio,
eval/entropy.
"""

import contextlib
import inspect
import json
import logging
import math
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from src.checkpointing.checksums import verified
from src.checkpointing.plain_state import load_tree
from src.checkpointing.training_state import objective_state_file, sharded
from src.data.base import IGNORE_INDEX
from src.data.packing import attend_per_document
from src.data.preference import packed_rows
from src.data.tokenizer import check_same_ids
from src.errors import UsageError
from src.loop.batches import call_model
from src.models.gpt import KVCache
from src.models.hf_causal_lm import output_width
from src.models.pretrained_slices import export_without_values, shard_frozen
from src.objectives.base import Objective, PerSample
from src.objectives.preference import model_answer_logps
from src.objectives.reference import AdapterOff, FrozenCopy, Reference, evaluating
from src.schema.signature import Arg

log = logging.getLogger(__name__)

METRICS = ("reward", "reward_std", "completion_length", "clipped_ratio", "entropy")  # and kl, with objective.beta
MODEL_INPUTS = ("input_ids", "attention_mask")
EVALUATION = 1 << 40  # the "step" that seeds evaluation's completions: never a training step


def seed_of(seed: int, step: int, prompt: int) -> int:
    """The random seed of one prompt's completions at one step (a fixed mix of the three, never the layout)."""
    return ((seed * 1_000_003 + step) * 1_000_003 + prompt) % (1 << 63)


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The logits (rows, vocabulary) with all but each row's nucleus at -inf: its likeliest tokens whose
    probabilities reach top_p together (Holtzman et al.; transformers' TopPLogitsWarper keeps the same set)."""
    ordered, order = logits.sort(-1, descending=True)
    probabilities = ordered.softmax(-1)
    outside = probabilities.cumsum(-1) - probabilities >= top_p  # the mass before it already reaches top_p
    return logits.masked_fill(outside.scatter(-1, order, outside), -math.inf)


def takes(model: torch.nn.Module, argument: str) -> bool:
    """Whether the model's forward (a peft model's base's) takes `argument`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return argument in inspect.signature(base.forward).parameters


def reward_function(path: str) -> Callable:
    from hydra.utils import get_method

    try:
        return get_method(path)
    except Exception as error:  # hydra wraps what it could not import in its own error
        raise UsageError(f"objective.reward={path}: not a function that can be imported ({error}); give a dotted "
                         "path, module.function, e.g. src.objectives.rewards.final_number") from None


class GRPO(Objective):
    metric_names: ClassVar[tuple[str, ...]] = ("reward", "completion_length", "clipped_ratio", "entropy")
    default_monitor: ClassVar[tuple[str, str]] = ("eval/reward", "max")  # no eval/loss: the loss means nothing here
    trains_on_prompts: ClassVar[bool] = True  # checked against data=prompts before the run starts
    loss_spikes_matter: ClassVar[bool] = False  # the loss is about 0 in value: trainer.spike_factor watches nothing

    def __init__(self,
                 reward: Annotated[Optional[Union[str, list[str]]], Arg(
                     "the reward function, a dotted path: f(prompts, completions, **columns) -> a float per "
                     "completion (src/objectives/rewards.py), or a list of them, added (null: reward_model's alone)")
                 ] = "src.objectives.rewards.final_number",
                 reward_model: Annotated[Optional[str], Arg(
                     "an export of objective=reward (RUN/model) whose value at a completion's last token is its "
                     "reward, added to the function's; it must read the data's token ids (null: none)")] = None,
                 reward_weights: Annotated[Optional[list[float]], Arg(
                     "each reward's weight in the sum: the functions' in their order, then the reward model's "
                     "(null: 1 each; TRL's reward_weights)")] = None,
                 num_generations: Annotated[int, Arg("completions per prompt: the group its advantages are "
                                                     "relative to", ge=2)] = 8,
                 max_completion_tokens: Annotated[int, Arg("longest completion in tokens", ge=1)] = 32,
                 temperature: Annotated[float, Arg("sampling temperature", gt=0)] = 1.0,
                 top_k: Annotated[Optional[int], Arg("sample from the k likeliest tokens only (null: all)", ge=1)
                                  ] = None,
                 top_p: Annotated[float, Arg("sample from the likeliest tokens whose probabilities add up to top_p "
                                             "(nucleus sampling; 1: all)", gt=0, le=1)] = 1.0,
                 loss_type: Annotated[Literal["dapo", "grpo", "dr_grpo"], Arg(
                     "dapo: the tokens' loss summed over the global batch's completion tokens (DAPO; TRL's default); "
                     "grpo: each completion's loss a mean over its tokens (biased towards short right answers and "
                     "long wrong ones); dr_grpo: a sum over max_completion_tokens (Dr. GRPO)")] = "dapo",
                 scale_rewards: Annotated[Union[Literal["group", "batch", "none"], bool], Arg(
                     "divide each advantage by the standard deviation of its group's rewards (group, or true), of "
                     "the global batch's (batch: PPO-Lite), or by nothing (none, or false: Dr. GRPO)")] = "group",
                 mask_truncated_completions: Annotated[bool, Arg(
                     "train on no completion cut at max_completion_tokens (DAPO): its reward judged an unfinished "
                     "answer")] = False,
                 eval_generations: Annotated[Optional[int], Arg("completions per validation prompt (null: "
                                                                "num_generations)", ge=1)] = None,
                 beta: Annotated[float, Arg("weight of the per-token KL divergence from the reference model in the "
                                            "loss (TRL's beta, k3 estimator; 0: none and no reference)", ge=0)] = 0.0,
                 use_bias_correction_kl: Annotated[bool, Arg(
                     "with beta > 0, multiply each token's KL term by the importance ratio exp(logp - sg(logp)): 1 in "
                     "value, its gradient the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default)")] = True,
                 num_iterations: Annotated[int, Arg(
                     "optimizer steps on each batch of completions (TRL's num_iterations, GRPO's mu): the same "
                     "prompts and completions train that many steps in a row, each token's probability ratio to the "
                     "policy that wrote it clipped to [1 - epsilon, 1 + epsilon_high] (PPO's surrogate); 1: each "
                     "batch trains once, on-policy, nothing to clip", ge=1)] = 1,
                 epsilon: Annotated[float, Arg("the clip range's lower side, 1 - epsilon (and its upper side "
                                               "without epsilon_high)", gt=0, lt=1)] = 0.2,
                 epsilon_high: Annotated[Optional[float], Arg("the clip range's upper side, 1 + epsilon_high "
                                                              "(DAPO's clip-higher: 0.28; null: epsilon)", gt=0)
                                         ] = None,
                 importance_sampling_level: Annotated[Literal["token", "sequence"], Arg(
                     "token: each token's own ratio, clipped alone; sequence: the completion's (the geometric mean "
                     "of its tokens' ratios, GSPO), clipped as one")] = "token",
                 reference: Annotated[Literal["auto", "adapter", "copy"], Arg(
                     "with beta > 0, the reference: adapter (the LoRA adapter switched off), copy (a frozen copy of "
                     "the starting weights; not under FSDP); auto: adapter with a LoRA adapter, else copy")] = "auto",
                 chunk_tokens: Annotated[Optional[int], Arg(
                     "compute the completions' log-probabilities (and the reference's) through the model's output "
                     "layer this many tokens at a time, so that the fp32 logits of a whole micro-batch of "
                     "completions are never held (large vocabularies; src/objectives/chunked.py); null: at once",
                     ge=1)] = None,
                 log_completions: Annotated[int, Arg(
                     "at each evaluation, show this many validation prompts with their first completion and its "
                     "reward in TensorBoard's text tab (rank 0's first prompts; 0: none)", ge=0)] = 4,
                 generation_batch: Annotated[Literal["micro_batch", "prompt"], Arg(
                     "micro_batch: the micro-batch's prompts written together (left-padded; the same on any "
                     "layout of the same data.batch_size); prompt: one prompt's group at a time, slower, its "
                     "completions never touched by its neighbours' padding (the kernels' rounding)")] = "micro_batch",
                 packing: Annotated[bool, Arg(
                     "the training passes read each micro-batch's rows (prompt and completion) packed into as few "
                     "rows of the model's context as hold them, each attending to itself only (as data.packing=true "
                     "packs pairs), instead of each padded to the longest: less computed where completions' lengths "
                     "vary; the same loss. Needs a model that reads documents from position_ids")] = False,
                 gather_for_generation: Annotated[bool, Arg(
                     "under FSDP, gather each block's weights once for a micro-batch's whole generation and keep "
                     "them until it ends, instead of all-gathering them again for every token written (the whole "
                     "model on every process meanwhile; TRL's ds3_gather_for_generation); false: for a model whose "
                     "whole weights do not fit beside the training's state")] = True,
                 seed: Annotated[int, Arg("seeds the completions (with the step and the prompt's number)")] = 0,
                 target_key: Annotated[str, Arg("the batch key numbering the prompts")] = "prompt_index"):
        super().__init__(target_key=target_key)
        if reward is None and reward_model is None:
            raise UsageError("objective=grpo needs a reward: objective.reward (a function) or objective.reward_model "
                             "(an export of objective=reward), or both")
        names = [reward] if isinstance(reward, str) else list(reward or [])
        self.rewards = {name: reward_function(name) for name in names}
        self.reward_model_path, self.reward_model = reward_model, None  # read by start()
        sources = len(names) + (reward_model is not None)
        if reward_weights is not None and len(reward_weights) != sources:
            raise UsageError(f"objective.reward_weights={list(reward_weights)}: one weight per reward, {sources} here "
                             f"(the functions {', '.join(names) or 'none'}"
                             + (", then the reward model)" if reward_model is not None else ")"))
        self.reward_weights = torch.tensor(reward_weights or [1.0] * sources, dtype=torch.float32)
        # With several rewards, each one's mean as train/rewards/NAME (TRL's rewards/NAME/mean).
        self.reward_names = [name.rsplit(".", 1)[-1] for name in names] + (["reward_model"] if reward_model else [])
        self.per_reward = self.reward_names if sources > 1 else []
        self.num_generations, self.max_completion_tokens = num_generations, max_completion_tokens
        self.temperature, self.top_k, self.top_p, self.loss_type = float(temperature), top_k, float(top_p), loss_type
        self.scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
        self.mask_truncated_completions = mask_truncated_completions
        self.eval_generations, self.seed = eval_generations or num_generations, seed
        self.beta, self.reference_kind, self.reference = beta, reference, None  # the reference: start()
        self.use_bias_correction_kl = use_bias_correction_kl
        self.num_iterations, self.importance_sampling_level = num_iterations, importance_sampling_level
        self.epsilon_low, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        # num_iterations > 1: (the step that wrote them, the rollouts) that the cycle's later steps train on again
        self._cycle: Optional[tuple[int, list[dict]]] = None
        self.checkpoint, self._steps_taken = None, 0  # where a resume within a cycle finds its completions
        self.chunk_tokens, self.keeps_logits = chunk_tokens, False  # keeps_logits: start() reads the model
        self.generation_batch, self.gather_for_generation = generation_batch, gather_for_generation
        self.packing = packing
        self.log_completions, self._shown = log_completions, []  # evaluation's completions shown (Markdown each)
        clip_ratios = ("clip_ratio/low", "clip_ratio/high") if num_iterations > 1 else ()
        self.trained_metrics = (METRICS + (("kl",) if beta else ()) + clip_ratios
                                + tuple(f"rewards/{n}" for n in self.per_reward))
        self.step = 0  # the optimizer step being taken (before_step)
        # The metrics averaged over tokens (TRL's): each over the count it names, summed with them.
        self.per_token = {"entropy": "completion_length", **{name: "trained tokens" for name in
                                                             ("kl", *clip_ratios)}}
        self._slots = self.trained_metrics + ("trained tokens",)
        self._sums: Optional[torch.Tensor] = None  # the slots summed over the completions trained on since last read
        self._cropped_logged = False

    # The loop's hooks ----------------------------------------------------------------------------------------------

    def start(self, accelerator, model, data, run_dir, checkpoint) -> None:
        if not hasattr(data, "rows"):
            raise UsageError("objective=grpo writes completions to prompts: use data=prompts")
        self.accelerator, self.rows, self.codec = accelerator, data.rows, data.codec
        self.checkpoint = checkpoint
        self.block_size = data.block_size
        if self.max_completion_tokens >= self.block_size:
            raise UsageError(f"objective.max_completion_tokens={self.max_completion_tokens} leaves no room for a "
                             f"prompt in data.block_size={self.block_size}: lower it, or raise model.block_size")
        self._sums = torch.zeros(len(self._slots), device=accelerator.device)
        self.sharded = sharded(accelerator)
        # Whether the model computes its output layer for the last positions alone (transformers' logits_to_keep,
        # the template's GPT): the training passes skip the prompts' positions.
        self.keeps_logits = takes(accelerator.unwrap_model(model, keep_torch_compile=False), "logits_to_keep")
        # Whether each pass of generation is a collective (FSDP's all-gathers), which every rank must make alike.
        self.passes_gather = self.sharded and not self.gather_for_generation
        if self.generation_batch == "micro_batch" and not takes(accelerator.unwrap_model(model), "position_ids"):
            self.generation_batch = "prompt"
            if accelerator.is_main_process:
                log.info("objective.generation_batch=micro_batch: the model's forward takes no position_ids, which "
                         "prompts of several lengths written together need: one prompt's group at a time")
        if self.packing:  # refused, naming why, for a model whose packed rows would attend across each other
            attend_per_document(accelerator.unwrap_model(model), "objective.packing")
        if self.reward_model_path is not None:
            self.reward_model = self._load_reward_model(Path(self.reward_model_path), accelerator.device)
        if self.beta:
            self.reference = self._reference(accelerator, model)

    def _reference(self, accelerator, model: torch.nn.Module) -> Reference:
        """DPO's reference (src/objectives/reference.py) of the model as it starts (start() runs before a resume
        loads its checkpoint, so a resumed run's is the fresh run's), giving per-token log-probabilities here
        (model_logps): the model with its adapter off, or a frozen copy of its starting weights."""
        inner = accelerator.unwrap_model(model)
        has_adapter = hasattr(inner, "disable_adapter") and hasattr(inner, "peft_config")
        kind = ("adapter" if has_adapter else "copy") if self.reference_kind == "auto" else self.reference_kind
        if accelerator.is_main_process:
            log.info("objective.beta=%g: the KL divergence from objective.reference=%s", self.beta, kind)
        if kind == "adapter":
            if not has_adapter:
                raise UsageError("objective.reference=adapter needs a model with a LoRA adapter (model.peft): its "
                                 "base, with the adapter switched off, is the reference; use objective.reference=copy")
            return AdapterOff(self)
        if self.sharded:
            raise UsageError("objective.reference=copy under FSDP would hold the whole model on every rank: train a "
                             "LoRA adapter (model.peft), whose base is the reference, or set objective.beta=0")
        return FrozenCopy(accelerator, inner, self)

    def model_logps(self, model: torch.nn.Module, inputs: Mapping, targets: Any) -> tuple[torch.Tensor]:
        """What a Reference reads of a model: here the completions' per-token log-probabilities."""
        return (self.token_logps(model, inputs),)

    def _load_reward_model(self, folder: Path, device: torch.device) -> torch.nn.Module:
        """The reward model, frozen: whole on each process, or under FSDP sharded over the processes as the policy
        is (accelerate's wrapping), its weights gathered for each of its forwards and sharded again after it; there
        an export is never held whole either: every rank builds it without values and reads its own slices of the
        safetensors files (src/models/pretrained_slices.py)."""
        from src.checkpointing.export import load_exported_model

        key = f"objective.reward_model={folder}"
        if not folder.is_dir():
            raise UsageError(f"{key}: no such folder; give the export of an objective=reward run (RUN/model)")
        check_same_ids(key, folder, self.codec, "the reward model reads", "Train the reward model on data tokenized "
                       "as this run's, or tokenize the prompts as it did (data.tokenizer=its folder)")
        accept = "load_exported_model(..., trusted=[{value!r}])"
        model, slices, why = export_without_values(folder, set(), accept) if self.sharded else (None, None, "")
        if model is None:  # under FSDP read whole into host memory: the prepare moves each rank's shard only
            model = load_exported_model(folder, "cpu" if self.sharded else device)
        width = output_width(model)
        if width != 1:
            raise UsageError(f"{key}: not a reward model (its output layer gives {width} values "
                             "per position, a reward model's one): give the export of an objective=reward run")
        model.requires_grad_(False).eval()
        if not self.sharded:
            return model
        if self.accelerator.is_main_process:
            log.info("%s: sharded over the processes, as the policy is, %s", key,
                     "each rank read its own slices" if slices is not None else f"each rank read it whole ({why})")
        return shard_frozen(self.accelerator, model, slices)

    def before_step(self, step: int) -> None:
        self.step = step

    def check_batch(self, inputs: Mapping, targets: torch.Tensor) -> None:
        if not isinstance(inputs, Mapping) or "prompt_tokens" not in inputs:
            raise UsageError("objective=grpo writes completions to prompts: use data=prompts")

    def prepare_window(self, model: torch.nn.Module, window: list[tuple[Mapping, torch.Tensor]]
                       ) -> list[tuple[dict, torch.Tensor]]:
        """The step's completions, every one written and scored before any trains (the weights do not change
        within a step, so they are what writing each before its own micro-step would give): loss_type=dapo counts
        their tokens, scale_rewards=batch reads every reward of the global batch. Each micro-batch becomes its
        completions' rows, targets their labels. With num_iterations > 1 the first step of each num_iterations
        writes them; the next ones, whose data holds the same prompts (src/data/sampling.py's RepeatedWindows),
        train on the same completions again."""
        first = self.step - self.step % self.num_iterations
        if first == self.step:
            rollouts = self._written(model, window)
            self._cycle = (first, rollouts) if self.num_iterations > 1 else None
        else:
            rollouts = self._kept(model, first, window)
        self._steps_taken += 1
        group = self.num_generations
        for rollout in rollouts:  # each step reports the completions it trains on
            self._add({"reward": rollout["rewards"].sum(),
                       "reward_std": rollout["rewards"].view(-1, group).std(-1).sum() * group,
                       "completion_length": rollout["lengths"].sum(), "clipped_ratio": rollout["clipped"].sum(),
                       "entropy": rollout["entropy"].sum(),
                       **{f"rewards/{name}": scores.sum() for name, scores in zip(self.per_reward,
                                                                                   rollout["scores"])}})
        return [(rollout, rollout["labels"]) for rollout in rollouts]

    def _written(self, model: torch.nn.Module, window: list[tuple[Mapping, torch.Tensor]]) -> list[dict]:
        """The window's completions written and scored, with their advantages (and, for num_iterations > 1, the
        log-probabilities of the policy that wrote them, which the later steps' ratios are to)."""
        group = self.num_generations
        rollouts = [self.rollout(model, inputs, targets, self.step, group) for inputs, targets in window]
        batch_std = self._global_std(torch.cat([r["rewards"] for r in rollouts]))
        for rollout, (_, targets) in zip(rollouts, window):
            grouped = rollout["rewards"].view(-1, group)
            advantages = grouped - grouped.mean(-1, keepdim=True)
            if self.scale_rewards != "none":
                std = batch_std if self.scale_rewards == "batch" else grouped.std(-1, keepdim=True)
                advantages = advantages / (std + 1e-4)
            rollout["advantages"] = advantages.reshape(-1)
            rollout["prompts"] = targets  # the prompts' numbers: a later step of the cycle checks it holds them
            if self.mask_truncated_completions:  # their tokens neither trained nor counted
                rollout["labels"][rollout["clipped"].bool()] = IGNORE_INDEX
            if self.packing:  # the rows the training passes read (the padded ones stay, for what reads them)
                lengths = rollout["attention_mask"].sum(-1)
                trained = (rollout["labels"] != IGNORE_INDEX).any(-1)  # masked truncated completions: left out
                if not trained.any():  # one row kept for the passes that every process runs
                    trained = torch.arange(len(trained), device=trained.device) == 0
                lengths = lengths * trained
                packed = packed_rows(rollout["input_ids"].cpu(), lengths.tolist(), self.block_size)
                rollout.update({key if key == "packed_at" else f"packed_{key}": value.to(rollout["input_ids"].device)
                                for key, value in packed.items()})
            if self.num_iterations > 1:  # as the training pass computes them, without dropout or gradients
                with evaluating(model):
                    rollout["old_logps"] = self.token_logps(model, rollout)
        return rollouts

    def _kept(self, model: torch.nn.Module, first: int, window: list[tuple[Mapping, torch.Tensor]]) -> list[dict]:
        """The completions step `first` wrote for this step's prompts: kept since, or read from the checkpoint that
        a run resumed within the cycle from (they cannot be written again: the policy that wrote them is gone).
        A cycle whose first steps trainer.skip_steps dropped starts here instead."""
        if self._cycle is None or self._cycle[0] != first:
            kept = self._read_kept(first)
            if kept is None:
                if self._steps_taken == 0 and self.checkpoint is not None:
                    raise UsageError(self._resumed_within(first, "the checkpoint holds none of them for this "
                                                                 "process"))
                if self.accelerator.is_main_process:
                    log.info("objective.num_iterations=%d: step %d writes the completions of the steps up to %d "
                             "(the cycle's first steps were dropped by trainer.skip_steps)", self.num_iterations,
                             self.step + 1, first + self.num_iterations)
                rollouts = self._written(model, window)
                self._cycle = (first, rollouts)
                return rollouts
            self._cycle = (first, kept)
        rollouts = self._cycle[1]
        if len(rollouts) != len(window) or not all(torch.equal(rollout["prompts"], targets.to(rollout["prompts"]))
                                                   for rollout, (_, targets) in zip(rollouts, window)):
            raise UsageError(self._resumed_within(first, "this process's micro-batches hold other prompts than "
                                                         "those it kept"))
        return rollouts

    def _resumed_within(self, first: int, why: str) -> str:
        return (f"step {self.step + 1} trains again on the completions that step {first + 1} wrote "
                f"(objective.num_iterations={self.num_iterations}), which each process keeps for its own "
                f"micro-batches; {why}, as after a resume within those steps on another layout (processes x "
                "micro-steps x data.batch_size). Resume on the layout that saved the checkpoint, or from a "
                f"checkpoint at a step that is a multiple of {self.num_iterations}")

    def _read_kept(self, first: int) -> Optional[list[dict]]:
        """The completions of the cycle from step `first` in the checkpoint resumed from, for this process."""
        if self.checkpoint is None:
            return None
        file = self.checkpoint / objective_state_file(self.accelerator.process_index)
        if not file.is_file():
            return None
        kept, device = load_tree(verified(self.checkpoint, file)), self.accelerator.device
        if kept["step"] != first:
            return None
        return [{key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in rollout.items()}
                for rollout in kept["rollouts"]]

    def rank_state(self) -> dict[str, Any]:
        """Within a cycle of num_iterations steps: the completions its next steps train on again."""
        if self._cycle is None or (self.step + 1) % self.num_iterations == 0:
            return {}
        first, rollouts = self._cycle
        return {"step": first, "rollouts": [{key: value.cpu() if isinstance(value, torch.Tensor) else value
                                             for key, value in rollout.items()} for rollout in rollouts]}

    def _add(self, sums: dict[str, torch.Tensor]) -> None:
        """Adds to the sums of the training metrics named (out of place: the training pass may be compiled)."""
        zero = self._sums.new_zeros(())
        self._sums = self._sums + torch.stack([sums[name].float() if name in sums else zero for name in self._slots])

    def _global_std(self, rewards: torch.Tensor) -> Optional[torch.Tensor]:
        """scale_rewards=batch: the standard deviation of the global batch's rewards (all processes'), the same
        on any layout: two all-reduces, of the count and sum, then of the squared deviations from their mean."""
        if self.scale_rewards != "batch":
            return None
        reduce = self.accelerator.reduce if self.accelerator.num_processes > 1 else (lambda t, _: t)
        count, total = reduce(torch.stack([torch.tensor(float(rewards.numel()), device=rewards.device),
                                           rewards.sum()]), "sum")
        squares = reduce((rewards - total / count).square().sum(), "sum")
        return (squares / (count - 1).clamp(min=1)).sqrt()

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """Two terms, over the step's labels (prepare_window's targets): the completions (grpo and dr_grpo average
        over them, and train/* metrics) and their trained tokens (dapo's denominator)."""
        return torch.stack([torch.tensor(float(len(targets)), device=targets.device),
                            (targets != IGNORE_INDEX).sum().float()])

    def throughput_count(self, targets: torch.Tensor) -> torch.Tensor:
        """The completions' tokens trained on: train/tokens_per_second counts those (not the prompts')."""
        return (targets != IGNORE_INDEX).sum()

    def with_reference(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> dict:
        """Evaluation: the batch's completions, written and scored. Training (whose were written by
        prepare_window): with beta, the reference's log-probabilities of them."""
        if not model.training:
            rollout = self.rollout(model, inputs, targets, EVALUATION, self.eval_generations)
            self._show(rollout, targets.tolist())
            return rollout
        if self.reference is None or "reference_logps" in inputs:
            return inputs
        # Kept in the rollout: the later steps of num_iterations train on the same completions.
        inputs["reference_logps"] = self.reference(model, inputs, targets)
        return inputs

    def model_loss_sum(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> torch.Tensor:
        token_logps = self.token_logps(model, inputs)
        counted = inputs["labels"][:, 1:] != IGNORE_INDEX
        # The ratio to the policy that wrote the completions: this one at the first of num_iterations steps (1 in
        # value, with the policy gradient's gradient), the log-probabilities it kept at the later ones.
        log_ratio = token_logps - inputs.get("old_logps", token_logps.detach())
        if self.importance_sampling_level == "sequence":  # GSPO: the mean over the completion's tokens
            log_ratio = (log_ratio * counted).sum(-1, keepdim=True) / counted.sum(-1, keepdim=True).clamp(min=1)
        ratio, advantages = torch.exp(log_ratio), inputs["advantages"][:, None]
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)  # PPO's pessimistic surrogate
        sums = {}
        if "reference_logps" in inputs:  # k3 (Schulman): exp(r) - r - 1 >= 0, r = log(reference / policy)
            log_ratio = inputs["reference_logps"] - token_logps
            kl = torch.exp(log_ratio) - log_ratio - 1
            per_token = per_token + self.beta * (kl * ratio if self.use_bias_correction_kl else kl)
            sums["kl"] = (kl * counted).sum().detach()
        if self.num_iterations > 1:  # the tokens whose ratio the clip held back
            for name, held in (("low", (ratio < 1 - self.epsilon_low) & (advantages < 0)),
                               ("high", (ratio > 1 + self.epsilon_high) & (advantages > 0))):
                sums[f"clip_ratio/{name}"] = (held.expand_as(counted) & counted).sum()
        if sums:  # over the tokens trained on, as TRL averages them
            self._add({**sums, "trained tokens": counted.sum()})
        per_completion = (per_token * counted).sum(-1)
        none = torch.zeros((), device=per_completion.device)
        if self.loss_type == "dapo":  # over the global batch's tokens, count()'s second term
            return torch.stack([none, per_completion.sum()])
        tokens = counted.sum(-1).clamp(min=1) if self.loss_type == "grpo" else self.max_completion_tokens
        return torch.stack([(per_completion / tokens).sum(), none])

    def token_logps(self, model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
        """(rows, T-1): each row's log-probability of its token t+1 at position t, in fp32; with chunk_tokens
        from the output layer a chunk at a time (DPO's model_answer_logps, whose rows are any rows)."""
        keep_from = 0
        if "packed_at" in batch:  # objective.packing: read back in the padded rows' layout
            rows = {"input_ids": batch["packed_input_ids"], "position_ids": batch["packed_position_ids"],
                    "packed_at": batch["packed_at"]}
        else:
            rows = {k: batch[k] for k in MODEL_INPUTS}
            if self.keeps_logits:  # the prompts' positions before the shortest one's end: no output layer there
                keep_from = batch.get("logits_from", 0)  # 0: rows made elsewhere (a test, an older checkpoint)
        return model_answer_logps(model, rows, batch["labels"], IGNORE_INDEX, self.chunk_tokens, keep_from)[2]

    def model_metrics(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor) -> dict[str, PerSample]:
        per_prompt = len(targets)
        weight = torch.full((per_prompt,), float(self.eval_generations), device=targets.device)
        per_completion = {name: (inputs[key].view(per_prompt, -1).sum(-1), weight)
                          for name, key in (("reward", "rewards"), ("completion_length", "lengths"),
                                            ("clipped_ratio", "clipped"))}
        tokens = inputs["lengths"].view(per_prompt, -1).sum(-1)  # entropy: a mean over the tokens written
        return {**per_completion, "entropy": (inputs["entropy"].view(per_prompt, -1).sum(-1), tokens)}

    def _show(self, rollout: dict, indices: list[int]) -> None:
        """The first completion of each of the batch's prompts, until log_completions are kept."""
        end, group = self.codec.end_of_text, self.eval_generations
        for index, row in zip(indices, range(0, len(rollout["input_ids"]), group)):
            if len(self._shown) >= self.log_completions:
                return
            prompt = self.rows[index]["prompt"]
            written = rollout["input_ids"][row][rollout["labels"][row] != IGNORE_INDEX].tolist()
            text = self.codec.decode(written[:-1] if written[-1:] == [end] else written)
            self._shown.append(f"**prompt {index}** (reward {rollout['rewards'][row].item():.4g}, {len(written)} "
                               f"tokens{'' if written[-1:] == [end] else ', cut at the limit'})\n\n"
                               f"```\n{prompt if isinstance(prompt, str) else json.dumps(prompt)}\n```\n\n"
                               f"```\n{text}\n```")

    def evaluation_texts(self) -> dict[str, str]:
        shown, self._shown = self._shown, []
        return {"completions": "\n\n".join(shown)} if shown else {}

    def training_metrics(self) -> dict[str, torch.Tensor]:
        if self._sums is None:
            return {}
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        values = dict(zip(self._slots, sums))
        return {name: torch.stack([values[name], values[self.per_token[name]]]) if name in self.per_token
                else values[name] for name in self.trained_metrics}

    # Completions ---------------------------------------------------------------------------------------------------

    def rollout(self, model: torch.nn.Module, inputs: Mapping, targets: torch.Tensor, step: int, group: int) -> dict:
        """Each prompt's `group` completions (seeded by step and prompt) and their rewards, as rows of prompt then
        completion padded on the right, labelled on the completion's tokens only."""
        inner = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        device = inputs["input_ids"].device
        prompts = [self._cropped(ids[:length]) for ids, length in zip(inputs["input_ids"],
                                                                      inputs["prompt_tokens"].tolist())]
        # Each prompt's own random stream: the same draws whatever else is generated beside it, and training's
        # random state untouched.
        streams = [torch.Generator(device).manual_seed(seed_of(self.seed, step, index)) for index in targets.tolist()]
        with evaluating(inner), self.accelerator.autocast(), self._gathered(inner):
            if self.generation_batch == "prompt":
                written = [self._generate(inner, [prompt], [stream], group) for prompt, stream in zip(prompts, streams)]
                completions = [row for rows, _ in written for row in rows]
                entropy = torch.cat([sums for _, sums in written])
            else:
                completions, entropy = self._generate(inner, prompts, streams, group)
        prompt_rows = [prompt.tolist() for prompt in prompts for _ in range(group)]
        batch = self._rows(prompt_rows, completions, device)
        scores = self._function_scores(targets.tolist(), completions, group).to(device)
        if self.reward_model is not None:
            scores = torch.cat([scores, self._scored(batch)[None]])
        rewards = self.reward_weights.to(device) @ scores  # (sources,) x (sources, completions)
        end = self.codec.end_of_text
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32, device=device)
        clipped = torch.tensor([float(not c or c[-1] != end) for c in completions], device=device)
        # No completion starts before the shortest prompt's end: the training passes' output layer starts there.
        return {**batch, "rewards": rewards, "lengths": lengths, "clipped": clipped, "scores": scores,
                "entropy": entropy, "logits_from": min(len(prompt) for prompt in prompts) - 1}

    def _cropped(self, prompt: torch.Tensor) -> torch.Tensor:
        """The prompt's last tokens that leave room for a whole completion in the model's context."""
        room = self.block_size - self.max_completion_tokens
        if len(prompt) > room and not self._cropped_logged:
            log.warning("objective=grpo: a prompt of %d tokens keeps its last %d, so that a completion of "
                        "objective.max_completion_tokens=%d fits data.block_size=%d (logged once)", len(prompt),
                        room, self.max_completion_tokens, self.block_size)
            self._cropped_logged = True
        return prompt[-room:]

    def _generate(self, model: torch.nn.Module, prompts: list[torch.Tensor], streams: list[torch.Generator],
                  group: int) -> tuple[list[list[int]], torch.Tensor]:
        """`group` completions of each prompt (token ids, the end token kept, none after it), each prompt's drawn
        from its own stream, all prompts written together: left-padded to the longest, with position ids that
        start at each one's first token; and each completion's summed entropy of the distributions its tokens were
        drawn from, at the temperature, before top_k and top_p (the policy's, as TRL reports it).

        Not transformers' generate: it would apply a pretrained generation_config's processors (a repetition
        penalty, top_p) that objective.* does not name, and under FSDP with a LoRA adapter it bypasses the root
        module whose forward gathers the weights. A transformers model (or peft's wrapper of one) is called with
        its KV cache, ours (src/models/gpt.py) with its own (a left pad is a document of its own there), any other
        model with its whole context each time. Sampling stops once every row has written the end token, except
        where each pass all-gathers weights (FSDP without gather_for_generation): every rank must then make the same
        number of passes. (With it, the first pass, which every rank makes, gathers them all.)"""
        end, device = self.codec.end_of_text, prompts[0].device
        width = max(len(prompt) for prompt in prompts)
        ids = torch.stack([F.pad(prompt, (width - len(prompt), 0)) for prompt in prompts]).repeat_interleave(group, 0)
        padded = any(len(prompt) < width for prompt in prompts)
        lengths = torch.tensor([len(prompt) for prompt in prompts], device=device).repeat_interleave(group)
        attention = (torch.arange(width, device=device) >= width - lengths[:, None]).long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        transformers_cache = hasattr(model, "generation_config")
        ours = None if transformers_cache or not takes(model, "cache") else KVCache()  # src/models/gpt.py's
        cache = None
        if transformers_cache:  # a cache from the first pass: a packing hook (src/data/packing.py) leaves it alone
            from transformers import DynamicCache

            cache = DynamicCache()
        context, new_positions = ids, positions
        writing = torch.ones(len(ids), dtype=torch.bool, device=device)  # the rows that have not ended
        entropy = torch.zeros(len(ids), device=device)
        for _ in range(self.max_completion_tokens):
            if transformers_cache:
                where = {"attention_mask": attention, "position_ids": new_positions} if padded else {}
                output = model(input_ids=context, past_key_values=cache, use_cache=True, **where)
                logits, cache = output.logits[:, -1], output.past_key_values
            elif ours is not None:
                where = {"position_ids": new_positions} if padded else {}
                logits = call_model(model, {"input_ids": context, "cache": ours, **where})[:, -1]
            else:
                logits = call_model(model, {"input_ids": ids, "position_ids": positions} if padded else ids)[:, -1]
            logits = logits.float() / self.temperature
            probabilities = logits.softmax(-1)
            entropy += torch.special.entr(probabilities).sum(-1) * writing
            if self.top_k is not None:
                kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -math.inf)
            if self.top_p < 1:
                logits = nucleus(logits, self.top_p)
            if self.top_k is not None or self.top_p < 1:
                probabilities = logits.softmax(-1)
            context = torch.cat([torch.multinomial(rows, 1, generator=stream) for rows, stream in
                                 zip(probabilities.split(group), streams)])
            ids = torch.cat([ids, context], dim=1)
            new_positions = positions[:, -1:] + 1
            positions = torch.cat([positions, new_positions], dim=1)
            attention = torch.cat([attention, torch.ones_like(context)], dim=1)
            if end is not None:
                writing &= context[:, 0] != end
                if not self.passes_gather and not writing.any():  # a host read per token, as transformers' makes
                    break
        completions = []
        for row in ids[:, width:].tolist():
            cut = row.index(end) + 1 if end is not None and end in row else len(row)  # the end token kept
            completions.append(row[:cut])
        return completions, entropy

    @contextlib.contextmanager
    def _gathered(self, model: torch.nn.Module):
        """Under FSDP with gather_for_generation: every block's weights, once gathered by the first pass, kept so
        until generation ends (no further all-gather), then sharded again. The root's stay as FSDP2 keeps them
        after a forward (gathered, for the training pass that follows)."""
        from torch.distributed.fsdp import FSDPModule

        if not (self.sharded and self.gather_for_generation):
            yield
            return
        sharded_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
        blocks = sharded_modules[1:]  # the first is the root, the outermost
        # FSDP2 sets reshard_after_forward but does not say it: read from its parameter groups to set it back.
        before = [any(group.post_forward_mesh_info is not None
                      for group in block._get_fsdp_state()._fsdp_param_groups) for block in blocks]
        for block in blocks:
            block.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for block, reshards in zip(blocks, before):
                block.set_reshard_after_forward(reshards, recurse=False)
                block.reshard()

    def _scored(self, batch: dict) -> torch.Tensor:
        """The reward model's value at each row's last token, the end-of-text token where the completion wrote it
        (where objective=reward reads an answer's reward), in fp32."""
        with torch.no_grad(), self.accelerator.autocast():
            values = call_model(self.reward_model, {k: batch[k] for k in MODEL_INPUTS})
        if self.sharded:  # FSDP2 keeps a root's weights gathered after a forward, for a backward none takes here
            from torch.distributed.fsdp import FSDPModule

            for module in self.reward_model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        last = batch["attention_mask"].sum(-1) - 1
        return values[..., 0].float().gather(1, last[:, None])[:, 0]

    def _function_scores(self, indices: list[int], completions: list[list[int]], group: int) -> torch.Tensor:
        """(functions, completions): each reward function's scores, each called once for the batch."""
        if not self.rewards:
            return torch.zeros(0, len(completions))
        end = self.codec.end_of_text
        rows = [self.rows[i] for i in indices for _ in range(group)]
        texts = [self.codec.decode(c[:-1] if c and c[-1] == end else c) for c in completions]
        columns: dict[str, list[Any]] = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
        prompts = [row["prompt"] for row in rows]
        return torch.stack([self._called(name, function, prompts, texts, columns)
                            for name, function in self.rewards.items()])

    @staticmethod
    def _called(name: str, function: Callable, prompts: list, texts: list[str], columns: dict) -> torch.Tensor:
        try:
            scores = function(prompts=prompts, completions=texts, **columns)
        except TypeError as error:  # most often a column the function takes that the data has not
            raise UsageError(f"objective.reward={name}: {error}; it is called with prompts, completions and the "
                             f"data's columns: {', '.join(sorted(columns)) or 'none'}") from None
        try:
            scores = [float(s) for s in scores]
        except (TypeError, ValueError):
            scores = None
        if scores is None or len(scores) != len(texts) or not all(math.isfinite(s) for s in scores):
            raise UsageError(f"objective.reward={name} must return one finite number per completion ({len(texts)} "
                             f"here); it returned {str(scores)[:200]}")
        return torch.tensor(scores, dtype=torch.float32)

    def _rows(self, prompts: list[list[int]], completions: list[list[int]], device) -> dict[str, torch.Tensor]:
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask, labels = torch.zeros_like(ids), torch.full_like(ids, IGNORE_INDEX)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            p, n = len(prompt), len(prompt) + len(completion)
            ids[row, :n] = torch.tensor(prompt + completion)
            mask[row, :n] = 1
            labels[row, p:n] = torch.tensor(completion, dtype=torch.long)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
