"""Documents from a JSON Lines file, one per sample, in Hugging Face's batch form: the variable-length case.

Each line is an object whose `text_key` holds a document. It is tokenized by bytes, by characters (the
vocabulary is the file's sorted character set) or by a `tokenizers` JSON file, `from_pretrained` folder or hub
id (with `model.pretrained`, that model's tokenizer by default), truncated to
`block_size` tokens, and padded per batch on the right:

    {"input_ids": (B, T), "attention_mask": (B, T), "labels": (B, T)}   labels = input_ids, -100 on padding

Labels are aligned with the inputs (Hugging Face's convention): use `objective=causal_lm`, which shifts them.
With `prompt_key` each line is a prompt and its completion (instruction tuning): the sample is the prompt's
tokens then the completion's, ended by the tokenizer's end-of-text token where it has one, and only the
completion is trained on (the prompt's labels are -100: it conditions, it is not learned). Prompt and completion
may be conversations (lists of {role, content} messages), which the tokenizer's chat template renders.
The bundled sample, data/shakespeare_speeches.jsonl, has one speech of tiny Shakespeare per line.
"""

import functools
import json
import logging
from typing import Annotated, Iterator, Optional

import torch
from torch.utils.data import Dataset

from src.data import preference
from src.data.base import IGNORE_INDEX, DataModule, model_size, readable_file
from src.data.preference import LongPairs, LongPairsArg, PreferenceFlag
from src.data.tokenizer import REVISION, codec_for
from src.errors import UsageError
from src.schema.signature import Arg

# How documents become samples (tokenized_documents); part of data=hf_dataset's cache key, so a change of the rule
# never reuses samples an earlier rule made.
TOKENIZATION_RULE = "2: prompt and completion tokenized together (TRL); documents without tokens skipped"

log = logging.getLogger(__name__)


class Documents(Dataset):
    """Token ids per document, truncated to block_size; labels the ids themselves unless given (prompted)."""

    def __init__(self, documents: list[list[int]], block_size: int, labels: Optional[list[list[int]]] = None):
        self.documents, self.block_size, self.labels = documents, block_size, labels

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.documents[i][: self.block_size], dtype=torch.long)
        labels = ids.clone() if self.labels is None else torch.tensor(self.labels[i][: self.block_size])
        return {"input_ids": ids, "labels": labels}


def prompted(codec, prompt, completion) -> tuple[list[int], list[int]]:
    """A prompt and its completion as one sample's ids and labels, by TRL's rule (SFTTrainer's prompt-completion
    data): the two tokenized together as one text, its first tokens, as many as the prompt alone tokenizes to,
    labelled -100 (the prompt conditions the completion and is not trained on), and the tokenizer's end-of-text token
    appended where it has one and the text does not end with it, so that the model learns where an answer stops. A
    tokenizer that starts a text with a BOS token starts the sample with one, the prompt's. Lists of messages
    ({role, content}, a conversation) are rendered by the tokenizer's chat template instead, which writes its own
    BOS and turn ends: its text is tokenized without the tokenizer's special tokens, by the same rule."""
    end, special = codec.end_of_text, True
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt, completion = chat_texts(codec, list(prompt or []), list(completion))
        end, special = None, False
    ids = codec.encode(prompt + completion, special)
    if end is not None and ids[-1:] != [end]:
        ids.append(end)
    masked = min(len(codec.encode(prompt, special)), len(ids))
    return ids, [IGNORE_INDEX] * masked + ids[masked:]


def tokenized_documents(codec, texts: list, prompts: Optional[list] = None) -> tuple[list, Optional[list]]:
    """Documents as token ids and labels (None: the ids themselves), by the one rule every option that reads
    documents follows: a prompt and its completion by `prompted` (a row whose completion has no token is skipped),
    conversations by `conversation`, plain text by the codec; a document that tokenizes to no token is skipped,
    since a sample needs one (a packed block would otherwise fail when it is drawn)."""
    if prompts is not None:  # a completion must have a token of its own; the prompt may be empty
        samples = [prompted(codec, prompt if prompt is not None else "", text) for prompt, text in zip(prompts, texts)
                   if text]
        samples = [(ids, labels) for ids, labels in samples if labels and labels[-1] != IGNORE_INDEX]
    elif any(isinstance(text, list) for text in texts):  # the loss on the assistant's turns
        samples = [conversation(codec, text) for text in texts if text]
    else:
        return [ids for ids in codec.encode_batch(texts) if ids], None
    samples = [(ids, labels) for ids, labels in samples if ids]
    return [ids for ids, _ in samples], [labels for _, labels in samples]


def conversation(codec, messages: list) -> tuple[list[int], list[int]]:
    """A whole conversation (a list of {role, content} messages) as one sample, rendered by the tokenizer's chat
    template, trained on every assistant turn and nothing else (TRL's assistant_only_loss): the other tokens'
    labels are -100."""
    if codec.chat is None:
        raise UsageError("data: a document given as a list of messages needs a tokenizer with a chat template "
                         "(tokenizer_config.json's chat_template); data.tokenizer names one without")
    ids, assistant = codec.chat.assistant_tokens(messages)
    return ids, [i if mine else IGNORE_INDEX for i, mine in zip(ids, assistant)]


def chat_texts(codec, prompt: list, completion: list) -> tuple[str, str]:
    """The conversation as the chat template renders it, cut where the completion starts: the prompt's text ends
    with the template's cue for the assistant's turn (add_generation_prompt), as it will at inference."""
    if codec.chat is None:
        raise UsageError("data: prompts and completions given as messages need a tokenizer with a chat template "
                         "(tokenizer_config.json's chat_template); data.tokenizer names one without")
    before, whole = codec.chat(prompt, add_generation_prompt=True), codec.chat(prompt + completion)
    if not whole.startswith(before):
        raise UsageError("data: the chat template renders the prompt differently alone and followed by its "
                         f"completion ({before[-40:]!r} is not where {whole[:len(before) + 20]!r} starts), so the "
                         "completion's tokens cannot be told from the prompt's")
    return before, whole[len(before):]


