"""The training loss through the output layer a chunk of tokens at a time (objective.chunk_tokens): the fp32 logits
of a whole micro-batch are never held.

With a large vocabulary (Llama 3: 128k tokens) the logits are the largest tensors of a step: batch x sequence x
vocabulary, upcast to fp32 for the log-softmax, kept for the backward pass, and their gradient as large again.
Here the model's output layer computes the loss sum itself, inside the model's forward pass (so DDP's and FSDP's
hooks on that layer run as always and its weight is gathered when FSDP shards it): the tokens are split into
chunks, and each chunk's logits and cross-entropy run under activation checkpointing, which keeps only the
chunk's hidden states and recomputes its logits in the backward pass. Peak memory: one chunk's logits and their
gradient. Cost: the output layer's matrix product once more in the backward pass. The loss and the gradients are
the plain computation's within float rounding (a sum in another order). Evaluation goes through the output layer
the same way: each token's loss and whether its likeliest token is the target, a chunk at a time, never the
logits of a whole batch (its metrics those of the whole logits). Preference objectives (dpo, simpo, orpo) have the
layer give each position's log-probability of its next input token instead, chunk by chunk the same way, for the
policy's pass and the reference's (src/objectives/preference.py). Distillation (src/objectives/distillation.py)
computes both its terms per chunk here, from the teacher's last hidden states, which its output layer gives instead
of logits (output_layer_gives_hidden_states).

It is what torchtune's chunked output and Liger's fused linear cross-entropy do, written with torch's own
checkpointing so that it works on any device and under torch.compile, for any model whose output layer is a
Linear reached by get_output_embeddings() (transformers models, peft's) or `lm_head` (the template's GPT). A model
that transforms its logits after that layer (soft-capping, scaling) would be trained on a wrong loss: the first
micro-batch is checked against the plain loss, and such a model is refused, naming the key.
"""

import contextlib
import types
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from src.errors import UsageError
from src.loop.batches import call_model

# Tokens of a prefix of the first micro-batch on which the chunked loss is checked against the plain one.
CHECKED_TOKENS = 16


def output_layer(model: torch.nn.Module) -> torch.nn.Linear:
    inner = getattr(model, "module", model)  # DDP's wrapper
    find = getattr(inner, "get_output_embeddings", lambda: getattr(inner, "lm_head", None))
    layer = find()
    if not isinstance(layer, torch.nn.Linear):
        raise UsageError(f"objective.chunk_tokens needs the model's output layer as a torch.nn.Linear, found by "
                         f"get_output_embeddings() or as `lm_head`; {type(inner).__name__} has "
                         f"{type(layer).__name__ if layer is not None else 'neither'}: use objective.chunk_tokens=null")
    return layer


@contextlib.contextmanager
def output_layer_loss(model: torch.nn.Module, objective, targets: torch.Tensor, per_token: bool = False
                      ) -> Iterator[None]:
    """Within it, the model's output (its `logits`) is the loss sum over this micro-batch's counted targets (or, with
    `per_token`, each aligned target's loss and whether it was the likeliest token, as (..., 2)); outside, the
    output layer is the Linear it was. Set outside a compiled step: the compiled graph reads the targets as the
    layer's input, so a new micro-batch does not recompile it."""
    with _output_layer_computes(model, "token_scores" if per_token else "loss_sum", targets, objective):
        yield


@contextlib.contextmanager
def output_layer_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, chunk_tokens: int) -> Iterator[None]:
    """Within it, the model's output is each position's log-probability of the next input token, (rows, T-1) in
    fp32: what preference objectives sum over answers (src/objectives/preference.py), chunk_tokens positions at a
    time, so that neither a batch's logits nor their fp32 log-softmax are held."""
    with _output_layer_computes(model, "token_logps", input_ids[:, 1:], chunk_tokens=chunk_tokens):
        yield


@contextlib.contextmanager
def output_layer_gives_hidden_states(model: torch.nn.Module) -> Iterator[list]:
    """Within it, the model's output is its output layer's input: the hidden states it would turn into logits (a
    distillation teacher's, turned into logits a chunk at a time by the student's output layer). The list it gives
    gets (weight, bias) of the layer as its forward had them (under FSDP, gathered)."""
    seen: list = []
    with _output_layer_computes(model, "hidden", seen):
        yield seen


@contextlib.contextmanager
def _output_layer_computes(model: torch.nn.Module, mode: str, targets: torch.Tensor, objective=None,
                           chunk_tokens: Optional[int] = None) -> Iterator[None]:
    layer = output_layer(model)
    if "forward" not in vars(layer):  # once: the layer's own forward, which computes the loss while targets are set
        layer.forward = types.MethodType(_logits_or_chunked, layer)
        layer.chunked_targets = None
    layer.chunked_targets, layer.chunked_mode = targets, mode
    layer.chunked_objective, layer.chunked_size = objective, chunk_tokens
    try:
        yield
    finally:
        layer.chunked_targets = None


def _logits_or_chunked(layer: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    if layer.chunked_targets is None:
        return F.linear(hidden, layer.weight, layer.bias)
    if layer.chunked_mode == "hidden":  # output_layer_gives_hidden_states
        layer.chunked_targets.append((layer.weight, layer.bias))
        return hidden
    if layer.chunked_mode == "token_logps":
        return chunked_token_logps(hidden, layer.weight, layer.bias, layer.chunked_targets, layer.chunked_size)
    objective = layer.chunked_objective  # its own chunks: cross-entropy's below, distillation's its own
    compute = objective.chunked_token_scores if layer.chunked_mode == "token_scores" else objective.chunked_loss_sum
    return compute(hidden, layer.weight, layer.bias, layer.chunked_targets)


def chunked_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                     objective) -> torch.Tensor:
    _, chunks = _aligned_chunks(hidden, targets, objective)
    total = hidden.new_zeros((), dtype=torch.float32)
    for hidden_chunk, target_chunk in chunks:
        total = total + checkpoint(_loss_sum_of_chunk, hidden_chunk, weight, bias, target_chunk,
                                   objective.ignore_index, use_reentrant=False)
    return total


