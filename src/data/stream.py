"""A corpus streamed, never materialised: for data larger than a node's disk, or a hub dataset read as it
trains. `datasets` reads the rows lazily (load_dataset(streaming=True)); each batch of rows is tokenized and cut
into windows across documents in the loader (its workers, with data.num_workers), as data=tokens cuts a file.

Exact resume without reading the stream again: the loader keeps the stream's position (which file, which row, how
far into the batch of rows being cut), each checkpoint saves it per process, and a resume continues there
(src/loop/stream_position.py). With as many files as processes or more, each process reads its own files (a
resume on the same number of processes); with fewer, every process reads and tokenizes the whole stream and takes
its share of each global micro-batch (DealtWindows: a resume on any number of processes; tokenizing on every
process is the cost: give a large corpus at least as many files as processes, split Parquet files by row group with
data.reshard=true, or prepare it into shards, scripts/prepare_data.py). The order of the windows depends on that
layout and on the loader's workers: both are in the data's fingerprint, so a resume that would read another order
is refused naming it.
"""

import copy
import itertools
import logging
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
from torch.utils.data import IterableDataset

from src.data.base import DataModule, model_size
from src.data.hf_dataset import BUILDERS
from src.data.jsonl import tokenized_documents
from src.data.text import TokenWindows
from src.data.tokenizer import REVISION, codec_for
from src.errors import UsageError
from src.schema.signature import Arg

log = logging.getLogger(__name__)
# torchdata 0.11's StatefulDataLoader calls a torch function that torch 2.13 deprecates, at every loader it builds.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
ROWS_PER_MAP = 1000  # rows tokenized together: each batch's tail shorter than a window is dropped (as run_clm's)


def streamed_rows(path: str, subset: Optional[str], split: str) -> Any:
    """data.path's rows as a datasets.IterableDataset, read as it is iterated."""
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise UsageError("data=stream needs datasets: pip install -r requirements-extras.txt") from error
    source = Path(path).expanduser()
    if source.is_file():
        if source.suffix not in BUILDERS:
            raise UsageError(f"data.path={path}: a {source.suffix or 'suffix-less'} file; data=stream reads "
                             f"{', '.join(BUILDERS)} files, a folder of them or a hub dataset id")
        return load_dataset(BUILDERS[source.suffix], data_files=str(source), split="train", streaming=True)
    try:
        return load_dataset(str(source) if source.exists() else path, subset, split=split, streaming=True)
    except ValueError as error:
        raise UsageError(f"data.path={path} (data.subset={subset}, data.split={split}): {error}") from None


class DealtWindows(IterableDataset):
    """One stream's windows dealt among processes that all read it (fewer files than processes): each global
    micro-batch of `processes` x `batch_size` windows read whole, this process taking its `batch_size` of it (rank
    r the r-th), as accelerate's IterableDatasetShard deals an iterable, but with a position: the stream's after
    the last whole global micro-batch (the same on every process, whatever their number) and how far into the
    current one this process is. A resume, on any number of processes, continues there, reading again at most one
    global micro-batch. A pass ends at the last whole global micro-batch, on every process alike."""

    position_is_shared = True  # src/loop/stream_position.py: any rank's saved position is every rank's

    def __init__(self, windows: Any, batch_size: int, rank: int, processes: int):
        self.windows, self.batch_size, self.rank, self.processes = windows, batch_size, rank, processes
        self.position: dict = {"windows": None, "into": 0}  # after the last window handed out (None: the start)
        # Where an iteration begins: the stream's start or a loaded position, as the stream's own loaded state.
        self.start: dict = self.position

    def __iter__(self):
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        source, before, skip = iter(self.windows), self.start["windows"], self.start["into"]
        while True:
            chunk = list(itertools.islice(source, self.processes * self.batch_size))
            if len(chunk) < self.processes * self.batch_size:
                self.position = self.start = {"windows": None, "into": 0}  # the next pass starts at the start
                return
            after = self.windows.state_dict()  # the stream's, past this global micro-batch
            for taken, window in enumerate(chunk[mine], start=1):
                if taken > skip:
                    whole = taken == self.batch_size
                    self.position = {"windows": after if whole else before, "into": 0 if whole else taken}
                    yield window
            before, skip = after, 0

    def state_dict(self) -> dict:
        return copy.deepcopy(self.position)

    def load_state_dict(self, state: dict) -> None:
        if "windows" not in state:  # a checkpoint of one process written before the deal: the stream's own
            state = {"windows": state, "into": 0}
        if state["windows"] is not None:
            self.windows.load_state_dict(state["windows"])
        self.position, self.start = copy.deepcopy(state), copy.deepcopy(state)

    def set_epoch(self, epoch: int) -> None:
        self.windows.set_epoch(epoch)


