"""Prompts for online training (`data=prompts`, for objective=grpo): the model writes the completions itself.

Each line of a JSON Lines file (or each row of anything data=hf_dataset reads: Parquet, CSV, a folder, a hub dataset
such as openai/gsm8k) holds a prompt under `prompt_key` (a string, or a conversation: a list of {role,
content} messages that the tokenizer's chat template renders, ending with its cue for the assistant's turn) and any
other columns, which the reward function receives beside the prompts and completions (TRL's GRPOTrainer passes a
dataset's columns the same way: a GSM8K row's `answer`). A prompt is tokenized as `data=jsonl` tokenizes one
(src/data/jsonl.py: a string with the tokenizer's special tokens, a BOS where it adds one; a rendered conversation
without). A batch is the prompts padded on the right, their lengths, and their numbers (validation prompts after
the training ones), by which the objective finds each prompt's row and seeds its completions:

    {"input_ids": (B, T), "prompt_tokens": (B,), "prompt_index": (B,)}

The bundled sample, data/arithmetic_prompts.jsonl, asks for sums of two small numbers with the answer beside each
(src/objectives/rewards.py's `final_number` reward checks it).
"""

from typing import Annotated, Any, Optional

import torch
from torch.utils.data import Dataset

from src.data.base import DataModule, model_size, readable_file
from src.data.jsonl import _records
from src.data.tokenizer import REVISION, codec_for
from src.errors import UsageError
from src.schema.signature import Arg


def prompt_ids(codec, prompt) -> list[int]:
    """A prompt's token ids as data=jsonl makes a prompted sample's first ones (jsonl.prompted)."""
    if isinstance(prompt, list):  # a conversation: the template's text up to its cue for the assistant's turn
        if codec.chat is None:
            raise UsageError("data: prompts given as messages need a tokenizer with a chat template "
                             "(tokenizer_config.json's chat_template); data.tokenizer names one without")
        return codec.encode(codec.chat(prompt, add_generation_prompt=True), False)
    return codec.encode(prompt, True)


def as_chat(prompt, system_prompt: Optional[str]) -> list:
    """A string prompt as a conversation: the user's message, after the system's where one is given."""
    if isinstance(prompt, list):
        return prompt
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}]


class Prompts(Dataset):
    """Prompts' token ids as samples; `first_index` numbers them (validation prompts follow the training ones)."""

    def __init__(self, ids: list[list[int]], first_index: int = 0):
        self.ids, self.first_index = ids, first_index

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.ids[i], dtype=torch.long),
                "prompt_index": torch.tensor(self.first_index + i)}


def collate_prompts(samples: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    lengths = [len(s["input_ids"]) for s in samples]
    ids = torch.full((len(samples), max(lengths)), pad_id, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, :lengths[row]] = sample["input_ids"]
    return {"input_ids": ids, "prompt_tokens": torch.tensor(lengths),
            "prompt_index": torch.stack([s["prompt_index"] for s in samples])}


class PromptsData(DataModule):
    gives_prompts = True  # checked against the objective before the run starts (objective=grpo)

    def __init__(
        self,
        block_size: Annotated[int, Arg("the model's context: a prompt and its completion together", ge=2)],
        path: Annotated[str, Arg("a JSON Lines file, one prompt per line with the reward's columns beside it; or, "
                                 "through `datasets`, a Parquet / CSV file, a folder, a save_to_disk folder or a hub "
                                 "dataset id (as data=hf_dataset reads them)")] = "data/arithmetic_prompts.jsonl",
        prompt_key: Annotated[str, Arg("the key (column) of each row's prompt: a string or a list of messages")
                              ] = "prompt",
        split: Annotated[str, Arg("through datasets: the split whose prompts train")] = "train",
        val_split: Annotated[Optional[str], Arg("through datasets: a split that validates (null: the last "
                                                "val_fraction of split)")] = None,
        subset: Annotated[Optional[str], Arg("through datasets: the subset of a folder or hub dataset that has "
                                             "several (e.g. gsm8k's main)")] = None,
        chat: Annotated[bool, Arg("a string prompt becomes a user's message, rendered by the tokenizer's chat "
                                  "template (an instruct model's form)")] = False,
        system_prompt: Annotated[Optional[str], Arg("with chat: a system message before each prompt (how the "
                                                    "answer should end, for the reward to read it)")] = None,
        tokenizer: Annotated[Optional[str], Arg("byte, char (vocabulary from the file's strings), a tokenizers JSON "
                                                "file, or a from_pretrained folder or hub id holding one (null: byte)")
                             ] = "byte",
        tokenizer_revision: Annotated[Optional[str], Arg(REVISION)] = None,
        val_fraction: Annotated[float, Arg("the last prompts, as a fraction, validate", gt=0, lt=1)] = 0.1,
        **loader,
    ):
        super().__init__(**loader)
        self.block_size = block_size
        if path.endswith(".jsonl"):  # read here: no `datasets` needed
            file = readable_file(path, "data.path")
            self.source_files = {file.name: file}
            records, n_val, where = list(_records(file)), None, str(file)
        else:
            records, n_val = self._read_with_datasets(path, split, val_split, subset)
            where = f"data.path={path}, row"
        for number, record in records:
            if prompt_key not in record:
                raise UsageError(f"{where}:{number}: no {prompt_key!r} key (data.prompt_key); keys: {sorted(record)}")
        strings = [value for _, record in records for value in record.values() if isinstance(value, str)]
        self.codec = codec_for(tokenizer, strings, revision=tokenizer_revision)
        if system_prompt is not None and not chat:
            raise UsageError("data.system_prompt is a chat message: set data.chat=true (the tokenizer's chat template "
                             "renders it before each prompt)")
        ids = []
        for number, record in records:
            ids.append(prompt_ids(self.codec, as_chat(record[prompt_key], system_prompt) if chat else
                                  record[prompt_key]))
            if not ids[-1]:
                raise UsageError(f"{file}:{number}: the prompt has no token; a completion needs something to follow")
        # What the reward function reads of each prompt, by prompt_index: the prompt as written and its columns.
        self.rows: list[dict[str, Any]] = [{"prompt": record[prompt_key],
                                            **{k: v for k, v in record.items() if k != prompt_key}}
                                           for _, record in records]
        n_val = n_val or max(1, int(len(ids) * val_fraction))
        if len(ids) - n_val < 1:
            raise UsageError(f"data.path={path} has {len(ids)} prompts: too few to train and validate")
        self.train = Prompts(ids[:-n_val])
        self.val = Prompts(ids[-n_val:], first_index=len(ids) - n_val)
        self.collate_fn = collate_prompts

    def _read_with_datasets(self, path: str, split: str, val_split: Optional[str], subset: Optional[str]
                            ) -> tuple[list[tuple[int, dict]], Optional[int]]:
        """(row number, row) of the training split then the validation split, and how many validate (None: the
        last val_fraction of the training split). Prompt sets are small: their rows are read whole."""
        from accelerate import PartialState

        from src.data.hf_dataset import _load, _source_files
        from src.launch.first_per_machine import local_main_first
        from src.models.hub import dataset_path

        with local_main_first():  # a hub id: fetched into the Hugging Face cache by each machine's first process
            source = dataset_path(path, subset, refresh=PartialState().is_local_main_process)
            splits = _load(source, path, split, val_split, subset)
        self.source_files = _source_files(source)
        rows = splits[split].to_list() + (splits[val_split].to_list() if val_split else [])
        return list(enumerate(rows, start=1)), len(splits[val_split]) if val_split else None

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size
