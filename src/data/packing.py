"""Packing documents into blocks of `block_size` tokens, two ways (`data.packing`):

- `true`: whole documents, best fit, each token attending to its own document only. Every block carries
  `position_ids` that restart at 0 where a document starts; a model reads its documents' boundaries from them (the
  template's GPT masks attention block-diagonally; transformers models take the same `position_ids` into their
  packed-sequence masks on sdpa/eager, and into flash-attention's variable-length kernels). A document's first token
  is never a target, as in a padded batch: a packed batch trains exactly what the same documents padded train.
- `cross_document`: documents end to end, cut at block edges, attending across (pretraining on continuous text,
  as transformers' run_clm packs).
"""

import bisect
import inspect
import sys
from typing import Any, Optional

import torch

from src.data.base import IGNORE_INDEX
from src.errors import UsageError


def packed_documents(documents: list[list[int]], document_labels: list[list[int]], block_size: int,
                     split_long: bool) -> dict[str, list]:
    """Blocks of whole documents, best fit decreasing: the longest document first, each into the block it fills
    best (a new block where none has room). A document longer than `block_size` is truncated, or with
    `split_long` cut into pieces of `block_size` that are documents of their own. Within a block the documents
    keep their order; blocks are ordered by their first document. Also per block: how many documents it holds
    and how many were cut, and its tokens (`documents`, `cut`, `tokens`), for the log."""
    pieces = []  # (document index, ids, labels, cut: the first piece of a longer document)
    for index, (ids, labels) in enumerate(zip(documents, document_labels)):
        if len(ids) <= block_size:
            pieces.append((index, ids, labels, False))
            continue
        ends = range(0, len(ids), block_size) if split_long else [0]
        pieces += [(index, ids[i : i + block_size], labels[i : i + block_size], i == 0) for i in ends]
    blocks = best_fit([len(piece[1]) for piece in pieces], block_size)
    out = {"input_ids": [], "labels": [], "position_ids": [], "documents": [], "cut": [], "tokens": []}
    for block in blocks:
        ids, labels, positions = [], [], []
        for piece in block:
            _, piece_ids, piece_labels, _ = pieces[piece]
            ids += piece_ids
            labels += [IGNORE_INDEX, *piece_labels[1:]]  # its first token is no target: nothing before it to see
            positions += range(len(piece_ids))
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["position_ids"].append(positions)
        out["documents"].append(len(block))
        out["cut"].append(sum(pieces[p][3] for p in block))
        out["tokens"].append(len(ids))
    return out


def best_fit(sizes: list[int], block_size: int) -> list[list[int]]:
    """Items of these sizes (each at most block_size) into blocks, best fit decreasing: the largest first, each
    into the block it fills best (a new block where none has room). The blocks' items in their given order, the
    blocks ordered by their first item."""
    blocks, room = [], []  # room: sorted (free tokens, block number) of the blocks that are open
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep their order
        size = sizes[item]
        at = bisect.bisect_left(room, (size, -1))  # the fullest block that still has room for it
        if at == len(room):
            blocks.append([])
            free, number = block_size, len(blocks) - 1
        else:
            free, number = room.pop(at)
        blocks[number].append(item)
        if free - size > 0:
            bisect.insort(room, (free - size, number))
    return sorted((sorted(b) for b in blocks), key=lambda b: b[0])


def cross_document_blocks(documents: list[list[int]], document_labels: list[list[int]], block_size: int,
                          mask_boundaries: bool) -> dict[str, list]:
    """The documents end to end, cut into blocks, with their labels (-100 on prompts); also -100 where a document
    starts mid-block if asked. A tail shorter than a block is dropped, as transformers' run_clm does."""
    stream, stream_labels, starts = [], [], set()
    for ids, labels in zip(documents, document_labels):
        starts.add(len(stream))
        stream += ids
        stream_labels += labels
    blocks = {"input_ids": [], "labels": []}
    for begin in range(0, len(stream) - block_size + 1, block_size):
        ids = stream[begin : begin + block_size]
        labels = [IGNORE_INDEX if mask_boundaries and begin + t in starts and t > 0 else stream_labels[begin + t]
                  for t in range(len(ids))]
        blocks["input_ids"].append(ids)
        blocks["labels"].append(labels)
    return blocks


