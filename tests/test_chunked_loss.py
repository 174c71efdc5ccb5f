"""objective.chunk_tokens: the loss through the output layer a chunk of tokens at a time equals the plain loss,
and so do its gradients, for the template's GPT and transformers models (with LoRA too); a model that changes its
logits after the output layer is refused. Under DDP and FSDP2 (real launches): the same training."""

import contextlib
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from src.errors import UsageError
from src.loop.forward import Forward
from src.models.gpt import GPT
from src.objectives.chunked import CHECKED_TOKENS, output_layer
from src.objectives.classification import CausalLM, CrossEntropy
from tests.conftest import QUIET, TINY_GPT, run, scalars
from tests.test_preference import pairs_and_model, preference_objective, started

VOCAB = 97


def losses_and_gradients(model, objective, inputs, targets, compile=False):
    model.zero_grad()
    loss = Forward(objective, compile=compile).loss_sum(model, inputs, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training(model, plain, chunked, inputs, targets, compile=False):
    expected, expected_grads = losses_and_gradients(model, plain, inputs, targets)
    got, grads = losses_and_gradients(model, chunked, inputs, targets, compile)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    hidden = torch.randn(2, model.lm_head.in_features)  # outside a training step, the output layer gives logits
    torch.testing.assert_close(model.lm_head(hidden), hidden @ model.lm_head.weight.T)


def tiny_llama(attention: Optional[str] = None, **config):
    """`attention`: transformers' attn_implementation (None: its choice)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, **config)
    return transformers.AutoModelForCausalLM.from_config(cfg, **({"attn_implementation": attention} if attention
                                                                 else {}))


@pytest.mark.parametrize("chunk", [7, 64, 1000])  # uneven, even, one chunk
def test_chunked_loss_and_gradients_equal_the_plain_ones_for_the_tied_gpt(chunk):
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32)
    x, y = torch.randint(0, VOCAB, (3, 32)), torch.randint(0, VOCAB, (3, 32))
    y[0, :5] = -100  # ignored targets count for nothing in either
    assert_same_training(model, CrossEntropy(), CrossEntropy(chunk_tokens=chunk), x, y)


def llama_and_batch(lora: bool):
    """A tiny transformers Llama (with a LoRA adapter, or not), two sequences and their labels, some ignored."""
    torch.manual_seed(0)
    model = tiny_llama()
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, VOCAB, (2, 24))
    labels = ids.clone()
    labels[1, 20:] = -100
    return model, ids, labels


@pytest.mark.parametrize("lora", [False, True])
def test_chunked_causal_lm_loss_and_gradients_equal_the_plain_ones_for_a_transformers_llama(lora):
    model, ids, labels = llama_and_batch(lora)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    expected, expected_grads = losses_and_gradients(model, CausalLM(), inputs, labels)
    got, grads = losses_and_gradients(model, CausalLM(chunk_tokens=10), inputs, labels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and (not lora or all("lora" in n for n in grads))
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # 5 s of compilation (the suite's time); CI runs it
def test_the_chunked_loss_compiles_to_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=32)
    x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    assert_same_training(model, CrossEntropy(), CrossEntropy(chunk_tokens=8), x, y, compile=True)
    y = torch.randint(0, VOCAB, (2, 16))  # a new micro-batch: its own targets, not the traced ones
    assert_same_training(model, CrossEntropy(), CrossEntropy(chunk_tokens=8), x, y, compile=True)


def assert_same_metrics(model, plain, chunked, inputs, targets, compile=False):
    model.eval()
    with torch.no_grad():
        expected = Forward(plain, compile=False).metrics(model, inputs, targets)
        forward = Forward(chunked, compile=compile)
        for _ in range(2):  # compiled: a second batch reuses the graph with its own targets
            got = forward.metrics(model, inputs, targets)
    assert got.keys() == expected.keys() == {"loss", "accuracy"}
    for name in got:
        for value, reference in zip(got[name], expected[name]):  # (per-sample value, weight)
            torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("compile", [False, True])
def test_chunked_evaluation_gives_the_metrics_of_the_whole_logits_for_the_gpt(compile):
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32)
    x, y = torch.randint(0, VOCAB, (3, 32)), torch.randint(0, VOCAB, (3, 32))
    y[0, :5] = -100
    assert_same_metrics(model, CrossEntropy(), CrossEntropy(chunk_tokens=7), x, y, compile)


@pytest.mark.parametrize("lora", [False, True])
def test_chunked_evaluation_gives_the_metrics_of_the_whole_logits_for_a_transformers_llama(lora):
    model, ids, labels = llama_and_batch(lora)
    assert_same_metrics(model, CausalLM(), CausalLM(chunk_tokens=10), {"input_ids": ids}, labels)


def llama_that_scales_its_logits():
    """A tiny Llama whose logits are doubled after its output layer, as Gemma's soft-capping or a logit scale change
    them: a loss computed inside the output layer would be wrong."""
    model = tiny_llama()
    plain_forward = type(model).forward

    class ScalesItsLogits(type(model)):
        def forward(self, *args, **kwargs):
            out = plain_forward(self, *args, **kwargs)
            out.logits = out.logits * 2
            return out

    model.__class__ = ScalesItsLogits
    return model


def test_a_model_that_changes_its_logits_after_the_output_layer_is_refused_naming_the_key():
    model = llama_that_scales_its_logits()
    ids = torch.randint(0, VOCAB, (2, 24))
    prompted = ids.clone()
    prompted[:, :20] = -100  # a prompt longer than the tokens the check reads: it still reads tokens that count
    for labels in (ids, prompted):
        with pytest.raises(UsageError, match="objective.chunk_tokens") as refused:
            Forward(CausalLM(chunk_tokens=8), compile=False).loss_sum(model, {"input_ids": ids}, labels)
        assert "objective.chunk_tokens=null" in str(refused.value)
    Forward(CausalLM(chunk_tokens=None), compile=False).loss_sum(model, {"input_ids": ids}, ids)  # as suggested


def test_training_with_chunked_loss_under_ddp_and_fsdp2_matches_the_plain_loss(tmp_path):
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.max_steps=4", "trainer.checkpoint_every=0",
            "trainer.monitor=null"]
    plain, ddp, fsdp = tmp_path / "plain", tmp_path / "ddp", tmp_path / "fsdp"
    run([*args, f"hydra.run.dir={plain}"], nproc=2)
    run([*args, "objective.chunk_tokens=48", f"hydra.run.dir={ddp}"], nproc=2)
    run([*args, "objective.chunk_tokens=48", f"hydra.run.dir={fsdp}"], nproc=2, script="tests/fsdp_on_cpu.py",
        launcher="fsdp")
    expected, expected_eval = scalars(plain, "train/loss"), scalars(plain, "eval/loss")
    for run_dir in (ddp, fsdp):
        got = scalars(run_dir, "train/loss")
        assert sorted(got) == [1, 2, 3, 4]
        assert max(abs(got[s] - expected[s]) for s in got) <= 1e-5
        assert abs(scalars(run_dir, "eval/loss")[4] - expected_eval[4]) <= 1e-5  # evaluated in chunks too


LLAMA = ["model=hf_causal_lm", "data=jsonl", "objective=causal_lm", "model.block_size=48", "~model.config",
         "+model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
         "num_attention_heads: 2, num_key_value_heads: 1, vocab_size: ${dataset:vocab_size}, "
         "max_position_embeddings: 48}"]


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [[], ["+model.peft={peft_type: LORA, r: 4, target_modules: [q_proj, v_proj]}"]],
                         ids=["llama", "llama_lora"])
def test_a_transformers_model_under_fsdp2_trains_the_plain_losses_with_chunked_loss(tmp_path, adapter):
    """The output layer FSDP2 shards (its weight gathered for the chunks), untied, with and without a LoRA adapter."""
    pytest.importorskip("transformers")
    if adapter:
        pytest.importorskip("peft")
    args = [*LLAMA, *adapter, *QUIET, "data.batch_size=4", "trainer.max_steps=3", "trainer.checkpoint_every=0",
            "trainer.monitor=null"]
    plain, chunked = tmp_path / "plain", tmp_path / "chunked"
    for run_dir, extra in ((plain, []), (chunked, ["objective.chunk_tokens=24"])):
        run([*args, *extra, f"hydra.run.dir={run_dir}"], nproc=2, script="tests/fsdp_on_cpu.py", launcher="fsdp")
    expected, got = scalars(plain, "train/loss"), scalars(chunked, "train/loss")
    assert sorted(got) == [1, 2, 3]
    assert max(abs(got[s] - expected[s]) for s in got) <= 1e-5


# ------------------------------------------------------------------------------------------ preference objectives


def trained_and_evaluated(forward, model, inputs, labels):
    """A micro-step's loss (each term over its count) and gradients, and the evaluation metrics of the batch."""
    model.zero_grad()
    loss = (forward.loss_sum(model, inputs, labels) / forward.objective.count(labels)).sum()
    loss.backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    inputs = {k: v.clone() for k, v in inputs.items()}  # as an evaluation's batch: evaluation marks its sizes dynamic
    with torch.no_grad():
        metrics = {name: (v.sum() / w.sum()).item() for name, (v, w) in forward.metrics(model, inputs, labels).items()}
    return loss.detach(), gradients, metrics


@contextlib.contextmanager
def whole_logits_seen(vocab_size: int):
    """The modules (any model's) that output logits of more tokens than the start-up check's prefix while it is
    open: the output layers and models that computed a batch's logits."""
    seen = []

    def record(module, args, output):
        logits = getattr(output, "logits", output)
        if isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[-1] == vocab_size \
                and logits.shape[:-1].numel() > CHECKED_TOKENS:
            seen.append((type(module).__name__, tuple(logits.shape)))

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("model_kind", ["gpt", "gpt2_lora"])
@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_chunked_answer_log_probabilities_train_and_evaluate_as_the_whole_logits_do(objective, model_kind, packing,
                                                                                     pretrained, tmp_path):
    """objective.chunk_tokens with preference pairs: every answer token's log-probability computed by the output
    layer 7 positions at a time (the reference's too: a frozen copy of the GPT, or the LoRA model with its adapter
    off) gives the loss, the gradients and every metric of the whole logits, padded or packed."""
    model, inputs, labels = pairs_and_model(model_kind, packing, pretrained)
    plain, chunked = (started(preference_objective(objective, chunk_tokens=chunk), model, tmp_path)
                      for chunk in (None, 7))
    if model_kind == "gpt":  # the policy moves away from the reference copies taken at start
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.1)
    expected_loss, expected_gradients, expected_metrics = trained_and_evaluated(Forward(plain, False), model, inputs,
                                                                               labels)
    with whole_logits_seen(output_layer(model).out_features) as seen:
        loss, gradients, metrics = trained_and_evaluated(Forward(chunked, False), model, inputs, labels)
    assert not seen, seen  # neither the policy's nor the reference's pass held a batch's logits
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert gradients.keys() == expected_gradients.keys() and gradients
    for name in gradients:
        torch.testing.assert_close(gradients[name], expected_gradients[name], rtol=1e-5, atol=1e-6, msg=name)
    assert metrics.keys() == expected_metrics.keys()
    for name in metrics:
        assert metrics[name] == pytest.approx(expected_metrics[name], abs=1e-5), name
    layer = output_layer(model)
    hidden = torch.randn(2, layer.in_features)
    torch.testing.assert_close(layer(hidden), F.linear(hidden, layer.weight, layer.bias))  # logits outside a step


