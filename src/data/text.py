"""Language-model data: a UTF-8 text file (character level, byte level or a tokenizer's ids) or a pre-tokenized
uint16 .bin file."""

import hashlib
import mmap
from typing import Annotated, Literal, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from src.data.base import DataModule, model_size, readable_file
from src.data.tokenizer import BUILT_IN_TOKENIZERS, REVISION, Codec, load_tokenizer
from src.errors import UsageError
from src.schema.signature import Arg


class TokenWindows(Dataset):
    """Windows of `block_size` tokens; the target is the window shifted by one token.

    By default the windows are a fixed grid of non-overlapping windows. With `random_offset`, every window of
    an epoch starts `offset` tokens later, the offset drawn from (seed, epoch) alone: later epochs see new
    windows. With `random_windows`, window i of an epoch starts anywhere in the stream, independently of the
    others, as nanoGPT draws its batches: hardly any two windows of a run are the same. Either way an epoch has
    the grid's number of windows, and a window is a function of (seed, epoch, index) alone, so a resumed run
    sees exactly what it would have.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, random_offset: bool = False, seed: int = 0,
                 random_windows: bool = False):
        self.tokens, self.block_size = tokens, block_size
        self.random_offset, self.random_windows, self.seed = random_offset, random_windows, seed
        self.offset, self.epoch = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.random_offset:
            rng = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self.offset = int(torch.randint(0, self.block_size, (), generator=rng))

    def __len__(self) -> int:
        room = len(self.tokens) - 1 - (self.block_size - 1 if self.random_offset else 0)
        return max(0, room // self.block_size)

    def start(self, i: int) -> int:
        if self.random_windows:  # any start that leaves room for the window and its last target
            return _mix(_mix(_mix(self.seed) ^ self.epoch) ^ i) % (len(self.tokens) - self.block_size)
        return self.offset + i * self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.start(i)
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def _utf8(raw: bytes, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"data.path={path}: not UTF-8 text (byte {raw[error.start]:#04x} at offset "
                         f"{error.start}); use data.level=byte, or convert the file to UTF-8") from None


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash, so that a window's start needs no RNG state."""
    mask = 2**64 - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def random_access_memmap(path, dtype) -> np.memmap:
    """A token file mapped for reading windows in a shuffled order: the kernel is told the reads are random, so a
    window's page fault reads its pages, not the read-ahead around them (8 MiB on some machines: 640 random
    windows of a cold 2 GB file read 44 MB from disk with read-ahead, 7 MB without; scripts/BENCHMARKS.md)."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if hasattr(mmap, "MADV_RANDOM"):  # not on Windows
        tokens._mmap.madvise(mmap.MADV_RANDOM)
    return tokens


def split(tokens: np.ndarray, val_fraction: float, block_size: int, random_offset: bool = False,
          seed: int = 0, path: str = "the data", random_windows: bool = False) -> tuple[TokenWindows, TokenWindows]:
    """The first (1 - val_fraction) of the stream trains, the rest validates (as nanoGPT does)."""
    n_train = int(len(tokens) * (1 - val_fraction))
    train = TokenWindows(tokens[:n_train], block_size, random_offset, seed, random_windows)
    val = TokenWindows(tokens[n_train:], block_size)  # fixed windows: every evaluation measures the same thing
    if len(train) == 0 or len(val) == 0:
        raise ValueError(
            f"data.path={path}: {len(tokens)} tokens with data.val_fraction={val_fraction} leave no full window of "
            f"data.block_size={block_size} for training or validation"
        )
    return train, val


class WindowStream(DataModule):
    """What every language-model dataset of windows shares: a token stream cut into windows of block_size."""

    def __init__(
        self,
        block_size: Annotated[int, Arg("tokens per sample", ge=1)],
        random_offset: Annotated[bool, Arg("shift the training windows by a seeded offset each epoch, so later "
                                           "epochs see new windows")] = False,
        random_windows: Annotated[bool, Arg(
            "start each training window at its own seeded random position (nanoGPT's sampling) instead of a "
            "grid: almost no window repeats")] = False,
        seed: Annotated[int, Arg("seed of the offsets (with the epoch)", ge=0)] = 0,
        **loader,
    ):
        super().__init__(**loader)
        if random_offset and random_windows:
            raise ValueError("data.random_offset=true and data.random_windows=true: choose one (random_windows "
                             "already starts every window at a random position)")
        self.block_size = block_size
        self.random_offset, self.random_windows, self.seed = random_offset, random_windows, seed


class TokenStream(WindowStream):
    """A file's token stream cut into windows, its tail validating (data=text, data=tokens)."""

    def __init__(
        self,
        val_fraction: Annotated[float, Arg("tail of the file used for validation", gt=0, lt=1)] = 0.1,
        **windows,
    ):
        super().__init__(**windows)
        self.val_fraction = val_fraction