def pad_packed(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batches packed blocks, padding each to the longest: the padding is a document of its own (positions from
    0, no target), so no real token attends to it. No attention_mask: the positions say it all (transformers
    reads packed documents from position_ids only where no attention_mask is given)."""
    length = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": torch.zeros((len(samples), length), dtype=torch.long),
             "position_ids": torch.arange(length).repeat(len(samples), 1),
             "labels": torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["labels"][row, :n] = sample["labels"]
        batch["position_ids"][row, :n] = sample["position_ids"]
        batch["position_ids"][row, n:] = torch.arange(length - n)
    return batch


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions -> (B, T) document numbers: a document starts wherever a position does not follow the one
    before it by 1 (transformers' rule, find_packed_sequence_indices)."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    return starts.cumsum(-1)


def attend_per_document(model: torch.nn.Module, key: str = "data.packing") -> None:
    """data.packing=true (or `key`): a model that reads documents from `position_ids`, or refused naming why. A
    transformers model is also told to build no KV cache in a forward that has position_ids and no cache of its own:
    transformers looks for packed documents only where there is no cache (masking_utils), and by default it makes one
    (config.use_cache) even in training, which needs none. Generation passes its own cache: untouched."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's own
    name = type(base).__name__
    why = None
    if "position_ids" not in inspect.signature(base.forward).parameters:
        why = f"{name}.forward takes no position_ids"
    elif type(base).__module__.startswith("transformers."):
        attention = getattr(base.config, "_attn_implementation", None) or "eager"
        modeling = sys.modules[type(base).__module__]
        masks = any(hasattr(modeling, f) for f in ("create_causal_mask", "create_sliding_window_causal_mask"))
        if not masks and not attention.startswith("flash_attention"):
            why = (f"{name} builds its attention mask without transformers' masking_utils, which is what reads "
                   f"packed documents from position_ids (model.attn_implementation={attention})")
        else:
            base.register_forward_pre_hook(_no_cache_for_packed_documents, with_kwargs=True)
    if why and key != "data.packing":
        raise UsageError(f"{key}=true: {why}, so its packed rows would attend to each other. Use {key}=false (each "
                         "row padded)")
    if why:
        raise UsageError(f"data.packing=true: {why}, so its tokens would attend across documents (or packed "
                         "answers). Use data.packing=false (one document or answer per row, padded), or for "
                         "documents data.packing=cross_document (end to end, attending across, as for pretraining "
                         "on continuous text)")


def _no_cache_for_packed_documents(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    if kwargs.get("position_ids") is not None and kwargs.get("past_key_values") is None:
        return args, {**kwargs, "use_cache": False}
    return None


def packing_summary(blocks: Any, block_size: int, split_long: bool) -> str:
    """What packing did to a tokenized split (its `documents`, `cut` and `tokens` columns), in one line."""
    documents, cut, tokens = (sum(blocks[column]) for column in ("documents", "cut", "tokens"))
    return summary_line(documents, len(blocks), tokens, cut, block_size, split_long)


def summary_line(documents: int, blocks: int, tokens: int, cut: int, block_size: int, split_long: bool) -> str:
    line = (f"{documents} documents in {blocks} blocks of {block_size} tokens "
            f"({100 * (1 - tokens / max(1, blocks * block_size)):.1f}% padding)")
    if cut:
        line += (f"; {cut} longer than {block_size} tokens were "
                 + ("split into documents of at most that length" if split_long else
                    "truncated to it (data.long_documents=split trains their rest as documents of their own)"))
    return line
