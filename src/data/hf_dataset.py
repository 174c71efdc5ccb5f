"""Documents from a Hugging Face dataset, through `datasets`: Parquet, JSON Lines, CSV or Arrow files, a folder of
them, a folder written by `save_to_disk`, or a dataset on the hub by its id (its data files fetched into the
Hugging Face cache, src/models/hub.py; `data.subset` picks one of several subsets).

    accelerate launch train.py model=hf_causal_lm data=hf_dataset data.path=corpus.parquet objective=causal_lm
    ... data.packing=true                  # whole documents packed into blocks, each attending to itself only

`data.text_column` is tokenized (by bytes, a tokenizers JSON file, or a pretrained model's tokenizer: the default
with `model.pretrained`) with `Dataset.map`, whose cache the next run reuses. The main process of each machine
maps first; the others then read its cache, so no two processes of a machine tokenize at once. Batches are as
`data=jsonl` gives them, Hugging Face's form (labels = input_ids, -100 where nothing is predicted: use
`objective=causal_lm`): each document truncated to `block_size` and padded per batch, or packed
(src/data/packing.py): with `packing=true` whole documents share blocks of `block_size`, each attending to itself
only (the same training as padded, with less padding); with `packing=cross_document` the documents are
concatenated and cut into blocks, attending across (`mask_boundaries`: no label asks a block to predict a
document's first token from the document before it). With `prompt_column`, each document is a prompt and its
completion (instruction tuning, as `data=jsonl`'s `prompt_key`): only the completion is trained on. Validation
is a named split (`val_split`) or the last `val_fraction` of the documents.
"""

import collections
import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import torch
from torch.utils.data import Dataset

from src.data import preference
from src.data.base import DataModule, model_size
from src.data.jsonl import TOKENIZATION_RULE, pad_right, tokenized_documents, warn_untrained
from src.data.packing import cross_document_blocks, packed_documents, packing_summary, pad_packed
from src.data.preference import LongPairsArg, PreferenceFlag, pair_collator
from src.data.tokenizer import REVISION, codec_for
from src.errors import UsageError
from src.launch.first_per_machine import local_main_first
from src.models.hub import dataset_path
from src.schema.signature import Arg

LARGE = 1_000_000  # documents: above, the log points to scripts/prepare_data.py
# File suffixes and the `datasets` builder that reads them.
# A .txt file is one document per line (datasets' text builder; empty lines tokenize to nothing and are skipped).
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow",
            ".txt": "text"}

log = logging.getLogger(__name__)


class Rows(Dataset):
    """A tokenized `datasets.Dataset` as samples {"input_ids", "labels"} of at most block_size tokens, and their
    "position_ids" where documents are packed per document."""

    def __init__(self, rows: Any, block_size: int):
        self.rows, self.block_size = rows.with_format("torch"), block_size
        self.keys = [key for key in ("input_ids", "labels", "position_ids") if key in rows.column_names]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        sample = {key: row[key][: self.block_size].long() for key in self.keys}
        if "labels" not in sample:
            sample["labels"] = sample["input_ids"].clone()
        return sample


