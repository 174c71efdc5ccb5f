"""What every dataset option builds: train/val datasets, their loaders, and the sizes a model may need.

A new dataset is one file: a DataModule subclass whose __init__ signature is its config schema (defaults,
types and ranges in one place, see src/schema/signature.py), plus `config/data/NAME.yaml` with its `_target_`.
"""

import hashlib
import inspect
import signal
from collections.abc import Mapping, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, SequentialSampler, Subset

from src.data.sampling import RepeatedWindows
from src.errors import UsageError
from src.schema.signature import Arg

if TYPE_CHECKING:
    from src.data.tokenizer import Codec

IGNORE_INDEX = -100  # the label the objectives skip (torch's and transformers' convention)


def readable_file(path: str, key: str) -> Path:
    """`path` as a file this process can read, or an error naming `key` and what is wrong with it."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise IsADirectoryError(f"{key}={path!r} is a directory; it must be a file")
    if not file.is_file():
        raise FileNotFoundError(f"{key}={path!r}: no such file (relative paths are relative to {Path.cwd()})")
    try:
        with open(file, "rb"):
            pass
    except OSError as error:
        raise PermissionError(f"{key}={path!r} cannot be read ({error.strerror})") from None
    return file


class FirstSamples(Subset):
    """The first n samples of a dataset, passing set_epoch on (per-epoch offsets, augmentation seeds)."""

    def __init__(self, dataset: Dataset, n: int):
        super().__init__(dataset, range(min(n, len(dataset))))

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def _workers_ignore_ctrl_c(worker_id: int) -> None:
    # A terminal's Ctrl-C reaches the loader's workers too; the training process stops cleanly on it (finishing
    # its step and saving, src/faults/preemption.py) and needs its workers until then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _spread(length: int, count: int) -> list[int]:
    return sorted({i * length // count for i in range(count)}) if length else []


IDS_MADE_BY = "ids made by"  # the fingerprint's key for the codec's identity (src/checkpointing/resume.py)


def ids_made_by(codec: "Codec") -> str:
    """What a codec's ids mean, as a fingerprint records it: its identity, a large character set as a digest."""
    ids = codec.identity()
    return f"characters {hashlib.blake2b(ids.encode(), digest_size=8).hexdigest()}" if len(ids) > 200 else ids


def described_ids(identity: str) -> str:
    """ids_made_by's value for a message: a character set by its size and start, not every character."""
    if identity.startswith(("tokenizer ", "characters ")) or identity in ("bytes", "(no text)"):
        return identity
    return f"the {len(identity)} characters {identity[:30]!r}" + ("..." if len(identity) > 30 else "")


def _digest(items) -> str:
    """A short hash of samples (tensors, arrays, numbers, strings, nested in tuples, lists or mappings)."""
    hasher = hashlib.blake2b(digest_size=8)

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            item = item.numpy(force=True)
        if isinstance(item, np.ndarray):
            hasher.update(f"{item.dtype}{item.shape}".encode())
            hasher.update(np.ascontiguousarray(item).tobytes())
        elif isinstance(item, Mapping):
            for key in sorted(item):
                hasher.update(str(key).encode())
                feed(item[key])
        elif isinstance(item, (list, tuple)):
            for element in item:
                feed(element)
        else:
            hasher.update(repr(item).encode())

    for item in items:
        feed(item)
    return hasher.hexdigest()


def file_digest(path: Path, chunks: int = 16, chunk_bytes: int = 1 << 16) -> str:
    """A file's size and a hash of its content: all of it up to chunks x chunk_bytes, else that many evenly
    spaced chunks, so a large file costs a megabyte of reading (a change in its size is caught anyway)."""
    size = path.stat().st_size
    hasher = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as file:
        if size <= chunks * chunk_bytes:
            hasher.update(file.read())
        else:
            for offset in _spread(size - chunk_bytes, chunks):
                file.seek(offset)
                hasher.update(file.read(chunk_bytes))
    return f"{size} bytes, {hasher.hexdigest()}"


def model_size(method: Callable) -> property:
    """Marks a property as a size the model config may reference as `${dataset:NAME}` (vocab_size, ...)."""
    method.is_model_size = True
    return property(method)


