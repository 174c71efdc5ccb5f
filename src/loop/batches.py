"""The forms a batch and a model's output may take: the ecosystem's, not only ours.

A batch is a tuple/list `(inputs, targets)` or a mapping (`input_ids`, `attention_mask`, `labels`, ...). A
mapping's keys other than the objective's `target_key` are the model's keyword arguments (so a Hugging Face
model never sees `labels` and computes no loss of its own). A model returns a tensor of logits, or an object
or mapping with `logits` (transformers' ModelOutput).
"""

from typing import Any, Mapping

import torch

from src.errors import UsageError

BATCH_FORMS = ("a tuple/list (inputs, targets), or a mapping holding the targets under objective.target_key "
               "(default labels) and the model's keyword arguments under the other keys")


def split_batch(batch: Any, target_key: str) -> tuple[Any, torch.Tensor]:
    """(model inputs: a tensor or a mapping of keyword arguments, targets)."""
    if isinstance(batch, Mapping):
        if target_key not in batch:
            raise UsageError(f"A batch arrived as a mapping with keys {sorted(batch)}, none of them "
                             f"objective.target_key={target_key!r}. Accepted: {BATCH_FORMS}.")
        return {k: v for k, v in batch.items() if k != target_key}, batch[target_key]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise UsageError(f"A batch arrived as {_describe(batch)}. Accepted: {BATCH_FORMS}.")


def call_model(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    return logits_of(output)


def logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:  # transformers' ModelOutput is a mapping too
        return output["logits"]
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise UsageError(f"The model returned {_describe(output)}. Accepted: a tensor of logits, or an object or "
                     "mapping with a `logits` tensor (as transformers' ModelOutput).")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {sorted(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(_describe(v) for v in value)})"
    return f"a {type(value).__module__}.{type(value).__name__}"