class TextData(TokenStream):
    """Character level: the vocabulary is the sorted set of characters in the file. Byte level: 256 ids. With a
    tokenizer (a pretrained model's, by default: config/data/text.yaml), its ids."""

    def __init__(
        self,
        path: Annotated[str, Arg("UTF-8 text file")],
        level: Annotated[Literal["char", "byte"], Arg("tokens are characters (vocab from the file) or bytes; "
                                                      "unused with a tokenizer")] = "char",
        tokenizer: Annotated[Optional[str], Arg("a tokenizers JSON file, or a from_pretrained folder or hub id "
                                                "holding one (null: data.level)")] = None,
        tokenizer_revision: Annotated[Optional[str], Arg(REVISION)] = None,
        **stream,
    ):
        super().__init__(**stream)
        file = readable_file(path, "data.path")
        self.source_files = {file.name: file}
        raw = file.read_bytes()
        if tokenizer in BUILT_IN_TOKENIZERS:  # other text options take them as data.tokenizer; this one by level
            raise UsageError(f"data.tokenizer={tokenizer}: data=text reads characters or bytes as data.level says: "
                             f"give data.tokenizer=null data.level={tokenizer}")
        instead = "data.tokenizer=null (characters or bytes, as data.level says)"
        self.tokenizer = load_tokenizer(tokenizer, instead=instead, revision=tokenizer_revision) if tokenizer else None
        if self.tokenizer is not None:
            ids = self.tokenizer.encode(_utf8(raw, path)).ids
            self.vocab = None
            tokens = np.array(ids, dtype=np.uint16 if self.tokenizer.get_vocab_size() <= 65536 else np.uint32)
            self.codec = Codec("tokenizer", tokenizer=self.tokenizer)
        elif level == "byte":
            tokens, self.vocab = np.frombuffer(raw, dtype=np.uint8), None
            self.codec = Codec("byte")
        else:
            text = _utf8(raw, path)
            # Vectorised over code points (3x faster than a dict lookup per character; start-up counts):
            # the vocabulary is the characters present, in code-point order, as sorted(set(text)) gives.
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            present = np.flatnonzero(np.bincount(codes))
            if len(present) > 65536:
                raise ValueError(f"data.path={path}: {len(present)} distinct characters do not fit 16-bit token ids; "
                                 "use data.level=byte")
            self.vocab = [chr(code) for code in present]
            index = np.zeros(present[-1] + 1 if len(present) else 1, dtype=np.uint16)
            index[present] = np.arange(len(present))
            tokens = index[codes]
            self.codec = Codec("char", "".join(self.vocab))
        self.train, self.val = split(tokens, self.val_fraction, self.block_size, self.random_offset, self.seed, path,
                                      self.random_windows)

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size

    def fingerprint(self) -> dict:
        # Other text may map to the same ids: the characters they stand for are part of the data.
        if self.tokenizer is not None:
            vocabulary = self.tokenizer.to_str()
        else:
            vocabulary = "bytes" if self.vocab is None else "".join(self.vocab)
        if len(vocabulary) > 200:
            vocabulary = hashlib.blake2b(vocabulary.encode(), digest_size=8).hexdigest()
        return {**super().fingerprint(), "vocabulary": vocabulary}

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)


class TokenData(TokenStream):
    """nanoGPT's format: a flat uint16 array of token ids, memory-mapped so it may exceed RAM."""

    def __init__(
        self,
        path: Annotated[str, Arg("flat uint16 token-id file (nanoGPT's .bin format)")],
        vocab_size: Annotated[int, Arg("number of distinct token ids", ge=1, le=65536)],
        **stream,
    ):
        super().__init__(**stream)
        file = readable_file(path, "data.path")
        self.source_files = {file.name: file}
        if file.stat().st_size % 2:
            raise ValueError(f"data.path={path}: {file.stat().st_size} bytes is not a multiple of 2 "
                             "(a flat array of uint16 token ids)")
        tokens = random_access_memmap(file, np.uint16)
        # A cheap sanity check: ids >= vocab_size would index past the embedding (a CUDA assert on GPU).
        head_max = int(tokens[: 1 << 20].max()) if len(tokens) else 0
        if head_max >= vocab_size:
            raise ValueError(f"data.vocab_size={vocab_size} but {path} holds token id {head_max}")
        self._vocab_size = vocab_size
        self.train, self.val = split(tokens, self.val_fraction, self.block_size, self.random_offset, self.seed, path,
                                      self.random_windows)

    @model_size
    def vocab_size(self) -> int:
        return self._vocab_size
