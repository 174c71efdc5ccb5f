"""What a rank's shard writer reports to rank 0 (src/checkpointing/plain_state.py's sharded_writer). Its own module,
imported only when a sharded state is saved: torch.distributed.checkpoint costs half a second at every start, and
DCP pickles the write results between ranks, so the class must be importable by name."""

from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import _StorageInfo


@dataclass
class ShardWritten(_StorageInfo):
    """Where a rank wrote a tensor, and the CRC-32 of that rank's file: it reaches the coordinator (rank 0) with
    torch.distributed.checkpoint's own gathering of the write results."""

    crc: str = ""
