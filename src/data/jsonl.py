"""Documents from a JSON Lines file, one per sample, in Hugging Face's batch form: the variable-length case.

Each line is an object whose `text_key` holds a document. It is tokenized by bytes, by characters (the
vocabulary is the file's sorted character set) or by a `tokenizers` JSON file, `from_pretrained` folder or hub
id (with `model.pretrained`, that model's tokenizer by default), truncated to
`block_size` tokens, and padded per batch on the right:

    {"input_ids": (B, T), "attention_mask": (B, T), "labels": (B, T)}   labels = input_ids, -100 on padding

Labels are aligned with the inputs (Hugging Face's convention): use `objective=causal_lm`, which shifts them.
The bundled sample, data/shakespeare_speeches.jsonl, has one speech of tiny Shakespeare per line.
"""

import functools
import json
from typing import Annotated, Optional

import torch
from torch.utils.data import Dataset

from src.data.base import DataModule, model_size, readable_file
from src.data.tokenizer import codec_for
from src.schema.signature import Arg

IGNORE_INDEX = -100  # the label the objectives skip (torch's and transformers' convention)


class Documents(Dataset):
    def __init__(self, documents: list[list[int]], block_size: int):
        self.documents, self.block_size = documents, block_size

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.documents[i][: self.block_size], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


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
        text_key: Annotated[str, Arg("the key of each line's document")] = "text",
        tokenizer: Annotated[Optional[str], Arg("byte, char (vocabulary from the file), a tokenizers JSON file, "
                                                "or a from_pretrained folder or hub id holding one (null: byte)")
                                            ] = "byte",
        val_fraction: Annotated[float, Arg("the last documents, as a fraction, validate", gt=0, lt=1)] = 0.1,
        **loader,
    ):
        super().__init__(**loader)
        file = readable_file(path, "data.path")
        self.source_files = {file.name: file}
        texts = []
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{file}:{number}: not a JSON object ({error.msg}, "
                                     f"column {error.colno})") from None
                if text_key not in record:
                    raise ValueError(f"{file}:{number}: no {text_key!r} key (data.text_key); keys: {sorted(record)}")
                texts.append(record[text_key])
        self.codec = codec_for(tokenizer, texts)  # padding is id 0 (pad_right), masked wherever it appears
        documents = [ids for ids in map(self.codec.encode, texts) if ids]
        n_val = max(1, int(len(documents) * val_fraction))
        if len(documents) - n_val < 1:
            raise ValueError(f"{file} has {len(documents)} non-empty documents: too few to train and validate")
        self.train = Documents(documents[:-n_val], block_size)
        self.val = Documents(documents[-n_val:], block_size)
        self.collate_fn = functools.partial(pad_right, pad_id=0)

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size