class DataModule:
    """Subclasses set `train` and `val` in __init__, and declare the sizes they know with @model_size.

    `batch_size` is per process and per micro-step: the global batch of one optimizer step is
    batch_size * num_processes * gradient_accumulation_steps. A sample is a tuple (inputs, target) or a
    mapping (input_ids, attention_mask, labels, ...); `collate_fn` batches them if the default cannot.
    """

    train: Dataset
    val: Dataset
    collate_fn: Optional[Callable] = None
    # The files it was read from, by name: the fingerprint records their sizes and content (file_digest).
    source_files: Mapping[str, Path] = {}
    # True when the targets are the inputs themselves (Hugging Face's `labels = input_ids`), to be shifted by
    # the objective: an objective that does not shift would train the model to copy its input.
    targets_are_inputs: bool = False
    # True when samples pack several documents whose tokens must attend within their own document only: they
    # carry position_ids that restart at each document, and the model must read them (src/data/packing.py).
    attends_per_document: bool = False
    # Text data: how text becomes token ids and back (src/data/tokenizer.py), for sampling and the export.
    codec: Optional["Codec"] = None
    # True when `train` is an iterable that holds its own position (datasets' IterableDataset: state_dict and
    # load_state_dict): its loader (torchdata's StatefulDataLoader) is saved in each checkpoint, and a resume continues
    # there instead of reading the data again up to it (src/loop/stream_position.py).
    loader_state: bool = False
    read_ahead: bool = False  # see __init__

    def __init__(
        self,
        batch_size: Annotated[int, Arg("samples per process per micro-step", ge=1)] = 32,
        num_workers: Annotated[int, Arg("DataLoader worker processes per training process", ge=0)] = 0,
        eval_batch_size: Annotated[Optional[int], Arg("samples per process per evaluation batch (null: batch_size)",
                                                      ge=1)] = None,
        prefetch_factor: Annotated[Optional[int], Arg("batches each worker loads ahead (null: PyTorch's 2; only "
                                                      "with num_workers > 0)", ge=1)] = None,
        read_ahead: Annotated[bool, Arg("a thread of the training process reads, pins and sends the next optimizer "
                                        "step's micro-batches to the device while a step runs (a dataset with a "
                                        "length; the same batches, src/loop/read_ahead.py)")] = False,
    ):
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.eval_batch_size = eval_batch_size or batch_size
        self.prefetch_factor = prefetch_factor
        self.read_ahead = read_ahead

    @classmethod
    def provides(cls) -> list[str]:
        """The sizes this dataset knows once built (checked against the model config before it is built)."""
        return [name for name, member in inspect.getmembers(cls)
                if isinstance(member, property) and getattr(member.fget, "is_model_size", False)]

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.provides()}

    def consumed(self, loader, state, epoch_samples: Optional[int]) -> dict[str, int]:
        """What the run's summary states of the training data the run consumed up to `state` (`epoch_samples`
        per whole epoch; None for data without a length), e.g. a mixture's tokens per source; nothing here."""
        return {}

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint records of the data it trained on, so that a resume notices other data: the source
        files (size and content, file_digest), the sample counts, the sizes the model depends on, and a hash of
        evenly spaced samples as the model sees them (each a fixed cost however large the data). Extend it with
        what else identifies your data (a vocabulary)."""
        found: dict[str, Any] = {f"file {name}": file_digest(path) for name, path in sorted(self.source_files.items())}
        found.update(self.sizes())
        if self.codec is not None:  # what the ids mean, alike for every data option: a resume on other data checks it
            found[IDS_MADE_BY] = ids_made_by(self.codec)
        for name, dataset in (("train", self.train), ("validation", self.val)):
            if isinstance(dataset, Sized):
                found[f"{name} samples"] = len(dataset)
                found[f"{name} sampled content"] = _digest(dataset[i] for i in _spread(len(dataset), 32))
        return found

    def train_sampler(self, dataset: Dataset) -> Optional[Sampler]:
        """The training order of a dataset with a length: None shuffles with torch's sampler, which accelerate
        seeds from (trainer.seed, epoch). Its own sampler needs `set_epoch` and an order of (seed, epoch) alone,
        the same on every rank, as mid-epoch resume skips what the order gave before."""
        return None

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        if train and self.read_ahead and not isinstance(dataset, Sized):
            raise UsageError(f"data.read_ahead=true reads ahead within an epoch of a dataset with a length; this "
                             f"one ({type(dataset).__name__}) has none. A stream keeps its position in its loader, "
                             "which a reader ahead would move past the batches trained on: set data.read_ahead=false "
                             "and read it with data.num_workers")
        sampler = self.train_sampler(dataset) if train and isinstance(dataset, Sized) else None
        if isinstance(dataset, RepeatedWindows):  # it shuffles itself, in windows
            sampler = SequentialSampler(dataset)
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            sampler=sampler,
            shuffle=train and isinstance(dataset, Sized) and sampler is None,  # an iterable dataset orders itself
            # Full micro-batches only, so every optimizer step sees the same number of samples.
            drop_last=train,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            collate_fn=self.collate_fn,
            pin_memory=torch.cuda.is_available(),
            # Training workers restart each epoch so that they see the dataset's set_epoch (augmentation seeds).
            persistent_workers=self.num_workers > 0 and not train,
            # Its own generator: otherwise each new iterator draws a seed from the global RNG, so a run resumed
            # mid-epoch would see different dropout than the run it continues, and every evaluation would move
            # training's dropout. (The shuffle order comes from accelerate's seedable sampler, which re-seeds
            # the training loader's generator from trainer.seed + epoch.)
            generator=torch.Generator(),
            worker_init_fn=_workers_ignore_ctrl_c,
        )

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.train, Sized) and len(self.train) < self.batch_size:
            raise UsageError(
                f"data.batch_size={self.batch_size} is larger than the training set ({len(self.train)} samples)"
            )
        return self._loader(self.train, train=True)

    def val_dataloader(self, max_batches: Optional[int] = None) -> DataLoader:
        """The validation set, or its first max_batches x eval_batch_size samples: the same samples on any
        number of processes, so a bounded evaluation is still exact across processes."""
        dataset = self.val
        if max_batches is not None:
            dataset = FirstSamples(self.val, max_batches * self.eval_batch_size)
        return self._loader(dataset, train=False)