def chunked_token_scores(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         targets: torch.Tensor, objective) -> torch.Tensor:
    """Each aligned target's loss and whether the likeliest token is it, (..., 2) in fp32: evaluation's metrics
    without a batch's logits (no gradient is kept, so nothing is checkpointed)."""
    shape, chunks = _aligned_chunks(hidden, targets, objective)
    scores = []
    for hidden_chunk, target_chunk in chunks:
        logits = F.linear(hidden_chunk, weight, bias).float()
        loss = F.cross_entropy(logits, target_chunk, ignore_index=objective.ignore_index, reduction="none")
        scores.append(torch.stack([loss, (logits.argmax(-1) == target_chunk).float()], dim=-1))
    return torch.cat(scores).view(*shape, 2)


def chunked_token_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        next_ids: torch.Tensor, size: int) -> torch.Tensor:
    """(rows, T-1) fp32: position t's log-probability of next_ids[:, t], `size` positions at a time, each chunk's
    logits recomputed in the backward pass where a gradient is wanted."""
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    ids = next_ids.reshape(-1)
    pieces = [(hidden[start:start + size], weight, bias, ids[start:start + size])
              for start in range(0, ids.numel(), size)]
    if torch.is_grad_enabled():
        logps = [checkpoint(_token_logps_of_chunk, *piece, use_reentrant=False) for piece in pieces]
    else:  # a reference model's or an evaluation's pass: nothing to recompute
        logps = [_token_logps_of_chunk(*piece) for piece in pieces]
    return torch.cat(logps).view(next_ids.shape)


def _token_logps_of_chunk(hidden, weight, bias, ids) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # fp32 whatever the autocast dtype, as with whole logits
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def _aligned_chunks(hidden: torch.Tensor, targets: torch.Tensor, objective) -> tuple[torch.Size, list]:
    """The aligned targets' shape (causal: position t predicts target t+1), and (hidden states, targets) as rows,
    objective.chunk_tokens of them at a time."""
    hidden, targets = objective.aligned(hidden, targets)
    shape, hidden, targets = targets.shape, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    size = objective.chunk_tokens
    return shape, [(hidden[start:start + size], targets[start:start + size])
                   for start in range(0, targets.numel(), size)]


def _loss_sum_of_chunk(hidden, weight, bias, targets, ignore_index: int) -> torch.Tensor:
    # fp32 whatever the autocast dtype, as CrossEntropy.loss_sum does with whole logits.
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ignore_index=ignore_index,
                           reduction="sum")


def check_the_model_keeps_its_logits(model: torch.nn.Module, inputs: Any, targets: torch.Tensor, objective) -> None:
    """On a prefix of the first micro-batch: the chunked loss against the plain one, its ignored targets replaced by
    tokens that count (a preference objective's: each position's log-probability of the next input token). A model
    that changes its logits after the output layer (Gemma's soft-capping, a logit scale) gives other numbers."""
    prefix = (slice(0, 1), slice(0, CHECKED_TOKENS))
    cut = (lambda t: t[prefix] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t)
    # Pairs and completions: the input ids are the targets; the rest is the data's layout.
    if getattr(objective, "trains_on_pairs", False) or getattr(objective, "trains_on_prompts", False):
        ids = cut(inputs["input_ids"])
        with torch.no_grad():
            logits = call_model(model, {"input_ids": ids})[:, :-1].float()
            plain = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logits.logsumexp(-1)
            with output_layer_token_logps(model, ids, objective.chunk_tokens):
                chunked = call_model(model, {"input_ids": ids})
        _refuse_unless_close(model, plain, chunked, "log-probabilities")
        return
    objective = getattr(objective, "cross_entropy", objective)  # distillation's: its cross-entropy term's
    inputs = {k: cut(v) for k, v in inputs.items()} if isinstance(inputs, Mapping) else cut(inputs)
    targets = cut(targets)
    if isinstance(targets, torch.Tensor):  # on tokens that count: a prompt's are all ignored, both losses then 0
        spread = torch.arange(targets.numel(), device=targets.device).view_as(targets) * 7919
        targets = torch.where(targets == objective.ignore_index, spread % output_layer(model).out_features, targets)
    with torch.no_grad():
        plain = objective.loss_sum(call_model(model, inputs), targets)
        with output_layer_loss(model, objective, targets):
            chunked = call_model(model, inputs)
    _refuse_unless_close(model, plain, chunked, "loss")


def _refuse_unless_close(model: torch.nn.Module, plain: torch.Tensor, chunked: torch.Tensor, what: str) -> None:
    if chunked.shape != plain.shape or not torch.allclose(chunked.float(), plain.float(), rtol=1e-3, atol=1e-3):
        model_name = type(getattr(model, "module", model)).__name__
        raise UsageError(f"objective.chunk_tokens: {model_name} changes its logits after its output layer (e.g. "
                         f"soft-capping or a logit scale), so the {what} cannot be computed from that layer in "
                         f"chunks (on a test prefix, plainly {plain.float().mean().item():.4f} on average, in chunks "
                         f"{chunked.float().mean().item():.4f}): use objective.chunk_tokens=null")