def warn_untrained(labels: list[list[int]], block_size: int, source: str) -> None:
    """Prompted samples whose prompt fills the whole block train nothing: say how many, once."""
    untrained = sum(all(label == IGNORE_INDEX for label in sample[1:block_size]) for sample in labels)
    if untrained:
        log.warning("%s: %d of the first %d samples have no completion token within data.block_size=%d, so they "
                    "train nothing (a longer block, or shorter prompts)", source, untrained, len(labels), block_size)


def pad_right(samples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pads a batch to its longest sample; padding is masked out of attention and of the loss."""
    length = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": torch.full((len(samples), length), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(samples), length), dtype=torch.long),
             "labels": torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["attention_mask"][row, :n] = 1
        batch["labels"][row, :n] = sample["labels"]
    return batch


class JsonlData(DataModule):
    targets_are_inputs = True

    def __init__(
        self,
        block_size: Annotated[int, Arg("longest document in tokens (longer ones are truncated)", ge=2)],
        path: Annotated[str, Arg("JSON Lines file, one document per line")] = "data/shakespeare_speeches.jsonl",
        text_key: Annotated[str, Arg("the key of each line's document (with prompt_key: its completion)")] = "text",
        prompt_key: Annotated[Optional[str], Arg(
            "the key of each line's prompt (instruction tuning): it conditions the text under text_key but is not "
            "trained on, its labels -100 (null: each line is one document, trained on whole)")] = None,
        tokenizer: Annotated[Optional[str], Arg("byte, char (vocabulary from the file), a tokenizers JSON file, "
                                                "or a from_pretrained folder or hub id holding one (null: byte)")
                                            ] = "byte",
        tokenizer_revision: Annotated[Optional[str], Arg(REVISION)] = None,
        val_fraction: Annotated[float, Arg("the last documents, as a fraction, validate", gt=0, lt=1)] = 0.1,
        preference: PreferenceFlag = False,
        long_pairs: LongPairsArg = "truncate",
        packing: Annotated[bool, Arg("with preference: each batch's answers packed, each attending to itself only "
                                     "(TRL's padding_free: trains as padded, with little padding computed)")] = False,
        **loader,
    ):
        super().__init__(**loader)
        file = readable_file(path, "data.path")
        self.source_files = {file.name: file}
        if preference:
            self._read_pairs(file, block_size, tokenizer, tokenizer_revision, val_fraction, long_pairs, packing)
            return
        if packing:
            raise UsageError("data=jsonl packs preference pairs only (data.preference=true); documents are packed by "
                             f"data=hf_dataset data.path={path} data.packing=true")
        texts, prompts = [], []
        for number, record in _records(file):
            for key, name in ((text_key, "data.text_key"), (prompt_key, "data.prompt_key")):
                if key is not None and key not in record:
                    raise ValueError(f"{file}:{number}: no {key!r} key ({name}); keys: {sorted(record)}")
            texts.append(record[text_key])
            prompts.append(record[prompt_key] if prompt_key else None)
        # Padding is id 0 (pad_right); a character vocabulary is that of the strings (messages need a tokenizer).
        self.codec = codec_for(tokenizer, [t for t in texts + prompts if isinstance(t, str)],
                               revision=tokenizer_revision)
        documents, labels = tokenized_documents(self.codec, texts, prompts if prompt_key else None)
        if labels is not None:
            warn_untrained(labels, block_size, str(file))
        n_val = max(1, int(len(documents) * val_fraction))
        if len(documents) - n_val < 1:
            raise ValueError(f"{file} has {len(documents)} non-empty documents: too few to train and validate")
        self.train = Documents(documents[:-n_val], block_size, labels and labels[:-n_val])
        self.val = Documents(documents[-n_val:], block_size, labels and labels[-n_val:])
        self.collate_fn = functools.partial(pad_right, pad_id=0)

    def _read_pairs(self, file, block_size: int, tokenizer: Optional[str], revision: Optional[str],
                    val_fraction: float, long_pairs: LongPairs, packing: bool) -> None:
        rows = list(_records(file))
        for number, record in rows:
            preference.missing_columns(record, f"{file}:{number}")
        columns = {key: [record.get(key) for _, record in rows] for key in ("prompt", *preference.COLUMNS)}
        if all(prompt is None for prompt in columns["prompt"]):
            del columns["prompt"]
        self.codec = codec_for(tokenizer, [t for ts in columns.values() for t in ts if isinstance(t, str)],
                               revision=revision)
        pairs, counts = preference.tokenized_pairs(self.codec, columns, block_size, long_pairs)
        preference.report(counts, len(pairs["chosen_ids"]), block_size, str(file))
        n = len(pairs["chosen_ids"])
        n_val = max(1, int(n * val_fraction))
        if n - n_val < 1:
            raise ValueError(f"{file} has {n} preference pairs: too few to train and validate")
        split = {key: (ids[:-n_val], ids[-n_val:]) for key, ids in pairs.items()}
        self.train = preference.Pairs({key: ids[0] for key, ids in split.items()})
        self.val = preference.Pairs({key: ids[1] for key, ids in split.items()}, first_index=n - n_val)
        self.collate_fn = preference.pair_collator(packing, block_size)
        self.attends_per_document = packing  # packed answers: the model reads them from position_ids

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size


def _records(file) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line."""
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{file}:{number}: not a JSON object ({error.msg}, column {error.colno})") from None