class StreamData(DataModule):
    """Windows of block_size tokens across the documents of a streamed corpus; its first val_documents rows
    validate (read once, at start), the rest train (any row with a validating text left out), in the source's
    order."""

    loader_state = True  # datasets' IterableDataset keeps its position: the checkpoint saves it

    def __init__(
        self,
        path: Annotated[str, Arg("a Parquet, JSON Lines, CSV, Arrow or text (a line a document) file, a folder of "
                                 "them, or a Hugging Face hub dataset id, read as it trains")],
        block_size: Annotated[int, Arg("tokens per sample", ge=1)],
        text_column: Annotated[str, Arg("the column holding each document's text")] = "text",
        split: Annotated[str, Arg("the split to read (a file read directly is the split 'train')")] = "train",
        subset: Annotated[Optional[str], Arg("the subset of a folder or hub dataset that has several")] = None,
        val_documents: Annotated[int, Arg("the first rows of the stream that validate (the rest train)",
                                          ge=1)] = 1000,
        tokenizer: Annotated[Optional[str], Arg("byte, a tokenizers JSON file or a from_pretrained folder or hub "
                                                "id holding one (null: byte)")] = "byte",
        tokenizer_revision: Annotated[Optional[str], Arg(REVISION)] = None,
        reshard: Annotated[bool, Arg("read Parquet files as parts of one row group each (datasets' reshard), so "
                                     "that a corpus of fewer files than processes still gives each process its own "
                                     "parts and resumes without reading the stream again; another order of "
                                     "windows than per file")] = False,
        **loader,
    ):
        super().__init__(**loader)
        try:
            import torchdata.stateful_dataloader  # noqa: F401  (accelerate's use_stateful_dataloader needs it)
        except ImportError as error:
            raise UsageError("data=stream needs torchdata, whose loader keeps the stream's position for a resume: "
                             "pip install -r requirements-extras.txt") from error
        self.path, self.block_size, self.text_column = path, block_size, text_column
        self.codec = codec_for(tokenizer, revision=tokenizer_revision)
        rows = streamed_rows(path, subset, split)
        files = rows.n_shards
        self.parts = "files"
        if reshard:
            rows = rows.reshard()
            self.parts = "row groups"
            if rows.n_shards == files:  # not Parquet (nothing to split), or one row group a file
                log.warning("data.reshard=true: %s could not be split further than its %d files (datasets splits "
                            "Parquet by row group; these have none to spare)", path, files)
            else:
                log.info("data.reshard=true: %s read as %d parts (its row groups) instead of %d files", path,
                         rows.n_shards, files)
        columns = rows.column_names or list(next(iter(rows), {}))  # a source without declared features: its first row
        if text_column not in columns:
            raise UsageError(f"data.text_column={text_column}: {path} has no such column; its columns: "
                             f"{', '.join(columns) or 'none (no row)'}")
        self.identity = {"path": path, "subset": subset, "split": split, "text column": text_column,
                         "val_documents": val_documents, "files": files}
        if reshard:  # parts of other sizes, read in another order by processes and workers
            self.identity["parts (row groups)"] = rows.n_shards
        local = Path(path).expanduser()
        self.source_files = ({local.name: local} if local.is_file() else
                             {str(f.relative_to(local)): f for f in sorted(local.rglob("*"))
                              if f.is_file() and not f.name.startswith(".")} if local.is_dir() else {})
        held_out = [row[text_column] for row in rows.take(val_documents + 1)]  # and whether one row is left
        if len(held_out) <= val_documents:
            raise UsageError(f"data.path={path} holds {len(held_out)} rows, and data.val_documents={val_documents} "
                             "holds out the first ones to validate: none is left to train on; lower "
                             "data.val_documents below the rows it has")
        held_out = held_out[:val_documents]
        val = np.array([t for ids in tokenized_documents(self.codec, held_out)[0] for t in ids], dtype=np.int64)
        self.val = TokenWindows(val, block_size)
        if len(self.val) == 0:
            raise UsageError(f"data.path={path}: its first data.val_documents={val_documents} rows hold {len(val)} "
                             f"tokens, no window of data.block_size={block_size} to validate on")
        # The held-out texts are filtered out rather than skipped: datasets' skip(n) is split evenly among the parts
        # that processes or loader workers read (n/2 rows of each of two files), which would train on held-out rows.
        self.held_out = frozenset(held_out)
        self.train = rows.filter(self._trains, batched=True, batch_size=ROWS_PER_MAP).map(
            self._windows, batched=True, batch_size=ROWS_PER_MAP, remove_columns=columns
        ).with_format("torch")

    def _trains(self, batch: dict) -> list[bool]:
        """Which rows of a batch train: those whose text validates do not (nor any copy of one)."""
        return [text not in self.held_out for text in batch[self.text_column]]

    def _windows(self, batch: dict) -> dict:
        """A batch of rows as windows across its documents, each with its next-token targets."""
        ids = [t for document in tokenized_documents(self.codec, batch[self.text_column])[0] for t in document]
        windows = TokenWindows(np.asarray(ids, dtype=np.int64), self.block_size)
        chunks = [windows.tokens[windows.start(i) : windows.start(i) + self.block_size + 1]
                  for i in range(len(windows))]
        return {"input_ids": [chunk[:-1] for chunk in chunks], "labels": [chunk[1:] for chunk in chunks]}

    def train_dataloader(self):
        """A loader each process reads its own files through (accelerate shards the stream: parts_per_process), or
        the stream dealt among the processes with a position (DealtWindows; on one process, all of it to the one),
        prepared here for this process alone, so that accelerate does not deal it again (its IterableDatasetShard
        keeps no position)."""
        from accelerate import PartialState
        from accelerate.data_loader import prepare_data_loader

        from src.launch.accelerator import loader_configuration

        state = PartialState()
        if self.parts_per_process():
            return super().train_dataloader()
        dealt = DealtWindows(self.train, self.batch_size, state.process_index, state.num_processes)
        config = loader_configuration(stateful_loaders=True)  # as every other loader of the run, for one process
        loader = prepare_data_loader(self._loader(dealt, train=True), state.device, num_processes=1, process_index=0,
                                     put_on_device=True, dispatch_batches=config.dispatch_batches,
                                     non_blocking=config.non_blocking,
                                     use_stateful_dataloader=config.use_stateful_dataloader)
        loader._is_accelerate_prepared = True  # accelerator.prepare keeps it as it is (its guard against twice)
        return loader

    def parts_per_process(self) -> bool:
        """Whether each process reads its own files (accelerate shards a datasets stream so when it has enough)."""
        from accelerate import PartialState

        processes = PartialState().num_processes
        return processes > 1 and self.train.n_shards >= processes

    def order(self) -> str:
        """What the order of the windows the processes train on depends on, besides the source."""
        from accelerate import PartialState

        processes = PartialState().num_processes
        split = (f"its {self.train.n_shards} {self.parts} shared among {processes} processes"
                 if self.parts_per_process() else "one stream for every process")
        return split + (f", read by {self.num_workers} loader workers each" if self.num_workers else "")

    def fingerprint(self) -> dict:
        # A stream has no length and no index: its identity and the order it is read in say what a run consumed.
        return {**super().fingerprint(), **{f"stream {key}": value for key, value in self.identity.items()},
                "stream order": self.order(), "vocabulary": self.codec.identity()}

    def consumed(self, loader, state, epoch_samples) -> dict[str, int]:
        if self.parts_per_process():  # each its own files, its own passes (src/loop/stream_position.py)
            return {"stream: passes over process 0's files completed": state.epoch,
                    f"stream: windows of {self.block_size} tokens read by all processes": state.samples_into_epoch}
        return {"stream: passes over it completed": state.epoch,
                f"stream: windows of {self.block_size} tokens read in this pass": state.samples_into_epoch}

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)