@pytest.mark.slow  # compilation (the suite's time); CI runs it
def test_chunked_answer_log_probabilities_compile_to_the_same_loss_and_gradients(pretrained, tmp_path):
    """trainer.compile=true: the output layer switched inside the compiled step (the policy's pass) and outside it
    (the reference's); a second micro-batch (the pairs with their answers swapped) gives its own numbers, not the
    traced ones."""
    model, inputs, labels = pairs_and_model("gpt", False, pretrained)
    plain, chunked = (started(preference_objective("dpo", chunk_tokens=chunk), model, tmp_path)
                      for chunk in (None, 7))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.1)
    compiled = Forward(chunked, compile=True)
    swapped = torch.arange(labels.shape[0]).roll(labels.shape[0] // 2)  # rejected rows first
    for rows in (slice(None), swapped):
        batch = {k: v[rows] if v.dim() == 2 else v for k, v in inputs.items()}
        expected = trained_and_evaluated(Forward(plain, False), model, batch, labels[rows])
        got = trained_and_evaluated(compiled, model, batch, labels[rows])
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
        for name in got[1]:
            torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)
        assert got[2] == pytest.approx(expected[2], rel=1e-6, abs=1e-5)


def test_a_model_that_changes_its_logits_after_the_output_layer_is_refused_with_preference_pairs():
    from src.objectives.preference import SimPO

    model = llama_that_scales_its_logits()
    ids = torch.randint(0, VOCAB, (4, 24))
    labels = ids.clone()
    labels[:, :10] = -100
    inputs = {"input_ids": ids, "pair_index": torch.arange(2)}
    with pytest.raises(UsageError, match="objective.chunk_tokens: .*changes its logits") as refused:
        Forward(SimPO(chunk_tokens=8), compile=False).loss_sum(model, inputs, labels)
    assert "objective.chunk_tokens=null" in str(refused.value)
    Forward(SimPO(), compile=False).loss_sum(model, inputs, labels)  # as suggested
