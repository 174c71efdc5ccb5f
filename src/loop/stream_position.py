"""Where a streamed dataset stands on this process, saved with each checkpoint: a resume continues there instead of
reading the stream again up to it (at billions of tokens, hours of tokenizing on every process).

The position is the loader's own state: accelerate's `use_stateful_dataloader` makes it torchdata's
StatefulDataLoader, which asks the dataset (datasets' IterableDataset: which file, which row, how far into the
batch of rows being mapped) for its state after each batch, in each of its workers, and accelerate keeps the one of
the last batch handed to the loop (not of the batch it read ahead). It is written as
`data_position_<rank>.json` (JSON: a checkpoint holds no pickle), as the random state is.

Two layouts read a stream on several processes (src/data/stream.py's `train_dataloader` picks one by the number of
files, its `order` names it):
- as many files as processes or more: each process reads its own files, a part of its own length. A process whose
  part ends starts it again on its own (its next pass; torchtitan's loaders do the same), so none waits for another,
  and `TrainState.epoch` counts this process's passes. Only the saved positions can find these parts again: a
  resume needs every rank's file, on the same number of processes (the data's fingerprint refuses another).
- fewer files than processes: every process reads the whole stream and takes its share of each global micro-batch
  (src/data/stream.py's DealtWindows). Its position, the stream's after the last whole global micro-batch, is the
  same on every process and for any number of them: rank 0 writes it, every rank of a resume reads it, on any
  number of processes, exactly. (A checkpoint written before that layout kept one has none: the resume then reads
  the stream again up to the consumed windows, src/loop/accumulation.py, exact too.)
"""

import json
import logging
from pathlib import Path

from accelerate import Accelerator

from src.checkpointing.checksums import verified
from src.errors import UsageError
from src.loop.train_state import TrainState

log = logging.getLogger(__name__)


def position_file(rank: int) -> str:
    return f"data_position_{rank}.json"


class StreamPosition:
    """The prepared training loader's position on this process, if its dataset keeps one."""

    def __init__(self, accelerator: Accelerator, loader):
        self.accelerator, self.loader = accelerator, loader
        dataset = getattr(loader, "dataset", None)
        self.kept = bool(getattr(loader, "use_stateful_dataloader", False)) and callable(
            getattr(dataset, "load_state_dict", None))
        # One stream dealt among the processes (src/data/stream.py's DealtWindows): one position, every rank's.
        self.shared = self.kept and getattr(dataset, "position_is_shared", False)
        # Each process its own files (accelerate's datasets `.shard()`), rather than one stream for all.
        self.per_process_parts = self.kept and accelerator.num_processes > 1 and not self.shared
        self.restored = False  # the loader continues from a checkpoint's position: nothing to skip

    def save(self, directory: Path, state: TrainState) -> None:
        """This rank's position, into the checkpoint being written (every rank calls it; of a shared one, rank 0's
        is written)."""
        if self.kept and not (self.shared and self.accelerator.process_index > 0):
            (directory / position_file(self.accelerator.process_index)).write_text(
                json.dumps({"pass": state.epoch, "loader": self.loader.state_dict()}))

    def load(self, checkpoint: Path, state: TrainState, data_changed: bool) -> None:
        """The loader continues where the checkpoint's rank stood; `state` (already loaded) learns this process's
        pass. Without a position, the loop reads the stream again up to the consumed windows."""
        if not self.kept or data_changed:
            return
        file = checkpoint / position_file(0 if self.shared else self.accelerator.process_index)
        saved = json.loads(verified(checkpoint, file).read_text()) if file.is_file() else None
        if saved is None:
            if self.per_process_parts:
                raise UsageError(f"{file} is missing: this process read its own files of the stream, and only the "
                                 "position saved there finds its place in them again. Resume from another "
                                 "checkpoint, or start the run again")
            return
        state.epoch = saved["pass"]
        if saved["loader"].get("_iterator_finished"):  # the pass ended with the last step: the next one begins
            self.pass_ended(state)
        else:
            self.loader.load_state_dict(saved["loader"])
            self.restored = True
        if self.accelerator.is_main_process:
            log.info("resuming the stream where its loader stood (pass %d%s): no window is read again", state.epoch,
                     ", each process at its own" if self.per_process_parts else "")

    def pass_ended(self, state: TrainState) -> None:
        """A pass over this process's data ended (the loop starts the next)."""
        state.epoch += 1
        self.restored = False
        if not self.per_process_parts:  # a count of all processes' samples; in parts, kept since the start
            state.samples_into_epoch = 0