class HFDataset(DataModule):
    targets_are_inputs = True

    def __init__(
        self,
        path: Annotated[str, Arg("a Parquet, JSON Lines, CSV, Arrow or text (a line a document) file, a folder of "
                                 "them, a save_to_disk folder, or a Hugging Face hub dataset id")],
        block_size: Annotated[int, Arg("tokens per sample: the longest document, or the packed block", ge=2)],
        text_column: Annotated[str, Arg("the column holding each document's text (with prompt_column: its "
                                        "completion)")] = "text",
        prompt_column: Annotated[Optional[str], Arg(
            "the column holding each document's prompt (instruction tuning): it conditions the text but is not "
            "trained on, its labels -100 (null: documents are trained on whole)")] = None,
        split: Annotated[str, Arg("the split that trains (a file read directly is the split 'train')")] = "train",
        val_split: Annotated[Optional[str], Arg("a split that validates (null: the last val_fraction of "
                                                "split)")] = None,
        subset: Annotated[Optional[str], Arg("the subset (datasets' configuration name, e.g. wikitext-2-raw-v1) of "
                                             "a folder or hub dataset that has several (null: its only or default "
                                             "one)")] = None,
        val_fraction: Annotated[float, Arg("without val_split: the last documents, as a fraction, validate",
                                           gt=0, lt=1)] = 0.1,
        tokenizer: Annotated[Optional[str], Arg("byte, a tokenizers JSON file or a from_pretrained folder or hub "
                                                "id holding one (null: byte)")] = "byte",
        tokenizer_revision: Annotated[Optional[str], Arg(REVISION)] = None,
        packing: Annotated[Union[bool, Literal["cross_document"]], Arg(
            "true: whole documents packed into blocks of block_size, each attending to itself only (trains as "
            "padded documents do, with less padding); cross_document: documents end to end, cut at block edges, "
            "attending across (pretraining on continuous text); false: one document per sample, padded. With "
            "preference: true packs each batch's answers (TRL's padding_free), false pads them")] = False,
        long_documents: Annotated[Literal["truncate", "split"], Arg(
            "with packing=true, a document longer than block_size is truncated to it (as unpacked) or split into "
            "documents of block_size")] = "truncate",
        mask_boundaries: Annotated[bool, Arg("with packing=cross_document: never predict a document's first token "
                                             "from the document before it (label -100)")] = False,
        num_proc: Annotated[Optional[int], Arg(
            "processes that tokenize (null: one per 10,000 documents, up to this machine's CPUs)", ge=1)] = None,
        preference: PreferenceFlag = False,
        long_pairs: LongPairsArg = "truncate",
        **loader,
    ):
        super().__init__(**loader)
        from accelerate import PartialState

        if mask_boundaries and packing != "cross_document":
            raise UsageError(f"data.mask_boundaries=true is for data.packing=cross_document, where documents share "
                             f"blocks across their boundaries (data.packing={str(packing).lower()}: "
                             + ("each document attends to itself only, and its first token is never a target)"
                                if packing is True else "one document per sample)"))
        if long_documents == "split" and packing is not True:
            raise UsageError("data.long_documents=split is for data.packing=true (unpacked documents are truncated "
                             "to block_size; cross_document packing cuts every document at block edges)")
        if preference and packing == "cross_document":
            raise UsageError("data.packing=cross_document is for documents; preference pairs (data.preference=true) "
                             "are padded (data.packing=false) or packed, each answer attending to itself (true)")
        self.attends_per_document = packing is True  # the model must read documents from position_ids
        self.codec = codec_for(tokenizer, revision=tokenizer_revision)
        # One process per machine loads (datasets converts files to Arrow) and maps, on num_proc processes,
        # writing the caches; the others wait for it as long as it takes, then read them.
        with local_main_first():
            # A hub id: its data files, fetched into the Hugging Face cache by this machine's first process.
            source = dataset_path(path, subset, refresh=PartialState().is_local_main_process)
            train, val = self._documents(source, path, split, val_split, val_fraction,
                                         None if preference else text_column, subset, prompt_column)
            if len(train) > LARGE and PartialState().is_local_main_process:
                log.info("data.path=%s: %d documents, tokenized by this run's first process on each machine (and "
                         "cached for the next runs); a corpus of this size is better tokenized once, on many "
                         "processes or nodes: python scripts/prepare_data.py %s OUT, then data=shards "
                         "data.path=OUT", path, len(train), path)
            workers = num_proc or min(len(os.sched_getaffinity(0)), 1 + len(train) // 10_000)
            if preference:
                self._read_pairs(train, val, path, block_size, long_pairs, workers)
                self.collate_fn = pair_collator(packing, block_size)
                self.source_files = _source_files(source)
                return
            train, val = (self._tokenized(d, text_column, prompt_column, block_size, packing, mask_boundaries,
                                          long_documents == "split", workers) for d in (train, val))
        if prompt_column and not packing:  # a sample of the data says enough, at a bounded cost
            warn_untrained(train.select(range(min(len(train), 10_000)))["labels"], block_size, f"data.path={path}")
        if len(train) == 0 or len(val) == 0:
            raise UsageError(f"data.path={path}: no {'block' if packing else 'document'} to "
                             f"{'train' if len(train) == 0 else 'validate'} on (data.block_size={block_size})")
        if packing is True and PartialState().is_main_process:
            for name, split_blocks in (("training", train), ("validation", val)):
                log.info("data.packing=true, %s: %s", name,
                         packing_summary(split_blocks, block_size, long_documents == "split"))
        self.train, self.val = Rows(train, block_size), Rows(val, block_size)
        self.source_files = _source_files(source)
        self.collate_fn = {True: pad_packed, "cross_document": None}.get(packing, functools.partial(pad_right,
                                                                                                     pad_id=0))

    @staticmethod
    def _documents(source: Path, path: str, split: str, val_split: Optional[str], val_fraction: float,
                   text_column: str, subset: Optional[str], prompt_column: Optional[str]):
        splits = _load(source, path, split, val_split, subset)
        train = splits[split]
        for key, column in (("data.text_column", text_column), ("data.prompt_column", prompt_column)):
            if column is not None and column not in train.column_names:
                raise UsageError(f"{key}={column}: {path} has no such column; its columns: "
                                 f"{', '.join(train.column_names)}")
        if val_split is not None:
            return train, splits[val_split]
        n_val = max(1, int(len(train) * val_fraction))
        if len(train) - n_val < 1:
            raise UsageError(f"data.path={path}: {len(train)} documents are too few to train and validate")
        return train.select(range(len(train) - n_val)), train.select(range(len(train) - n_val, len(train)))

    def _tokenized(self, documents: Any, text_column: str, prompt_column: Optional[str], block_size: int,
                   packing: Union[bool, str], mask_boundaries: bool, split_long: bool, num_proc: int) -> Any:
        codec = self.codec

        def identity(*settings) -> str:
            # A map's cache key: the documents' own fingerprint (datasets keeps it as _fingerprint) and every
            # setting, stated rather than left to datasets' hashing of the closure (a tokenizer inside).
            hasher = hashlib.blake2b(digest_size=8)
            for part in (TOKENIZATION_RULE, documents._fingerprint, text_column, prompt_column, codec.kind,
                         codec.end_of_text, codec.chat.source if codec.chat else "",
                         codec.tokenizer.to_str() if codec.tokenizer else "", *settings):
                hasher.update(str(part).encode())
            return hasher.hexdigest()

        def tokenize(batch: dict) -> dict:
            # Row by row (a row that tokenizes to nothing stays, empty), so that num_proc's slices of the rows
            # change nothing: the batches packed below are the same whatever the number of processes.
            rows = [tokenized_documents(codec, [text], None if prompt_column is None else [prompt])
                    for text, prompt in zip(batch[text_column], batch[prompt_column] if prompt_column
                                            else batch[text_column])]
            out = {"input_ids": [ids[0] if ids else [] for ids, _ in rows]}
            if rows and rows[0][1] is not None or prompt_column or packing:
                out["labels"] = [(labels or ids or [[]])[0] for ids, labels in rows]
            return out

        tokenized = documents.map(tokenize, batched=True, remove_columns=documents.column_names,
                                  new_fingerprint=identity(bool(packing)), desc="tokenizing",
                                  num_proc=min(num_proc, len(documents)) if num_proc > 1 else None)

        def pack(batch: dict) -> dict:
            kept = [i for i, ids in enumerate(batch["input_ids"]) if ids]  # a sample needs a token
            ids = [batch["input_ids"][i] for i in kept]
            labels = [batch["labels"][i] for i in kept] if "labels" in batch else None
            if packing is True:
                return packed_documents(ids, labels, block_size, split_long)
            if packing == "cross_document":
                return cross_document_blocks(ids, labels, block_size, mask_boundaries)
            return {"input_ids": ids} if labels is None else {"input_ids": ids, "labels": labels}

        return tokenized.map(pack, batched=True, remove_columns=tokenized.column_names,
                             new_fingerprint=identity(block_size, packing, mask_boundaries, split_long),
                             desc="packing" if packing else "dropping empty documents")

    def _read_pairs(self, train: Any, val: Any, path: str, block_size: int, long_pairs: str, num_proc: int) -> None:
        """Preference pairs tokenized by TRL's rule (src/data/preference.py) with Dataset.map, cached as documents
        are; pairs too long are truncated or dropped, and the log counts them."""
        from accelerate import PartialState

        preference.missing_columns(train.column_names, f"data.path={path}")
        codec, splits = self.codec, []
        for name, documents in (("training", train), ("validation", val)):
            def tokenize(batch: dict) -> dict:
                out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "fate": []}
                for i in range(len(batch["chosen"])):  # row by row: each row's fate, whatever num_proc's slices
                    row = {key: [batch[key][i]] for key in ("prompt", *preference.COLUMNS) if key in batch}
                    pairs, counts = preference.tokenized_pairs(codec, row, block_size, long_pairs)
                    out["fate"].append(next((fate for fate, n in counts.items() if n), "kept"))
                    for key in pairs:
                        out[key].append(pairs[key][0] if pairs[key] else [])
                return out

            hasher = hashlib.blake2b(digest_size=8)
            for part in (preference.PAIR_RULE, documents._fingerprint, codec.identity(), codec.end_of_text,
                         codec.chat.source if codec.chat else "", block_size, long_pairs):
                hasher.update(str(part).encode())
            tokenized = documents.map(tokenize, batched=True, remove_columns=documents.column_names,
                                      new_fingerprint=hasher.hexdigest(), desc="tokenizing pairs",
                                      num_proc=min(num_proc, len(documents)) if num_proc > 1 else None)
            fates = collections.Counter(tokenized["fate"])
            kept = tokenized.filter(lambda fate: fate in ("kept", "truncated"), input_columns="fate",
                                    new_fingerprint=hasher.hexdigest() + "-kept")
            if PartialState().is_main_process:
                preference.report(fates, len(kept), block_size, f"data.path={path}, {name}")
            if len(kept) == 0:
                raise UsageError(f"data.path={path}: no {name} preference pair (data.block_size={block_size}, "
                                 f"data.long_pairs={long_pairs})")
            splits.append(kept)
        self.train = preference.Pairs(splits[0])
        self.val = preference.Pairs(splits[1], first_index=len(splits[0]))

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size


