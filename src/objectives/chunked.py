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
logits of a whole batch (its metrics those of the whole logits).

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
    layer = output_layer(model)
    if "forward" not in vars(layer):  # once: the layer's own forward, which computes the loss while targets are set
        layer.forward, layer.chunked_objective = types.MethodType(_logits_or_loss_sum, layer), objective
        layer.chunked_targets = None
    layer.chunked_targets, layer.chunked_per_token = targets, per_token
    try:
        yield
    finally:
        layer.chunked_targets = None


def _logits_or_loss_sum(layer: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    if layer.chunked_targets is None:
        return F.linear(hidden, layer.weight, layer.bias)
    if layer.chunked_per_token:
        return chunked_token_scores(hidden, layer.weight, layer.bias, layer.chunked_targets, layer.chunked_objective)
    return chunked_loss_sum(hidden, layer.weight, layer.bias, layer.chunked_targets, layer.chunked_objective)


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
    tokens that count. A model that changes its logits after the output layer (Gemma's soft-capping, a logit scale)
    gives another number."""
    prefix = (slice(0, 1), slice(0, CHECKED_TOKENS))
    cut = (lambda t: t[prefix] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t)
    inputs = {k: cut(v) for k, v in inputs.items()} if isinstance(inputs, Mapping) else cut(inputs)
    targets = cut(targets)
    if isinstance(targets, torch.Tensor):  # on tokens that count: a prompt's are all ignored, both losses then 0
        spread = torch.arange(targets.numel(), device=targets.device).view_as(targets) * 7919
        targets = torch.where(targets == objective.ignore_index, spread % output_layer(model).out_features, targets)
    with torch.no_grad():
        plain = objective.loss_sum(call_model(model, inputs), targets)
        with output_layer_loss(model, objective, targets):
            chunked = call_model(model, inputs)
    if chunked.shape != () or not torch.allclose(chunked.float(), plain.float(), rtol=1e-3, atol=1e-3):
        model_name = type(getattr(model, "module", model)).__name__
        raise UsageError(f"objective.chunk_tokens: {model_name} changes its logits after its output layer (e.g. "
                         f"soft-capping or a logit scale), so the loss cannot be computed from that layer in chunks "
                         f"(the plain loss of a test prefix is {plain.item():.4f}, the chunked one "
                         f"{chunked.float().mean().item():.4f}): use objective.chunk_tokens=null")
