"""Preference pairs: a prompt, a chosen and a rejected answer, in TRL's formats, as samples and batches for the
preference objectives (src/objectives/preference.py).

A row holds `chosen` and `rejected`, either strings or conversations (lists of {role, content} messages), and
`prompt` (of the same kind), or no prompt: then the prompt is the shared start of `chosen` and `rejected` (TRL's
extract_prompt: the messages they share, or the characters). Each pair is tokenized as TRL's DPOTrainer does:
the prompt alone, and the prompt with each answer as one text (a string ending in the tokenizer's end-of-text
token where it has one; a conversation rendered by the chat template); each answer is what follows the tokens the
prompt shares with both. A pair longer than `block_size` (its prompt and its longer answer) is truncated, the
prompt first (it keeps its last tokens, at least one), then the answers (they keep their first tokens), or
dropped (`long_pairs`); the log counts them.

A batch of B pairs is TRL's concatenated form, so that both answers go through the model in one forward pass:

    {"input_ids": (2B, T), "attention_mask": (2B, T), "labels": (2B, T), "pair_index": (B,)}

the B chosen rows first, then the B rejected rows in the same order; labels are the answer's tokens (-100 on the
prompt and the padding; shifted by the objective). `pair_index` names each pair (validation pairs after the
training ones), which is how reference log-probabilities computed before training find their pair.

Packed (`data.packing=true`, TRL's padding_free): the 2B rows go through the model packed, best fit, into rows of
at most block_size tokens, each attending to itself only (`position_ids` restarting at 0, as packed documents);
the labels keep the padded layout above, and `packed_at` says where each of their tokens sits in the packed
input, so the objective reads every answer's log-probabilities back into that layout (src/objectives/
preference.py). The model computes little padding, and a padded batch and a packed one train the same:

    {"input_ids": (R, T), "position_ids": (R, T), "labels": (2B, T), "packed_at": (2B, T), "pair_index": (B,)}
"""

import functools
import logging
from typing import Annotated, Literal, Optional

import torch
from torch.utils.data import Dataset

from src.data.base import IGNORE_INDEX
from src.data.packing import best_fit
from src.errors import UsageError
from src.schema.signature import Arg

log = logging.getLogger(__name__)

COLUMNS = ("chosen", "rejected")  # and `prompt`, unless it is implicit
# How pairs become samples; part of data=hf_dataset's cache key, so a change of the rule never reuses old samples.
PAIR_RULE = "1: TRL's DPOTrainer (prompt and answer tokenized together, the answer after the shared prefix)"
LongPairs = Literal["truncate", "drop"]
# The keys data=jsonl and data=hf_dataset share (data=mixture passes them on to every source).
PreferenceFlag = Annotated[bool, Arg(
    "each row is a preference pair in TRL's format: chosen, rejected and prompt (or a prompt implicit in their "
    "shared start), strings or conversations, for objective=dpo/simpo/orpo (src/data/preference.py)")]
LongPairsArg = Annotated[LongPairs, Arg("with preference: a pair longer than block_size is truncated (the prompt "
                                        "first) or dropped")]


def missing_columns(columns, where: str) -> None:
    """Refuses rows without the columns a pair needs, naming them."""
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise UsageError(f"{where}: preference pairs (data.preference=true) need the columns {', '.join(COLUMNS)} "
                         f"(and prompt, or a prompt shared by both); missing {', '.join(missing)}; found "
                         f"{', '.join(sorted(columns)) or 'none'}")