def _source_files(source: Path) -> dict[str, Path]:
    """The files data.path names, by their path inside it; not the map caches datasets writes into a
    save_to_disk folder (cache-*.arrow), which a run adds to."""
    if source.is_file():
        return {source.name: source}
    return {str(file.relative_to(source)): file for file in sorted(source.rglob("*"))
            if file.is_file() and not file.name.startswith(("cache-", "."))}


# What data=hf_dataset calls what _load reads; scripts/prepare_data.py names them by its own arguments.
DATA_KEYS = {"path": "data.path", "subset": "data.subset", "split": "data.split", "val_split": "data.val_split"}


def _load(source: Path, path: str, split: str, val_split: Optional[str], subset: Optional[str],
          keys: dict[str, str] = DATA_KEYS) -> dict[str, Any]:
    """The splits asked for of what data.path names (`source`: where it is on this machine), as datasets.Dataset
    objects, or an error naming data.path / data.split / data.subset (`keys`: what the caller calls them)."""
    try:
        from datasets import DatasetDict, get_dataset_config_names, load_dataset, load_from_disk
    except ImportError as error:
        raise UsageError("data=hf_dataset needs datasets: pip install -r requirements-extras.txt") from error
    if not source.exists():
        raise FileNotFoundError(f"{keys['path']}={path!r}: no such file or folder (relative paths are relative to "
                                f"{Path.cwd()})")
    saved = source.is_dir() and any((source / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
    if subset is not None and (saved or source.is_file()):
        raise UsageError(f"{keys['subset']}={subset}: {path} is {'a save_to_disk folder' if saved else 'one file'}, "
                         "which has no subsets (they are a folder's or a hub dataset's, named in its README.md)")
    if saved:
        loaded = load_from_disk(str(source))
        if not isinstance(loaded, DatasetDict):
            loaded = DatasetDict({"train": loaded})
    elif source.is_file():
        if source.suffix not in BUILDERS:
            raise UsageError(f"{keys['path']}={path}: a {source.suffix or 'suffix-less'} file; data=hf_dataset reads "
                             f"{', '.join(BUILDERS)} files or a save_to_disk folder")
        loaded = load_dataset(BUILDERS[source.suffix], data_files={"train": str(source)})
    else:
        try:
            loaded = load_dataset(str(source), subset)
        except ValueError as error:  # datasets' words for a subset missing or unknown
            subsets = ", ".join(get_dataset_config_names(str(source)))
            if subset is None and "Config name is missing" in str(error):
                raise UsageError(f"{keys['subset']}: {path} has several subsets ({subsets}): pick one with "
                                 f"{keys['subset']}=NAME") from None
            if subset is not None and "not found" in str(error):
                raise UsageError(f"{keys['subset']}={subset}: {path} has the subsets {subsets}") from None
            raise
    wanted = [split] + ([val_split] if val_split else [])
    missing = [name for name in wanted if name not in loaded]
    if missing:
        key = keys["split"] if missing[0] == split else keys["val_split"]
        raise UsageError(f"{key}={missing[0]}: {path} has the splits {', '.join(loaded)}")
    return {name: loaded[name] for name in wanted}
