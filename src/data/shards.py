"""Token shards: a corpus tokenized once (scripts/prepare_data.py, on many processes) and read memory-mapped, so
that a run's start-up and memory do not grow with the corpus.

A prepared folder holds datatrove's token files (the format its DocumentTokenizer writes and nanotron reads), per
preparation task and split: `{split}_{task:05d}.ds`, the token ids end to end (uint16, or uint32 for a vocabulary
above 65,536), `.ds.index`, each document's end (uint64), and for data with label masks (prompt/completion,
chats) `.ds.loss`, one byte per token, 1 where the token is a target. `manifest.json` names them with their tokens,
documents and digests, the tokenizer and the source; `tokenizer.json` (or `vocabulary.json`) is the tokenizer, so
that a run decodes, samples and exports without the source.
"""

import bisect
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import torch

from src.data.base import model_size
from src.data.jsonl import IGNORE_INDEX
from src.data.sampling import Permutation
from src.data.text import TokenWindows, WindowStream
from src.data.tokenizer import Codec
from src.errors import UsageError
from src.schema.signature import Arg

MANIFEST = "manifest.json"
FORMAT = "datatrove token files + manifest, version 1"
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


class Concatenated:
    """Several memory-mapped arrays as one: a length and slices, read where a slice falls, nothing at start."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = [0]
        for array in arrays:
            self.starts.append(self.starts[-1] + len(array))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, where: slice) -> np.ndarray:
        start, stop = where.start or 0, min(len(self), len(self) if where.stop is None else where.stop)
        parts, i = [], bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            low, high = start - self.starts[i], min(stop, self.starts[i + 1]) - self.starts[i]
            parts.append(self.arrays[i][low:high])
            start += high - low
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.uint16)


class MaskedWindows(TokenWindows):
    """TokenWindows whose targets are -100 where the prepared loss mask says a token is no target (a prompt, a
    user's turn), so that windows across prompted documents train what the padded documents train."""

    def __init__(self, tokens: Concatenated, targets: Optional[Concatenated], block_size: int, **windows):
        super().__init__(tokens, block_size, **windows)
        self.targets = targets

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().__getitem__(i)
        if self.targets is not None:
            start = self.start(i)
            counts = torch.from_numpy(self.targets[start + 1 : start + self.block_size + 1].astype(np.bool_))
            targets = targets.masked_fill(~counts, IGNORE_INDEX)
        return inputs, targets


def read_manifest(folder: Path, key: str = "data.path") -> dict[str, Any]:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        why = "no such folder" if not folder.is_dir() else f"it has no {MANIFEST}"
        raise UsageError(f"{key}={folder}: {why}; a folder that `python scripts/prepare_data.py SOURCE {folder}` "
                         "wrote (a preparation still running, or killed, writes its manifest last: run it again)")
    record = json.loads(manifest.read_text())
    if record.get("format") != FORMAT:
        raise UsageError(f"{key}={folder}: {MANIFEST} is of format {record.get('format')!r}; this template reads "
                         f"{FORMAT!r}")
    return record


def open_split(folder: Path, manifest: dict, split: str, key: str = "data.path") -> tuple[Concatenated,
                                                                                          Optional[Concatenated]]:
    """A split's tokens (and loss masks, where prepared) as one memory-mapped stream; each file's size checked
    against the manifest (a file cut short or replaced by another of another size is named)."""
    dtype = np.dtype(manifest["dtype"])
    tokens, masks = [], []
    for shard in manifest["splits"][split]:
        for suffix, width, arrays in (("", dtype.itemsize, tokens), (".loss", 1, masks)):
            if suffix and not manifest["loss_masks"]:
                continue
            path = folder / (shard["file"] + suffix)
            if not path.is_file():
                raise UsageError(f"{key}={folder}: {path.name} is missing (the manifest names it)")
            if path.stat().st_size != shard["tokens"] * width:
                raise UsageError(f"{key}={folder}: {path.name} holds {path.stat().st_size} bytes where the manifest "
                                 f"says {shard['tokens']} tokens of {width} bytes: prepare the folder again")
            if shard["tokens"]:
                arrays.append(np.memmap(path, dtype=dtype if width > 1 else np.uint8, mode="r"))
    return Concatenated(tokens), Concatenated(masks) if manifest["loss_masks"] else None


class ShardData(WindowStream):
    """A folder of prepared token shards (scripts/prepare_data.py): windows of block_size tokens across documents,
    as data=tokens cuts them, over every training shard end to end; validation is the documents the preparation
    held out. With label masks (prompt/completion, chats), the masked tokens are no targets."""

    def __init__(
        self,
        path: Annotated[str, Arg("a folder of token shards that scripts/prepare_data.py wrote")],
        **stream,
    ):
        super().__init__(**stream)
        self.folder = Path(path).expanduser()
        self.manifest = read_manifest(self.folder)
        (train, train_masks), (val, val_masks) = (open_split(self.folder, self.manifest, s) for s in SPLITS)
        self.train = MaskedWindows(train, train_masks, self.block_size, random_offset=self.random_offset,
                                   seed=self.seed, random_windows=self.random_windows)
        self.val = MaskedWindows(val, val_masks, self.block_size)
        for name, windows in (("training", self.train), ("validation", self.val)):
            if len(windows) == 0:
                raise UsageError(f"data.path={path}: its {name} split holds {len(windows.tokens)} tokens, no window "
                                 f"of data.block_size={self.block_size}")
        self.codec = Codec.load(self.folder)
        # The manifest holds each shard's digest from the preparation; file_digest samples each file's content.
        self.source_files = {MANIFEST: self.folder / MANIFEST, **{
            shard["file"] + suffix: self.folder / (shard["file"] + suffix)
            for split in SPLITS for shard in self.manifest["splits"][split]
            for suffix in (("", ".loss") if self.manifest["loss_masks"] else ("",))}}

    def train_sampler(self, dataset) -> Permutation:
        # Millions of windows: an order computed as the loader goes, not a list of the epoch (src/data/sampling.py).
        return Permutation(len(dataset), self.seed)

    @model_size
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def fingerprint(self) -> dict:
        return {**super().fingerprint(), "vocabulary": self.manifest["tokenizer"]}

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)
