"""objective=grpo on data=prompts: online reinforcement learning from a reward function. Completions drawn from a
stream of (seed, step, prompt) alone, so exact on any layout and bitwise on resume; each scored against its
prompt's group; ended by the end-of-text token, which is trained; a model trained from scratch learns the reward."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from src.errors import UsageError
from tests.conftest import (
    PRETRAINED_VOCAB,
    QUIET,
    exported_weights,
    kill_when,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
    texts,
)
from tests.test_config import compose_train
from tests.test_preference import chat_model  # noqa: F401  (a fixture)

GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.dropout=0.0"]
LETTERS = "tests.grpo_rewards.letter_share"


def letter_prompts(path: Path, n: int = 64, varied: bool = False) -> Path:
    """Prompts asking for one of three letters, with the letter beside each (the reward's column); `varied`: of
    several lengths (written together, left-padded)."""
    letters, openings = "abc", ["", "now ", "please, now "] if varied else [""]
    path.write_text("".join(json.dumps({"prompt": f"{openings[i % len(openings)]}write {letters[i % 3]}:",
                                        "letter": letters[i % 3]}) + "\n" for i in range(n)))
    return path


def grpo_args(prompts: Path, run_dir: Path, *extra: str, model: tuple[str, ...] = tuple(GPT)) -> list[str]:
    return [*model, "data=prompts", f"data.path={prompts}", "objective=grpo", f"objective.reward={LETTERS}",
            "objective.max_completion_tokens=8", "scheduler=constant", "optimizer.lr=1e-2", *extra,
            f"hydra.run.dir={run_dir}"]


class Data:
    """What the objective reads of data=prompts, for in-process tests."""

    def __init__(self, prompts: list[str], end_of_text=None, block_size: int = 32):
        from src.data.tokenizer import Codec

        self.codec = Codec("byte", end_of_text=end_of_text)
        self.rows = [{"prompt": p, "letter": "a"} for p in prompts]
        self.block_size = block_size


def objective_and_model(data: Data, **options):
    from accelerate import Accelerator

    from src.models.gpt import GPT as Model
    from src.objectives.grpo import GRPO

    torch.manual_seed(0)
    model = Model(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    objective = GRPO(reward=LETTERS, **{"num_generations": 4, "max_completion_tokens": 6, **options})
    objective.start(Accelerator(cpu=True), model, data, None, None)
    return objective, model


def prompt_batch(data: Data, indices: list[int]) -> tuple[dict, torch.Tensor]:
    from src.data.prompts import collate_prompts

    samples = [{"input_ids": torch.tensor(data.codec.encode(data.rows[i]["prompt"])), "prompt_index": torch.tensor(i)}
               for i in indices]
    batch = collate_prompts(samples)
    return {k: v for k, v in batch.items() if k != "prompt_index"}, batch["prompt_index"]


class WritesTheEndOften(torch.nn.Module):
    """A byte GPT more likely than not to write the end token within a few tokens."""

    def __init__(self, gpt: torch.nn.Module, end: int):
        super().__init__()
        self.gpt, self.end = gpt, end

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        return self.gpt(input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep) + 3.0 * (
            torch.nn.functional.one_hot(torch.tensor(self.end), 256))


def written(objective, model, batch: tuple[dict, torch.Tensor]) -> dict:
    """A training micro-batch's completions as its step trains on them (with beta, the reference's numbers too)."""
    rollout, labels = objective.prepare_window(model, [batch])[0]
    return objective.with_reference(model, rollout, labels)


def completions(rollout: dict) -> list[list[int]]:
    return [ids[labels != -100].tolist() for ids, labels in zip(rollout["input_ids"], rollout["labels"])]


def test_a_prompts_completions_are_drawn_from_its_number_and_the_step_alone_and_scored_against_its_group():
    """The same prompt at the same step gets the same completions alone or beside another prompt (from its own
    stream), other ones at another step; training's random state is left as it was; each group's
    advantages are its rewards less their mean, over their standard deviation."""
    data = Data(["write a:", "hello there, write a:"])
    objective, model = objective_and_model(data)
    both = prompt_batch(data, [0, 1])
    objective.before_step(3)
    state = torch.get_rng_state()
    together = written(objective, model, both)
    assert torch.equal(torch.get_rng_state(), state)
    alone = written(objective, model, prompt_batch(data, [1]))
    assert completions(together)[4:] == completions(alone)
    assert completions(together)[:4] != completions(together)[4:]
    objective.before_step(4)
    assert completions(written(objective, model, prompt_batch(data, [1]))) != completions(alone)

    rewards = together["rewards"].view(2, 4)
    expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(together["advantages"], expected.reshape(-1))
    prompt = data.codec.encode("hello there, write a:")
    assert all(row[:len(prompt)].tolist() == prompt for row in together["input_ids"][4:])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_the_loss_is_the_policy_gradient_normalised_over_tokens_or_completions(loss_type):
    """The step's loss is minus its advantages' token-weighted mean, and its gradient that of -A x the completion's
    log-probability over: the global batch's completion tokens (dapo); the completion's own tokens, then the
    completions (grpo); max_completion_tokens, then the completions (dr_grpo)."""
    from src.objectives.preference import next_token_logps

    data = Data(["write a:", "write b:"])
    objective, model = objective_and_model(data, loss_type=loss_type)
    rollout = written(objective, model, prompt_batch(data, [0, 1]))
    for row, labels in enumerate(rollout["labels"]):  # completions of 1 to 6 tokens
        labels[(labels != -100).nonzero()[0, 0] + 1 + row % 6:] = -100
    rollout["advantages"] = torch.linspace(-1, 1, 8)  # any advantages: the gradient must follow them
    count = objective.count(rollout["labels"])
    loss = (objective.model_loss_sum(model, rollout, None) / count).sum()  # one micro-batch: the step's loss
    counted = rollout["labels"][:, 1:] != -100
    tokens = counted.sum(-1)
    assert count.tolist() == [8, tokens.sum()]
    weights = {"dapo": tokens / tokens.sum(), "grpo": torch.full((8,), 1 / 8), "dr_grpo": tokens / 6 / 8}[loss_type]
    torch.testing.assert_close(loss, -(rollout["advantages"] * weights).sum())
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    logps = (next_token_logps(model(rollout["input_ids"]), rollout) * counted).sum(-1)
    expected = torch.autograd.grad(-(rollout["advantages"] * logps * weights / tokens).sum(),
                                   list(model.parameters()), allow_unused=True)
    for got, want in zip(grads, expected):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


OFF_POLICY = {"num_iterations": 2, "epsilon": 0.2, "epsilon_high": 0.28}  # a later step of a cycle: ratios clipped


@pytest.mark.parametrize("loss_type, beta, corrected, options", [
    ("dapo", 0.0, True, {}), ("grpo", 0.0, True, {}), ("dr_grpo", 0.0, True, {}), ("dapo", 0.3, True, {}),
    ("grpo", 0.3, False, {}), ("dapo", 0.0, True, OFF_POLICY), ("dr_grpo", 0.3, True, OFF_POLICY),
    ("dapo", 0.3, True, {**OFF_POLICY, "importance_sampling_level": "sequence"}),
    ("grpo", 0.0, True, {**OFF_POLICY, "importance_sampling_level": "sequence"})],
    ids=["dapo", "grpo", "dr_grpo", "dapo_kl", "grpo_kl_uncorrected", "dapo_clipped", "dr_grpo_kl_clipped",
         "gspo_kl_clipped", "gspo_clipped"])
def test_the_loss_and_its_gradient_equal_trls_grpo_trainer_on_the_same_completions(loss_type, beta, corrected,
                                                                                    options, pretrained, tmp_path):
    """TRL's GRPOTrainer._compute_loss, given our completions, advantages, reference log-probabilities and the
    log-probabilities of the policy that wrote them (as it takes them after its own generation), computes the loss
    and gradient ours does, within 1e-5, for each loss_type, with and without the KL term (with and without its
    bias correction), at a later step of num_iterations (ratios away from 1, some clipped below and above, on
    each token or each completion: GSPO); completions of several lengths, the policy away from the reference."""
    trl = pytest.importorskip("trl")
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.data.tokenizer import codec_for
    from src.objectives.grpo import GRPO
    from src.objectives.reference import FrozenCopy

    data = Data(["write a:", "write b:"])  # prompts of one length: TRL's left-padded prompts are ours unpadded
    data.codec, data.block_size = codec_for(str(pretrained)), 64
    policy, reference = (AutoModelForCausalLM.from_pretrained(pretrained, resid_pdrop=0.0, embd_pdrop=0.0,
                                                              attn_pdrop=0.0) for _ in range(2))
    policy.train()  # a training step's: no dropout above, so TRL's pass computes what ours does
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    objective = GRPO(reward=LETTERS, loss_type=loss_type, beta=beta, num_generations=4, max_completion_tokens=12,
                     reference="copy", use_bias_correction_kl=corrected, **options)
    objective.start(Accelerator(cpu=True), policy, data, None, None)
    if beta:
        objective.reference = FrozenCopy(objective.accelerator, reference, objective)
    rollout = written(objective, policy, prompt_batch(data, [0, 1]))
    rollout["advantages"] = torch.linspace(-1, 1, 8)
    prompt = len(data.codec.encode("write a:"))
    for row, labels in enumerate(rollout["labels"]):  # completions of 1 to 12 tokens, as if they had ended there
        labels[prompt + 1 + row * 5 % 12:] = -100
    completion_mask = (rollout["labels"][:, prompt:] != -100).long()
    assert len(set(completion_mask.sum(-1).tolist())) == 8
    if "num_iterations" in options:  # as if the policy had moved since it wrote them
        assert "old_logps" in rollout
        rollout["old_logps"] = rollout["old_logps"] + 0.3 * torch.randn_like(rollout["old_logps"])
        ratios = (objective.token_logps(policy, rollout) - rollout["old_logps"]).exp()[:, prompt - 1:]
        held = ratios[completion_mask.bool()]
        assert (held < 0.8).any() and (held > 1.28).any()

    policy.zero_grad()
    ours = (objective.model_loss_sum(policy, rollout, None) / objective.count(rollout["labels"])).sum()
    ours.backward()
    our_grads = [p.grad.clone() for p in policy.parameters()]

    trainer = trl.GRPOTrainer(
        model=policy, reward_funcs=lambda prompts, completions, **_: [0.0] * len(completions),
        processing_class=AutoTokenizer.from_pretrained(pretrained), train_dataset=Dataset.from_list(data.rows),
        args=trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                            max_completion_length=12, loss_type=loss_type, beta=beta,
                            use_bias_correction_kl=corrected, use_cpu=True, bf16=False, report_to=[], **options))
    inputs = {"prompt_ids": rollout["input_ids"][:, :prompt], "prompt_mask": rollout["attention_mask"][:, :prompt],
              "completion_ids": rollout["input_ids"][:, prompt:], "completion_mask": completion_mask,
              "advantages": rollout["advantages"], "num_items_in_batch": completion_mask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = rollout["reference_logps"][:, prompt - 1:]
    if "num_iterations" in options:
        inputs["old_per_token_logps"] = rollout["old_logps"][:, prompt - 1:]
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets: one micro-step a step
    policy.zero_grad()
    theirs = trainer._compute_loss(policy, inputs)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for got, want in zip(our_grads, (p.grad for p in policy.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "top_k": 5}], ids=["plain", "tempered_top_k"])
def test_a_completions_entropy_is_the_policys_per_token_entropy_at_the_temperature_before_top_k(options):
    """train/entropy and eval/entropy: the mean, over the tokens written (an end token included, nothing after
    it), of the entropy of the distribution the policy gave each of them, at the temperature and before top_k or
    top_p keep some of it (TRL's), computed from the model's pass over the whole completion."""
    end = ord("\n")
    data = Data(["write a:", "now, write b:"], end_of_text=end)  # some completions end early
    objective, gpt = objective_and_model(data, max_completion_tokens=8, **options)
    model = WritesTheEndOften(gpt, end)
    rollout = written(objective, model, prompt_batch(data, [0, 1]))
    lengths = (rollout["labels"] != -100).sum(-1)
    assert 1 <= lengths.min() < lengths.max()  # rows that ended at different tokens
    with torch.no_grad():
        logits = model(rollout["input_ids"]).float() / options.get("temperature", 1.0)
    token_entropy = torch.special.entr(logits.softmax(-1)).sum(-1)[:, :-1]  # position t predicts token t + 1
    counted = rollout["labels"][:, 1:] != -100
    expected = (token_entropy * counted).sum(-1)  # each completion's sum; reported over the tokens written
    torch.testing.assert_close(rollout["entropy"], expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(objective.training_metrics()["entropy"],
                               torch.stack([expected.sum(), counted.sum().float()]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "transformers"])
def test_packed_rows_train_as_the_padded_ones_on_fewer_tokens(kind, pretrained):
    """objective.packing: the same completions (prompts of several lengths, completions ending at several lengths)
    packed into fewer rows than padding needs, each attending to itself only: their log-probabilities, the loss and
    its gradient are the padded rows' (1e-5), with the KL term and num_iterations' kept log-probabilities too."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.tokenizer import codec_for

    texts = ["write a:", "a much longer prompt, b:", "c:", "and d:"]
    options = {"max_completion_tokens": 12, "num_generations": 4, "beta": 0.2, "num_iterations": 2}
    rollouts, objectives = [], []
    for packing in (False, True):
        data = Data(texts, end_of_text=ord("\n"))
        objective, model = objective_and_model(data, packing=packing, **options)
        if kind == "transformers":
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(pretrained, resid_pdrop=0.0, embd_pdrop=0.0,
                                                         attn_pdrop=0.0, attn_implementation="sdpa").train()
            data.codec = codec_for(str(pretrained))
            objective.start(Accelerator(cpu=True), model, data, None, None)
        else:
            model = WritesTheEndOften(model, ord("\n"))
        rollouts.append(written(objective, model, prompt_batch(data, [0, 1, 2, 3])))
        objectives.append(objective)
    padded, packed = rollouts
    lengths = padded["attention_mask"].sum(-1)
    assert lengths.min() < lengths.max() and torch.equal(packed["input_ids"], padded["input_ids"])
    assert packed["packed_input_ids"].numel() < 0.8 * padded["input_ids"].numel()
    counted = padded["labels"][:, 1:] != -100
    for key in ("old_logps", "reference_logps"):
        torch.testing.assert_close(packed[key][counted], padded[key][counted], rtol=1e-5, atol=1e-5)
    losses = [objective.model_loss_sum(model, rollout, None).sum() for objective, rollout in zip(objectives, rollouts)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    weights = [p for p in model.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(losses[1], weights), torch.autograd.grad(losses[0], weights)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt", "transformers"])
@pytest.mark.parametrize("chunk_tokens", [None, 5], ids=["logits", "chunked"])
def test_the_training_passes_compute_no_output_layer_before_the_shortest_prompts_end(kind, chunk_tokens, pretrained):
    """TRL's logits_to_keep: the output layer reads the positions from the shortest prompt's last token on (no
    completion starts before it), and the log-probabilities, the loss (with the KL term and num_iterations' kept
    log-probabilities) and its gradient are those of the whole rows (1e-5)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.tokenizer import codec_for

    data = Data(["write a:", "a much longer prompt, b:", "c: and", "and d:"])
    objective, model = objective_and_model(data, max_completion_tokens=8, beta=0.2, num_iterations=2,
                                           chunk_tokens=chunk_tokens)
    if kind == "transformers":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(pretrained, resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attn_pdrop=0.0).train()
        data.codec = codec_for(str(pretrained))
        objective.start(Accelerator(cpu=True), model, data, None, None)
    assert objective.keeps_logits
    widths = []
    output_layer = model.get_output_embeddings() if kind == "transformers" else model.lm_head
    output_layer.register_forward_pre_hook(lambda layer, args: widths.append(args[0].shape[1]))
    rollout = written(objective, model, prompt_batch(data, [0, 1, 2, 3]))
    shortest = min(len(data.codec.encode(row["prompt"])) for row in data.rows)
    assert rollout["logits_from"] == shortest - 1 > 0
    whole_rows = {**rollout, "logits_from": 0}
    counted = rollout["labels"][:, 1:] != -100
    widths.clear()
    kept, whole = objective.token_logps(model, rollout), objective.token_logps(model, whole_rows)
    assert widths == [rollout["input_ids"].shape[1] - shortest + 1, rollout["input_ids"].shape[1]], widths
    torch.testing.assert_close(kept[counted], whole[counted], rtol=1e-5, atol=1e-5)
    losses = [objective.model_loss_sum(model, rows, None).sum() for rows in (rollout, whole_rows)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    weights = [p for p in model.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(losses[0], weights), torch.autograd.grad(losses[1], weights)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_packed_rows_leave_out_the_truncated_completions_that_nothing_trains_on():
    """With mask_truncated_completions the completions cut at max_completion_tokens count for nothing: packed, they
    are not computed at all (their tokens are not in the packed rows), and the loss and its gradient are still the
    padded rows'. A micro-batch of nothing but cut completions keeps one row, for the passes every process runs."""
    texts = ["write a:", "a much longer prompt, b:", "c:", "and d:"]
    options = {"max_completion_tokens": 6, "num_generations": 4, "mask_truncated_completions": True}
    rollouts, objectives = [], []
    for packing in (False, True):
        data = Data(texts, end_of_text=ord("\n"))
        objective, model = objective_and_model(data, packing=packing, **options)
        model = WritesTheEndOften(model, ord("\n"))
        rollouts.append(written(objective, model, prompt_batch(data, [0, 1, 2, 3])))
        objectives.append(objective)
    padded, packed = rollouts
    cut, mask = padded["clipped"].bool(), padded["attention_mask"].bool()
    assert 0 < cut.sum() < len(cut), cut
    uncut_tokens = Counter(padded["input_ids"][~cut][mask[~cut]].tolist())
    in_packed_rows = Counter(packed["packed_input_ids"].flatten().tolist())
    assert in_packed_rows - uncut_tokens == Counter({0: packed["packed_input_ids"].numel() - mask[~cut].sum().item()})
    losses = [objective.model_loss_sum(model, rollout, None).sum() for objective, rollout in zip(objectives, rollouts)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    weights = [p for p in model.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(losses[1], weights), torch.autograd.grad(losses[0], weights)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    data = Data(texts)  # no end token: every completion is cut
    objective, model = objective_and_model(data, packing=True, **options)
    rollout = written(objective, model, prompt_batch(data, [0, 1]))
    assert rollout["clipped"].all()
    assert rollout["packed_input_ids"].shape == (1, rollout["attention_mask"][0].sum())


def test_packing_is_refused_for_a_model_that_cannot_attend_per_row():
    from accelerate import Accelerator

    from src.objectives.grpo import GRPO

    class NoPositions(torch.nn.Module):
        def forward(self, input_ids):
            return torch.zeros(*input_ids.shape, 256)

    objective = GRPO(reward=LETTERS, packing=True, max_completion_tokens=8)
    with pytest.raises(UsageError) as error:
        objective.start(Accelerator(cpu=True), NoPositions(), Data(["a:"]), None, None)
    named(str(error.value), "objective.packing=true", "position_ids", "objective.packing=false")


def test_a_cycle_of_num_iterations_steps_trains_on_the_completions_its_first_step_wrote():
    """num_iterations=2: step 0 writes the prompts' completions and keeps the log-probabilities of the policy that
    wrote them; step 1, given the same prompts, trains on those again (the same completions, advantages and
    log-probabilities, reported again, whatever the weights became; what a checkpoint keeps in between); step 2
    writes new ones; a step given other prompts than its cycle's first is refused, naming why."""
    data = Data(["write a:", "write b:", "write c:"])
    objective, model = objective_and_model(data, num_iterations=2)
    batch = prompt_batch(data, [0, 1])
    objective.before_step(0)
    first = written(objective, model, batch)
    torch.testing.assert_close(first["old_logps"], objective.token_logps(model, first))
    reported = objective.training_metrics()
    kept = objective.rank_state()
    assert kept["step"] == 0 and torch.equal(kept["rollouts"][0]["input_ids"], first["input_ids"])
    with torch.no_grad():  # the policy moves
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    objective.before_step(1)
    again = written(objective, model, batch)
    for key in ("input_ids", "labels", "advantages", "old_logps"):
        assert torch.equal(again[key], first[key]), key
    assert not torch.allclose(objective.token_logps(model, again), again["old_logps"])  # ratios away from 1
    assert torch.equal(objective.training_metrics()["reward"], reported["reward"])
    assert objective.rank_state() == {}  # the next step starts a cycle: nothing to keep
    objective.before_step(2)
    fresh = written(objective, model, batch)
    assert not torch.equal(fresh["input_ids"], first["input_ids"])
    torch.testing.assert_close(fresh["old_logps"], objective.token_logps(model, fresh))
    objective.before_step(3)
    with pytest.raises(UsageError) as error:
        written(objective, model, prompt_batch(data, [1, 2]))
    named(str(error.value), "step 4 trains again on the completions that step 3 wrote",
          "objective.num_iterations=2", "other prompts", "a multiple of 2")
    objective.before_step(5)  # trainer.skip_steps dropped step 4, its cycle's first: step 5 writes them
    late = written(objective, model, batch)
    torch.testing.assert_close(late["old_logps"], objective.token_logps(model, late))


def test_a_resume_within_a_cycle_without_the_completions_kept_for_this_process_is_refused(tmp_path):
    data = Data(["write a:", "write b:"])
    objective, model = objective_and_model(data, num_iterations=2)
    objective.checkpoint = tmp_path  # a checkpoint of step 3 that holds no objective_state_0.safetensors
    objective.before_step(3)
    with pytest.raises(UsageError) as error:
        written(objective, model, prompt_batch(data, [0, 1]))
    named(str(error.value), "step 4 trains again on the completions that step 3 wrote", "holds none of them",
          "objective.num_iterations=2")


@pytest.mark.parametrize("scale, divisor", [("group", "group"), (True, "group"), ("batch", "batch"),
                                            ("none", None), (False, None)])
def test_advantages_are_scaled_by_the_groups_or_the_whole_steps_reward_deviation_or_not_at_all(scale, divisor):
    """scale_rewards: a completion's reward less its group's mean, over its group's standard deviation (group, true),
    over that of every reward of the step, all micro-batches together (batch), or as it is (none, false)."""
    data = Data(["write a:", "write b:", "write c:", "a longer prompt, write a:"])
    objective, model = objective_and_model(data, scale_rewards=scale)
    objective.rewards = {"varied": lambda prompts, completions, **columns: [sum(map(ord, c)) % 7 for c in completions]}
    window = objective.prepare_window(model, [prompt_batch(data, [0, 1]), prompt_batch(data, [2, 3])])
    rewards = torch.cat([rollout["rewards"] for rollout, _ in window]).view(4, 4)
    assert rewards.std(1).min() != rewards.std(1).max()  # the two divisors differ
    centred = rewards - rewards.mean(1, keepdim=True)
    expected = {"group": centred / (rewards.std(1, keepdim=True) + 1e-4), "batch": centred / (rewards.std() + 1e-4),
                None: centred}[divisor]
    torch.testing.assert_close(torch.cat([rollout["advantages"] for rollout, _ in window]), expected.reshape(-1))


def test_top_p_samples_from_the_nucleus_transformers_keeps():
    """The likeliest tokens whose probabilities reach top_p together stay, the rest never drawn: the set
    transformers' TopPLogitsWarper keeps."""
    from transformers import TopPLogitsWarper

    from src.objectives.grpo import nucleus

    probabilities = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    kept = nucleus(probabilities.log(), 0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    logits = torch.randn(64, 256) * 3
    for top_p in (0.1, 0.5, 0.9, 0.99):
        assert torch.equal(nucleus(logits, top_p).isfinite(), TopPLogitsWarper(top_p)(None, logits).isfinite())

    data = Data(["write a:"])
    objective, model = objective_and_model(data, top_p=0.3, num_generations=16)
    rollout = written(objective, model, prompt_batch(data, [0]))
    for ids, labels in zip(rollout["input_ids"], rollout["labels"]):
        start = (labels != -100).nonzero()[0, 0].item()
        with torch.no_grad():
            allowed = nucleus(model(ids[None])[0, start - 1:-1], 0.3).isfinite()
        assert allowed[torch.arange(len(ids) - start), ids[start:]].all()
        assert allowed.sum(-1).max() < 256


def test_a_completion_ends_at_the_end_of_text_token_which_is_trained_and_not_shown_to_the_reward():
    """Newline as the end-of-text token: a completion keeps its tokens up to the first one, that one labelled
    too; none after it; it is not clipped; the reward function reads its text without the end."""
    seen = []
    end = ord("\n")
    data = Data(["write a:"] * 2, end_of_text=end)
    objective, gpt = objective_and_model(data, max_completion_tokens=12, num_generations=16)
    model = WritesTheEndOften(gpt, end)
    objective.rewards = {"seen": lambda prompts, completions, **columns: seen.extend(completions) or [0.0] * len(
        completions)}
    rollout = written(objective, model, prompt_batch(data, [0, 1]))
    wrote = completions(rollout)
    ended = [c for c in wrote if end in c]
    assert ended and len(ended) < len(wrote)
    for c, text, clipped in zip(wrote, seen, rollout["clipped"].tolist()):
        assert c.count(end) <= 1 and (end not in c or c[-1] == end)
        assert clipped == (end not in c) and (len(c) == 12 or not clipped)
        assert text == data.codec.decode(c[:-1] if end in c else c) and not text.endswith("\n")
    assert rollout["lengths"].tolist() == [len(c) for c in wrote]


def test_mask_truncated_completions_trains_on_the_completions_that_ended_only():
    """A completion cut at max_completion_tokens keeps its reward and metrics but has no trained token: the loss,
    its gradient, dapo's token count and train/kl's (a mean over the tokens trained on) are those of the
    completions that wrote the end token."""
    end = ord("\n")
    data = Data(["write a:", "a longer prompt, write a:"], end_of_text=end)
    results = []
    for mask in (False, True):
        objective, gpt = objective_and_model(data, max_completion_tokens=10, mask_truncated_completions=mask, beta=0.1)
        model = WritesTheEndOften(gpt, end)
        rollout = written(objective, model, prompt_batch(data, [0, 1]))
        results.append((objective, model, rollout))
    (_, _, kept), (objective, model, masked) = results
    clipped = masked["clipped"].bool()
    assert 0 < clipped.sum() < len(clipped)
    assert torch.equal(masked["rewards"], kept["rewards"]) and torch.equal(masked["input_ids"], kept["input_ids"])
    assert (masked["labels"][clipped] == -100).all()
    assert torch.equal(masked["labels"][~clipped], kept["labels"][~clipped])
    assert objective.count(masked["labels"])[1] == (kept["labels"][~clipped] != -100).sum()
    ended = {k: v[~clipped] if isinstance(v, torch.Tensor) and len(v) == len(clipped) else v for k, v in kept.items()}
    objective.training_metrics()  # what writing them recorded
    loss = objective.model_loss_sum(model, masked, None).sum()
    assert objective.training_metrics()["kl"][1] == objective.count(masked["labels"])[1]
    torch.testing.assert_close(loss, objective.model_loss_sum(model, ended, None).sum())
    embedding = model.gpt.tok_emb.weight
    torch.testing.assert_close(torch.autograd.grad(loss, [embedding])[0], torch.autograd.grad(
        objective.model_loss_sum(model, ended, None).sum(), [embedding])[0])


def test_final_number_rewards_the_number_after_the_last_marker_or_else_the_last_number():
    from src.objectives.rewards import final_number

    completions = ["72", " 7 so 72", "7", "so 70 + 2 = 72 ", "none", "#### 72\nthat is 3", "#### 7\n#### 72",
                   "1,072", "#### 72.0"]
    assert final_number([""] * 9, completions, answer=["40 + 32 ... #### 72"] * 9) == [1, 1, 0, 1, 0, 1, 1, 0, 1]


def test_grpo_teaches_a_model_from_scratch_to_write_what_the_reward_asks(tmp_path):
    """The reward is the share of the completion that is the letter its prompt names: a random model scores about
    1/256; after 200 steps most of what it writes is the letter asked for, as each evaluation's completions shown in
    TensorBoard say, and the policy's entropy has fallen from a uniform byte's."""
    run_dir = tmp_path / "letters"
    log = run(grpo_args(letter_prompts(tmp_path / "letters.jsonl"), run_dir, "objective.num_generations=16",
                        "data.batch_size=4", "trainer.max_steps=200", "trainer.eval_every=100", "trainer.log_every=20",
                        "trainer.eval_on_start=true", "objective.log_completions=2")).stdout
    assert "spiked" not in log  # a loss of about 0 is no loss to watch
    reward = scalars(run_dir, "eval/reward")
    assert reward[0] < 0.05 and reward[200] > 0.3, reward
    assert scalars(run_dir, "train/reward_std")[20] > 0 and scalars(run_dir, "train/clipped_ratio")[200] == 1
    entropy = scalars(run_dir, "eval/entropy")  # the policy narrows onto the letters: ln 256 = 5.5 nats at start
    assert entropy[0] > 5 > 2 > entropy[200] > 0 and scalars(run_dir, "train/entropy")[200] < 2, entropy

    shown, best = texts(run_dir, "completions"), {}
    assert sorted(shown) == [0, 100, 200]
    for step, text in shown.items():
        blocks = re.findall(r"\*\*prompt (\d+)\*\* \(reward ([\d.e-]+), 8 tokens, cut at the limit\)\n\n"
                            r"```\n(write ([abc]):)\n```\n\n```\n(.*?)\n```", text, re.S)
        assert len(blocks) == 2, text
        for index, reward_shown, prompt, letter, completion in blocks:
            share = completion.count(letter) / max(len(completion), 1)
            assert float(reward_shown) == pytest.approx(share, abs=1e-3), (reward_shown, completion)
        best[step] = max(float(reward_shown) for _, reward_shown, *_ in blocks)
    assert best[0] < 0.3 < 0.9 < best[200], shown


TWO_ITERATIONS = ("objective.num_iterations=2", "objective.epsilon_high=0.28")


@pytest.mark.parametrize("options", [(), ("objective.scale_rewards=batch",), TWO_ITERATIONS],
                         ids=["dapo", "batch_scaled", "two_iterations"])
def test_grpo_trains_the_same_on_two_processes_as_on_one_accumulating_and_resumes_bitwise(tmp_path, options):
    """2 processes of 2 prompts train the weights (1e-5) and log the rewards of 1 process accumulating 2 micro-
    batches (dapo's token count and scale_rewards=batch's deviation are the global batch's; prompts of several
    lengths written together); a run killed after a checkpoint resumes to the same rewards and weights, bitwise.
    With num_iterations=2 the checkpoint falls within a cycle: the resume trains on the completions it kept (and is
    refused on another layout, whose processes did not keep them, and with another global batch)."""
    prompts = letter_prompts(tmp_path / "letters.jsonl", varied=True)
    common = [*QUIET, "data.batch_size=2", "trainer.max_steps=6", "trainer.checkpoint_every=3", *options]
    one, two, killed = (tmp_path / name for name in ("one", "two", "killed"))
    run(grpo_args(prompts, one, *common, "trainer.gradient_accumulation_steps=2"))
    run(grpo_args(prompts, two, *common), nproc=2)
    assert scalars(two, "train/reward") == pytest.approx(scalars(one, "train/reward"), abs=1e-6)
    assert max(scalars(one, "train/reward_std").values()) > 0  # something to learn from
    for run_dir in (one, two):  # tokens/s counts the completions' tokens of all processes: 8 a prompt here
        tokens, per_prompt, length = (scalars(run_dir, f"train/{name}") for name in (
            "tokens_per_second", "samples_per_second", "completion_length"))
        assert all(tokens[s] / per_prompt[s] == pytest.approx(8 * length[s], rel=1e-5) for s in tokens), run_dir
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5
    if "objective.scale_rewards=batch" in options:
        return

    checkpoint = killed / "checkpoints" / "step_00000003"
    kill_when(grpo_args(prompts, killed, *common, "trainer.gradient_accumulation_steps=2"), 1,
              ready=checkpoint.is_dir)
    if options == TWO_ITERATIONS:
        rewards = scalars(one, "train/reward")
        assert [rewards[s] for s in (1, 3, 5)] == [rewards[s] for s in (2, 4, 6)]  # each cycle's completions twice
        assert max(scalars(one, "train/clip_ratio/high").values()) > 0  # the second step's ratios are clipped
        assert (checkpoint / "objective_state_0.safetensors").is_file()
        proc = run(grpo_args(prompts, tmp_path / "other", *common, "trainer.gradient_accumulation_steps=1",
                             f"resume={checkpoint}"), nproc=2, check=False)
        assert proc.returncode != 0 and "step 4/" not in proc.stdout  # torch's launcher reports its ranks' exits
        named(proc.stdout, "objective.num_iterations=2", "step 4 trains again on the completions that step 3 wrote",
              "a multiple of 2")
        proc = run(grpo_args(prompts, tmp_path / "bigger", *common, "trainer.gradient_accumulation_steps=4",
                             "trainer.resume_with_new_global_batch=true", f"resume={checkpoint}"), check=False)
        refused(proc, "trainer.resume_with_new_global_batch", "objective.num_iterations=2", "4 samples",
                "batches of 8", "trainer.init_weights=")
    run(grpo_args(prompts, killed, *common, "trainer.gradient_accumulation_steps=2", "resume=auto"))
    assert scalars(killed, "train/reward") == scalars(one, "train/reward")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0


def test_a_packed_run_trains_the_weights_and_logs_the_rewards_of_a_padded_one(tmp_path):
    prompts = letter_prompts(tmp_path / "letters.jsonl", varied=True)
    common = [*QUIET, "data.batch_size=4", "trainer.max_steps=4", "objective.num_iterations=2", "objective.beta=0.1"]
    padded, packed = tmp_path / "padded", tmp_path / "packed"
    run(grpo_args(prompts, padded, *common))
    run(grpo_args(prompts, packed, *common, "objective.packing=true"))
    assert scalars(packed, "train/reward") == scalars(padded, "train/reward")
    assert scalars(packed, "train/kl") == pytest.approx(scalars(padded, "train/kl"), abs=1e-6)
    assert max_abs_diff(exported_weights(packed), exported_weights(padded)) <= 1e-5


@pytest.mark.parametrize("overrides, named_keys", [
    (["data=prompts", "objective=causal_lm"], ["data=prompts", "objective=grpo"]),
    (["objective=grpo", "data=jsonl"], ["objective=grpo", "data=prompts"]),
])
def test_prompts_and_grpo_come_together(overrides, named_keys):
    from src.schema.complete import complete_config

    with pytest.raises(UsageError) as error:
        complete_config(compose_train(overrides))
    named(str(error.value), *named_keys)


def test_grpo_picks_its_best_checkpoint_by_eval_reward_unless_told_otherwise():
    from src.schema.complete import complete_config

    cfg = complete_config(compose_train(["data=prompts", "objective=grpo"]))
    assert (cfg.trainer.monitor, cfg.trainer.monitor_mode) == ("eval/reward", "max")
    cfg = complete_config(compose_train(["data=prompts", "objective=grpo", "trainer.monitor=null"]))
    assert cfg.trainer.monitor is None


@pytest.mark.parametrize("override, named_keys", [
    ("objective.reward=no_such_module.reward", ["objective.reward=no_such_module.reward", "dotted path"]),
    ("objective.reward=tests.grpo_rewards.too_few", ["objective.reward=tests.grpo_rewards.too_few",
                                                     "one finite number per completion"]),
    ("objective.max_completion_tokens=32", ["objective.max_completion_tokens=32", "data.block_size=32"]),
])
def test_a_reward_that_cannot_be_called_or_answers_wrong_and_a_completion_without_room_are_refused(
        override, named_keys, tmp_path):
    proc = run(grpo_args(letter_prompts(tmp_path / "letters.jsonl"), tmp_path / "run", *QUIET, "trainer.max_steps=2",
                         override), check=False)
    refused(proc, *named_keys)
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.slow  # five launches, three of them FSDP2 over gloo, ~25 s
def test_a_transformers_model_trains_the_same_under_fsdp_as_on_one_process_and_with_lora_against_its_base(
        tmp_path, pretrained):
    """A pretrained GPT-2, its completions ending at <|endoftext|>: 2 FSDP2 processes (each writing the whole
    max_completion_tokens, as every pass is a collective) train the weights and log the rewards of 1 process
    accumulating 2, their log-probabilities through the sharded output layer 7 positions at a time; with a LoRA
    adapter too, and objective.beta against its base, the adapter off. (GPT-2's key biases aside:
    tests/test_preference.py's without_key_biases says why.) The LoRA runs train each batch of completions twice
    (num_iterations=2: the writing policy's log-probabilities through the sharded model). Without an adapter a
    reference copy is refused under FSDP."""
    from tests.conftest import FSDP_ON_CPU
    from tests.test_preference import LORA, without_key_biases

    prompts = letter_prompts(tmp_path / "letters.jsonl")
    # A hot temperature makes the model, which never saw <|endoftext|> in training, write it now and then.
    common = [*QUIET, "data.batch_size=2", "trainer.max_steps=3", "objective.max_completion_tokens=30",
              "objective.temperature=20", "optimizer.lr=1e-3"]
    model = ("model=hf_causal_lm", f"model.pretrained={pretrained}")
    for name, extra in (("full", []), ("lora", [LORA, "objective.beta=0.1", "objective.num_iterations=2"])):
        one, sharded = tmp_path / f"{name}_one", tmp_path / f"{name}_fsdp"
        run(grpo_args(prompts, one, *common, *extra, "trainer.gradient_accumulation_steps=2", model=model))
        run(grpo_args(prompts, sharded, *common, *extra, "objective.chunk_tokens=7", model=model), nproc=2,
            **FSDP_ON_CPU)
        assert scalars(sharded, "train/reward") == pytest.approx(scalars(one, "train/reward"), abs=1e-6), name
        assert min(scalars(one, "train/clipped_ratio").values()) < 1, "no completion ended at <|endoftext|>"
        assert max_abs_diff(without_key_biases(sharded), without_key_biases(one)) <= 1e-5, name
    assert scalars(sharded, "train/kl") == pytest.approx(scalars(one, "train/kl"), abs=1e-6)
    assert scalars(one, "train/kl")[1] == 0 < scalars(one, "train/kl")[3]  # LoRA: its base is the reference
    assert scalars(sharded, "train/clip_ratio/high") == pytest.approx(scalars(one, "train/clip_ratio/high"), abs=1e-6)
    proc = run(grpo_args(prompts, tmp_path / "copy", *common, "objective.beta=0.1", model=model), nproc=2,
               check=False, **FSDP_ON_CPU)
    assert proc.returncode != 0 and "step 1/" not in proc.stdout
    named(proc.stdout, "objective.reference=copy", "FSDP", "model.peft")


@pytest.mark.parametrize("kind", ["transformers", "gpt"])
def test_under_fsdp_each_rank_reads_its_slices_of_a_reward_model_which_scores_as_a_whole_copy(tmp_path, kind,
                                                                                             pretrained):
    """A reward model (the export of an objective=reward run: transformers' sequence classifier, its output layer
    under another name, or the template's GPT) sharded as the policy is: no rank reads it whole (each builds it
    without values and reads its own part of the files), and the rewards are one whole copy's."""
    from tests.conftest import FSDP_ON_CPU

    model = ("model=hf_causal_lm", f"model.pretrained={pretrained}") if kind == "transformers" else tuple(GPT)
    prompts, rm = letter_prompts(tmp_path / "letters.jsonl"), tmp_path / "rm"
    run([*model, "model.head=reward", "data=jsonl", "data.path=data/shakespeare_pairs.jsonl", "data.preference=true",
         "objective=reward", "trainer.max_steps=2", "data.batch_size=4", "trainer.monitor=null", *QUIET,
         f"hydra.run.dir={rm}"])
    against = [*QUIET, "data.batch_size=2", "trainer.max_steps=3", "objective.max_completion_tokens=6",
               "objective.temperature=5", "objective.reward=null", f"objective.reward_model={rm / 'model'}"]
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    run(grpo_args(prompts, one, *against, "trainer.gradient_accumulation_steps=2", model=model))
    proc = run(grpo_args(prompts, sharded, *against, model=model), nproc=2, **FSDP_ON_CPU)
    named(proc.stdout, f"objective.reward_model={rm / 'model'}: sharded over the processes, as the policy is, "
          "each rank read its own slices")
    assert scalars(sharded, "train/reward") == pytest.approx(scalars(one, "train/reward"), abs=1e-5)
    assert len(set(scalars(one, "train/reward").values())) > 1


@pytest.mark.parametrize("kind", ["transformers", "gpt"])
def test_a_model_writes_with_its_kv_cache_what_it_writes_reading_its_whole_context(kind, pretrained):
    """The cached path (a transformers model's cache, or our GPT's) samples the same tokens as re-reading the whole
    context each time, rows that wrote <|endoftext|> among them, prompts of several lengths left-padded together."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.tokenizer import codec_for
    from src.objectives.grpo import GRPO

    class Uncached(torch.nn.Module):  # no generation_config: the objective re-reads the whole context
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids=None):
            if kind == "gpt":
                return self.model(input_ids, position_ids=position_ids)
            mask = None if position_ids is None else (input_ids != 0).long()  # the pads: id 0, never in a prompt
            return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask).logits

    data = Data(["x"])
    data.codec, data.block_size = codec_for(str(pretrained)), 64
    if kind == "transformers":
        model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    else:
        from src.models.gpt import GPT as Model

        torch.manual_seed(0)
        model = Model(vocab_size=PRETRAINED_VOCAB, block_size=64, n_layer=2, n_head=2, n_embd=32).eval()
        with torch.no_grad():
            model.lm_head.weight[data.codec.end_of_text] *= 8  # some rows end
    objective = GRPO(reward=LETTERS, max_completion_tokens=40, temperature=20.0 if kind == "transformers" else 1.0)
    objective.start(Accelerator(cpu=True), model, data, None, None)
    prompts = [torch.tensor(data.codec.encode(text)) for text in ("write a:", "and now, please, write b:")]
    assert len(prompts[0]) < len(prompts[1]) and 0 not in torch.cat(prompts)
    written = []
    for generator in (model, Uncached(model)):
        streams = [torch.Generator().manual_seed(i) for i in range(2)]
        with torch.no_grad():
            written.append(objective._generate(generator, prompts, streams, 4)[0])
    assert written[0] == [row[:len(cached)] for row, cached in zip(written[1], written[0])]
    end = data.codec.end_of_text
    assert any(row[-1] == end for row in written[0]), "no row ended: nothing shows the stop"


def test_our_gpt_reads_its_kv_cache_as_it_reads_the_whole_context_and_generates_past_its_block():
    """The template's GPT with a KVCache: the context read once, then one token per pass, gives the logits of the
    whole context (rows left-padded with position ids too); GPT.generate (sample.py) draws nanoGPT's uncached
    tokens, and past block_size slides its window as nanoGPT does."""
    import torch.nn.functional as F

    from src.models.gpt import GPT as Model
    from src.models.gpt import KVCache

    torch.manual_seed(0)
    model = Model(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32).eval()
    ids = torch.randint(1, 256, (3, 12))
    positions = torch.tensor([[0] * 4 + list(range(8)), [0, 0] + list(range(10)), list(range(12))])
    with torch.no_grad():
        for where in ({}, {"position_ids": positions}):
            whole, cache = model(ids, **where), KVCache()
            read = [model(ids[:, :6], cache=cache, **{k: v[:, :6] for k, v in where.items()})]
            read += [model(ids[:, t:t + 1], cache=cache, **{k: v[:, t:t + 1] for k, v in where.items()})
                     for t in range(6, 12)]
            torch.testing.assert_close(torch.cat(read, dim=1), whole, rtol=1e-5, atol=1e-5)

        prompt = torch.randint(1, 256, (2, 5))
        torch.manual_seed(1)
        generated = model.generate(prompt, 20, temperature=0.7)
        torch.manual_seed(1)
        uncached = prompt
        for _ in range(20):  # nanoGPT's sample.py: the whole (cropped) context at each token
            logits = model(uncached[:, -16:])[:, -1] / 0.7
            uncached = torch.cat([uncached, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
    assert generated.shape == (2, 25) and torch.equal(generated, uncached)


@pytest.mark.parametrize("kind", ["gpt", "transformers"])
def test_prompts_written_together_left_padded_draw_what_each_draws_alone(kind, pretrained):
    """generation_batch=micro_batch: each prompt's completions, drawn from its own stream beside prompts of other
    lengths, are (but for rounding) those it draws alone; training's random state is left as it was."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.tokenizer import codec_for

    texts = ["write a:", "a longer one, b:", "c:"]
    data = Data(texts)
    objective, model = objective_and_model(data, max_completion_tokens=12)
    if kind == "transformers":
        model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
        data.codec = codec_for(str(pretrained))
        objective.start(Accelerator(cpu=True), model, data, None, None)
    prompts = [torch.tensor(data.codec.encode(text)) for text in texts]
    state = torch.get_rng_state()
    with torch.no_grad():
        together = objective._generate(model, prompts, [torch.Generator().manual_seed(i) for i in range(3)], 8)[0]
        alone = [row for i, prompt in enumerate(prompts)
                 for row in objective._generate(model, [prompt], [torch.Generator().manual_seed(i)], 8)[0]]
    assert torch.equal(torch.get_rng_state(), state)
    assert sum(a == b for a, b in zip(together, alone)) >= 22, (together, alone)  # of 24: rounding may flip a draw
    assert len({tuple(row) for row in together}) > 12  # written, not copied


def test_a_reward_model_scores_each_completion_at_its_last_token_as_objective_reward_trained_it():
    """objective.reward_model: a row's reward is the model's value after the whole prompt and completion (the end
    token where written), as the row alone gives it, added to the reward function's."""
    from src.models.gpt import GPT as Model

    end = ord("\n")
    data = Data(["write a:", "a longer prompt, write a:"], end_of_text=end)
    objective, model = objective_and_model(data, max_completion_tokens=10)
    torch.manual_seed(1)
    objective.reward_model = Model(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16, head="reward").eval()
    objective.reward_weights = torch.ones(2)  # the function's, then the model's
    with torch.no_grad():
        model.lm_head.weight[end] *= 4  # some completions end early
        rollout = written(objective, model, prompt_batch(data, [0, 1]))
        alone = [objective.reward_model(ids[mask.bool()][None])[0, -1, 0]
                 for ids, mask in zip(rollout["input_ids"], rollout["attention_mask"])]
    function = torch.tensor([sum(ch == "a" for ch in data.codec.decode(c[:-1] if c[-1:] == [end] else c))
                             / max(len(c) - (c[-1:] == [end]), 1) for c in completions(rollout)])
    torch.testing.assert_close(rollout["rewards"], torch.stack(alone) + function, rtol=1e-5, atol=1e-6)
    assert len(set(rollout["attention_mask"].sum(-1).tolist())) > 1  # rows of several lengths


def test_grpo_raises_the_score_of_a_reward_model_trained_by_objective_reward(tmp_path):
    """A reward model trained on pairs whose chosen answers hold more a's, then GRPO from scratch against it alone:
    its score of the completions rises from below zero to that of the chosen answers, and eval.py scores the
    export as the run's last evaluation did (with no reference model: GRPO's evaluation reads none). A language
    model's export, or a reward model of other token ids, is refused as a reward model."""
    pairs, prompts = tmp_path / "pairs.jsonl", tmp_path / "write.jsonl"
    rng = __import__("random").Random(0)
    pairs.write_text("".join(json.dumps({
        "prompt": "write:", "chosen": "".join(rng.choice("aaabcdefg") for _ in range(8)),
        "rejected": "".join(rng.choice("bcdefgh") for _ in range(8))}) + "\n" for _ in range(200)))
    prompts.write_text((json.dumps({"prompt": "write:"}) + "\n") * 64)
    rm, policy = tmp_path / "rm", tmp_path / "policy"
    run([*GPT, "data=jsonl", f"data.path={pairs}", "data.preference=true", "objective=reward", "model.head=reward",
         "optimizer.lr=3e-3", "trainer.max_steps=60", "data.batch_size=8", "trainer.monitor=null", *QUIET,
         f"hydra.run.dir={rm}"])
    against = ["objective.reward=null", f"objective.reward_model={rm / 'model'}"]
    run(grpo_args(prompts, policy, *against, "trainer.max_steps=100", "data.batch_size=4", "trainer.eval_every=50",
                  "trainer.eval_on_start=true", "trainer.log_every=25"))
    reward = scalars(policy, "eval/reward")
    assert reward[0] < 0 < 1 < reward[100], reward
    run([f"path={policy / 'model'}", f"output={tmp_path / 'eval.json'}"], script="eval.py")
    assert json.loads((tmp_path / "eval.json").read_text())["eval/reward"] == pytest.approx(reward[100], abs=1e-5)

    lm = run(grpo_args(prompts, tmp_path / "lm", "objective.reward=null",
                       f"objective.reward_model={policy / 'model'}", *QUIET), check=False)
    refused(lm, f"objective.reward_model={policy / 'model'}", "not a reward model", "objective=reward")
    chars = run(grpo_args(prompts, tmp_path / "chars", *against, "data.tokenizer=char", *QUIET), check=False)
    refused(chars, f"objective.reward_model={rm / 'model'}", "bytes")


def test_grpo_without_any_reward_or_with_a_reward_missing_a_column_is_refused(tmp_path):
    from src.objectives.grpo import GRPO

    with pytest.raises(UsageError) as error:
        GRPO(reward=None)
    named(str(error.value), "objective.reward", "objective.reward_model")
    prompts = tmp_path / "write.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "write:", "wanted": "a"}) + "\n" for _ in range(16)))
    proc = run(grpo_args(prompts, tmp_path / "run", *QUIET, "trainer.max_steps=1", "data.batch_size=2"), check=False)
    refused(proc, f"objective.reward={LETTERS}", "letter", "wanted")


def test_prompts_come_from_any_dataset_data_hf_dataset_reads_with_their_columns_for_the_reward(tmp_path):
    """A folder of Parquet splits, as GSM8K's: the question column prompts, the test split validates, every row's
    other columns reach the reward by the prompt's number; a prompt column the data lacks is refused naming the
    columns it has."""
    pd = pytest.importorskip("pandas")
    from src.data.prompts import PromptsData

    folder = tmp_path / "gsm"
    folder.mkdir()
    for split, n in (("train", 12), ("test", 3)):
        pd.DataFrame([{"question": f"{split} {i}: 2+{i}=", "answer": f"... #### {2 + i}"} for i in range(n)]
                     ).to_parquet(folder / f"{split}.parquet")
    data = PromptsData(block_size=32, path=str(folder), prompt_key="question", val_split="test")
    assert (len(data.train), len(data.val)) == (12, 3)
    first_val = data.val[0]
    assert data.rows[int(first_val["prompt_index"])] == {"prompt": "test 0: 2+0=", "answer": "... #### 2"}
    assert data.codec.decode(first_val["input_ids"].tolist()) == "test 0: 2+0="
    with pytest.raises(UsageError) as error:
        PromptsData(block_size=32, path=str(folder), prompt_key="prompt", val_split="test")
    named(str(error.value), "'prompt'", "data.prompt_key", "answer", "question")
    with pytest.raises(UsageError) as error:  # a system message is a chat template's to render
        PromptsData(block_size=32, path=str(folder), prompt_key="question", system_prompt="Be brief.")
    named(str(error.value), "data.system_prompt", "data.chat=true")


def test_beta_adds_each_tokens_kl_divergence_from_the_starting_weights_zero_until_the_policy_moves():
    """objective.beta: at the starting weights the frozen copy is the policy, so the loss and its gradient are
    beta=0's; once the policy has moved, each completion's loss adds beta x its tokens' mean k3 divergence
    exp(r) - r - 1 (r = reference - policy log-probability), times the importance ratio (1 in value; its gradient
    the unbiased one), which train/kl reports per token trained on (TRL's)."""
    import copy

    from src.objectives.preference import next_token_logps

    data = Data(["write a:", "write b:"])
    objective, model = objective_and_model(data, beta=0.5, loss_type="grpo")
    plain, _ = objective_and_model(data, loss_type="grpo")
    starting = copy.deepcopy(model)
    batch = prompt_batch(data, [0, 1])
    rollout = written(objective, model, batch)
    rollout["advantages"] = torch.linspace(-1, 1, 8)
    loss = objective.model_loss_sum(model, rollout, None).sum()
    torch.testing.assert_close(loss, -rollout["advantages"].sum())
    grads = torch.autograd.grad(loss, [model.tok_emb.weight])[0]
    unrolled = {k: v for k, v in rollout.items() if k != "reference_logps"}
    torch.testing.assert_close(grads, torch.autograd.grad(plain.model_loss_sum(model, unrolled, None).sum(),
                                                          [model.tok_emb.weight])[0])
    assert objective.training_metrics()["kl"][0] == 0

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    rollout = written(objective, model, batch)
    counted = rollout["labels"][:, 1:] != -100
    policy = next_token_logps(model(rollout["input_ids"]), rollout)
    r = next_token_logps(starting(rollout["input_ids"]), rollout) - policy
    kl = ((torch.exp(r) - r - 1) * counted).sum(-1)
    loss = objective.model_loss_sum(model, rollout, None).sum()
    ratio = torch.exp(policy - policy.detach())  # use_bias_correction_kl: the KL term's gradient through it too
    corrected = ((torch.exp(r) - r - 1) * ratio * counted).sum(-1) / counted.sum(-1)
    expected = (((-ratio * rollout["advantages"][:, None]) * counted).sum(-1) / counted.sum(-1) + 0.5 * corrected).sum()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, [model.tok_emb.weight])[0],
                               torch.autograd.grad(expected, [model.tok_emb.weight])[0])
    assert kl.min() > 0
    torch.testing.assert_close(objective.training_metrics()["kl"], torch.stack([kl.sum(), counted.sum()]).detach())


def test_beta_trains_against_the_starting_weights_logging_train_kl(tmp_path):
    run_dir = tmp_path / "kl"
    run(grpo_args(letter_prompts(tmp_path / "letters.jsonl"), run_dir, *QUIET, "objective.beta=0.1",
                  "data.batch_size=4", "trainer.max_steps=4"))
    kl = scalars(run_dir, "train/kl")
    assert kl[1] == 0 and 0 < kl[2] < kl[4], kl


@pytest.mark.parametrize("form", ["string", "conversation"])
def test_a_prompt_is_the_tokens_sft_conditioned_on_so_grpo_continues_where_sft_answered(form, chat_model,  # noqa: F811
                                                                                        tmp_path):
    """data=prompts tokenizes a prompt as data=jsonl's prompted sample starts (its tokens labelled -100): a string
    with the tokenizer's special tokens, a conversation through the chat template up to the assistant's cue."""
    from src.data.jsonl import prompted
    from src.data.prompts import PromptsData

    prompt = ("ROMEO: speak." if form == "string" else
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ROMEO: speak."}])
    completion = " I will." if form == "string" else [{"role": "assistant", "content": "I will."}]
    path = tmp_path / "prompts.jsonl"
    path.write_text((json.dumps({"prompt": prompt}) + "\n") * 4)
    data = PromptsData(block_size=64, path=str(path), tokenizer=str(chat_model))
    ids, labels = prompted(data.codec, prompt, completion)
    conditioned = ids[:labels.index(next(label for label in labels if label != -100))]
    assert data.train[0]["input_ids"].tolist() == conditioned


def test_chunked_log_probabilities_give_the_loss_kl_and_gradients_of_whole_logits():
    """objective.chunk_tokens: the policy's and the reference's token log-probabilities come from the output layer
    a few positions at a time, and the loss, its gradient and train/kl are those of the whole logits."""
    from tests.test_chunked_loss import whole_logits_seen

    data = Data(["write a:", "a longer prompt, write b:"])
    whole, model = objective_and_model(data, beta=0.5, loss_type="grpo")  # a mean per completion: atol's scale
    chunked, _ = objective_and_model(data, beta=0.5, chunk_tokens=3, loss_type="grpo")
    with torch.no_grad():
        for parameter in model.parameters():  # away from the references (the starting weights)
            parameter.add_(0.05 * torch.randn_like(parameter))
    rollout = written(whole, model, prompt_batch(data, [0, 1]))
    rollout["advantages"] = torch.linspace(-1, 1, 8)
    with whole_logits_seen(256) as seen:
        chunked_rollout = dict(rollout, reference_logps=chunked.reference(model, rollout, None))
        chunked_loss = chunked.model_loss_sum(model, chunked_rollout, None).sum()
    assert not seen, seen  # neither the policy's pass nor the reference's held a batch's logits
    torch.testing.assert_close(chunked_rollout["reference_logps"] * (rollout["labels"][:, 1:] != -100),
                               rollout["reference_logps"] * (rollout["labels"][:, 1:] != -100))
    whole.training_metrics()
    losses = [whole.model_loss_sum(model, rollout, None).sum(), chunked_loss]
    torch.testing.assert_close(losses[1], losses[0])
    grads = [torch.autograd.grad(loss, list(model.parameters())) for loss in losses]
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(chunked.training_metrics()["kl"], whole.training_metrics()["kl"])


def test_the_gsm8k_recipe_runs_on_local_files_with_its_own_config(tmp_path, chat_model):  # noqa: F811
    """experiment=grpo_gsm8k as written, the hub's model and dataset replaced by a tiny chat model and a local
    folder of GSM8K's form (train and test splits of question and answer); its questions rendered by the chat
    template with the recipe's system message."""
    pd = pytest.importorskip("pandas")
    from src.data.prompts import PromptsData

    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split, n in (("train", 16), ("test", 4)):
        pd.DataFrame([{"question": f"What is 2 + {i}?", "answer": f"2 + {i} = {2 + i}\n#### {2 + i}"}
                      for i in range(n)]).to_parquet(folder / f"{split}.parquet")
    run_dir = tmp_path / "run"
    log = run(["experiment=grpo_gsm8k", f"model.pretrained={chat_model}", f"data.path={folder}", "data.subset=null",
               "model.block_size=64", "objective.max_completion_tokens=8", "objective.chunk_tokens=16",
               "trainer.mixed_precision=no", "trainer.max_steps=2", "trainer.eval_batches=1", "data.batch_size=2",
               "trainer.log_every=1", f"hydra.run.dir={run_dir}"]).stdout
    named(log, "objective.max_completion_tokens=8", "(logged once)")  # the rendered prompts are long: kept ends
    assert sorted(scalars(run_dir, "eval/reward")) == [2] and 1 in scalars(run_dir, "train/reward")
    recipe = PromptsData(block_size=64, path=str(folder), prompt_key="question", val_split="test", chat=True,
                         system_prompt="end with #### N", tokenizer=str(chat_model))
    rendered = recipe.codec.decode(recipe.train[0]["input_ids"].tolist())
    assert "end with #### N" in rendered and "What is 2 + 0?" in rendered and rendered.endswith("<|assistant|>")


def test_several_rewards_are_summed_by_their_weights_and_each_is_logged(tmp_path):
    """objective.reward as a list with objective.reward_weights (TRL's reward_funcs and reward_weights): the
    reward is their weighted sum, and train/rewards/NAME logs each one's mean; a weight per reward is required."""
    from src.objectives.grpo import GRPO

    run_dir = tmp_path / "two"
    run(grpo_args(letter_prompts(tmp_path / "letters.jsonl"), run_dir, *QUIET, "data.batch_size=4",
                  "trainer.max_steps=30", "objective.num_generations=16",
                  f"objective.reward=[{LETTERS},tests.grpo_rewards.starts_with_letter]",
                  "objective.reward_weights=[1.0,0.5]", "objective.beta=0.1"))
    share, first = (scalars(run_dir, f"train/rewards/{name}") for name in ("letter_share", "starts_with_letter"))
    total = scalars(run_dir, "train/reward")
    assert sorted(total) == list(range(1, 31)) and max(first.values()) > 0 and scalars(run_dir, "train/kl")[30] > 0
    assert all(total[s] == pytest.approx(share[s] + 0.5 * first[s], abs=1e-6) for s in total)
    with pytest.raises(UsageError) as error:
        GRPO(reward=[LETTERS, LETTERS], reward_weights=[1.0])
    named(str(error.value), "objective.reward_weights=[1.0]", "2")


@pytest.mark.slow  # compilation, ~20 s
def test_a_compiled_grpo_step_trains_the_eager_steps_weights(tmp_path):
    """trainer.compile=true: the rollout stays outside the compiled step (its shapes change every step), the loss
    inside it; the same completions and rewards, and the weights of the eager run (AdamW's rounding aside). The
    prompts' lengths vary, so the output layer's first position (logits_to_keep) changes from step to step."""
    prompts = letter_prompts(tmp_path / "letters.jsonl", varied=True)
    common = [*QUIET, "data.batch_size=2", "trainer.max_steps=6"]
    run(grpo_args(prompts, tmp_path / "eager", *common))
    run(grpo_args(prompts, tmp_path / "compiled", *common, "trainer.compile=true"))
    assert scalars(tmp_path / "compiled", "train/reward") == scalars(tmp_path / "eager", "train/reward")
    assert max(scalars(tmp_path / "eager", "train/grad_norm").values()) > 0
    assert max_abs_diff(exported_weights(tmp_path / "compiled"), exported_weights(tmp_path / "eager")) <= 1e-4