def implicit_prompt(chosen, rejected) -> tuple:
    """TRL's extract_prompt: the longest shared start of `chosen` and `rejected` (messages, or characters, a space
    before the difference going to the answers) as the prompt, and what follows it in each."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def tokenized_pair(codec, prompt, chosen, rejected) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) by TRL's rule (DPOTrainer's tokenize_fn)."""
    if prompt is None:
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
    if isinstance(chosen, list):
        if codec.chat is None:
            raise UsageError("data: preference pairs given as messages need a tokenizer with a chat template "
                             "(tokenizer_config.json's chat_template); data.tokenizer names one without")
        prompt = list(prompt or [])
        texts = [codec.chat(prompt, add_generation_prompt=True), codec.chat(prompt + list(chosen)),
                 codec.chat(prompt + list(rejected))]
        prompt_ids, with_chosen, with_rejected = (codec.encode(text, False) for text in texts)
    else:
        end = codec.end_of_text
        prompt_ids = codec.encode(prompt or "")
        with_chosen, with_rejected = codec.encode((prompt or "") + chosen), codec.encode((prompt or "") + rejected)
        for ids in (with_chosen, with_rejected):
            if end is not None and ids[-1:] != [end]:
                ids.append(end)
    # The answers start where the prompt alone stops agreeing with the prompt followed by them (a template may
    # render the prompt differently alone; tokens may merge across the boundary).
    shared = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return prompt_ids[:shared], with_chosen[shared:], with_rejected[shared:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fitted(pair: tuple[list[int], list[int], list[int]], block_size: int, long_pairs: LongPairs
           ) -> Optional[tuple[list[int], list[int], list[int]]]:
    """The pair within block_size tokens (its prompt and its longer answer), or None where it is dropped."""
    prompt, chosen, rejected = pair
    if len(prompt) + max(len(chosen), len(rejected)) <= block_size:
        return pair
    if long_pairs == "drop":
        return None
    kept = min(len(prompt), max(block_size - max(len(chosen), len(rejected)), 1))
    prompt = prompt[len(prompt) - kept:]
    room = block_size - len(prompt)
    return prompt, chosen[:room], rejected[:room]


def tokenized_pairs(codec, rows: dict, block_size: int, long_pairs: LongPairs) -> tuple[dict, dict]:
    """Columns prompt_ids / chosen_ids / rejected_ids of the rows' pairs, and how many were truncated and dropped
    (a pair whose answers have no token is dropped too: it has nothing to compare)."""
    out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    counts = {"truncated": 0, "dropped": 0, "empty": 0}
    prompts = rows.get("prompt") or [None] * len(rows["chosen"])
    for prompt, chosen, rejected in zip(prompts, rows["chosen"], rows["rejected"]):
        pair = tokenized_pair(codec, prompt, chosen, rejected)
        if not pair[1] or not pair[2]:
            counts["empty"] += 1
            continue
        kept = fitted(pair, block_size, long_pairs)
        if kept is None:
            counts["dropped"] += 1
            continue
        counts["truncated"] += kept is not pair
        for key, ids in zip(out, kept):
            out[key].append(ids)
    return out, counts


def report(counts: dict, pairs: int, block_size: int, where: str) -> None:
    said = []
    if counts.get("truncated"):
        said.append(f"{counts['truncated']} truncated to data.block_size={block_size} (the prompt first)")
    if counts.get("dropped"):
        said.append(f"{counts['dropped']} longer than data.block_size={block_size} dropped (data.long_pairs=drop)")
    if counts.get("empty"):
        said.append(f"{counts['empty']} without an answer token dropped")
    if said:
        log.warning("%s: %d preference pairs kept; %s", where, pairs, "; ".join(said))


class Pairs(Dataset):
    """Tokenized pairs (lists, or a `datasets.Dataset` with those columns) as samples; `first_index` numbers them
    (validation pairs follow the training ones)."""

    def __init__(self, columns, first_index: int = 0):
        self.columns, self.first_index = columns, first_index

    def __len__(self) -> int:
        return len(self.columns["chosen_ids"]) if isinstance(self.columns, dict) else len(self.columns)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.columns[i] if not isinstance(self.columns, dict) else {k: v[i] for k, v in self.columns.items()}
        return pair_sample(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"], self.first_index + i)


def pair_sample(prompt, chosen, rejected, index: int) -> dict[str, torch.Tensor]:
    """A pair's ids as a sample that collate_pairs batches; `index` numbers it."""
    return {"prompt_ids": torch.as_tensor(prompt, dtype=torch.long),
            "chosen_ids": torch.as_tensor(chosen, dtype=torch.long),
            "rejected_ids": torch.as_tensor(rejected, dtype=torch.long),
            "pair_index": torch.tensor(index)}


def collate_pairs(samples: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """B pairs as 2B rows, chosen then rejected, padded on the right (TRL's DataCollatorForPreference)."""
    rows = [(s["prompt_ids"], s[answer]) for answer in ("chosen_ids", "rejected_ids") for s in samples]
    length = max(len(prompt) + len(answer) for prompt, answer in rows)
    batch = {"input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(rows), length), dtype=torch.long),
             "labels": torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)}
    for row, (prompt, answer) in enumerate(rows):
        p, n = len(prompt), len(prompt) + len(answer)
        batch["input_ids"][row, :p], batch["input_ids"][row, p:n] = prompt, answer
        batch["attention_mask"][row, :n] = 1
        batch["labels"][row, p:n] = answer
    batch["pair_index"] = torch.stack([s["pair_index"] for s in samples])
    return batch


def pair_collator(packing, block_size: int):
    """The batches of pairs data.packing asks for: packed (true) or padded."""
    return functools.partial(pack_pairs, block_size=block_size) if packing is True else collate_pairs


def pack_pairs(samples: list[dict[str, torch.Tensor]], block_size: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """collate_pairs' batch with its 2B rows packed into rows of at most block_size tokens (narrowest_packing; a
    row shorter than the widest ends in padding, a row of its own, positions from 0, no target), and `packed_at`:
    each padded position's place in the flattened packed input (padding points at 0, never read: its labels are
    -100)."""
    padded = collate_pairs(samples, pad_id)
    lengths = padded.pop("attention_mask").sum(-1).tolist()
    packed = packed_rows(padded["input_ids"], lengths, block_size, pad_id)
    return {**packed, "labels": padded["labels"], "pair_index": padded["pair_index"]}


def packed_rows(ids: torch.Tensor, lengths: list[int], block_size: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows (R, T) of these lengths packed into as few rows of at most block_size tokens as
    narrowest_packing finds: input_ids and position_ids (restarting at each row's first token, so that each
    attends to itself only), and `packed_at`, each padded position's place in the flattened packed input (a pad
    points at 0, never read: nothing is counted there). A row of length 0 is left out (all of it points at 0). On
    the host."""
    kept = [row for row, n in enumerate(lengths) if n]
    rows, width = narrowest_packing([lengths[row] for row in kept], block_size)
    rows = [[kept[i] for i in row] for row in rows]
    packed = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
              "position_ids": torch.arange(width).repeat(len(rows), 1)}
    packed_at = torch.zeros_like(ids)
    for row, answers in enumerate(rows):
        start = 0
        for answer in answers:
            n = lengths[answer]
            packed["input_ids"][row, start : start + n] = ids[answer, :n]
            packed["position_ids"][row, start : start + n] = torch.arange(n)
            packed_at[answer, :n] = torch.arange(row * width + start, row * width + start + n)
            start += n
        packed["position_ids"][row, start:] = torch.arange(width - start)
    return {**packed, "packed_at": packed_at}


def narrowest_packing(lengths: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Rows of these lengths packed best fit into as few tokens as it finds (rows times the widest row's fill, the
    narrower at a tie): tried at each width that would hold them in r rows split evenly, r = 1 .. all of them, up to
    block_size. r = all is the longest row alone: the padded layout or better, so packing never computes more
    than padding does. (Best fit at block_size alone leaves a ragged last row: scripts/BENCHMARKS.md.)"""
    longest, total = max(lengths), sum(lengths)
    widths = sorted({min(max(block_size, longest), max(longest, -(-total // r))) for r in range(1, len(lengths) + 1)})
    best = None
    for capacity in widths:
        rows = best_fit(lengths, capacity)
        width = max(sum(lengths[i] for i in row) for row in rows)
        if best is None or (len(rows) * width, width) < (len(best[0]) * best[1], best[1]):
            best = rows, width
    return best
