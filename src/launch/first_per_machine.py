"""The first process of each machine does a long one-off job (download, tokenize into a cache) while the others
wait for it, however long it takes."""

import contextlib
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist
from accelerate import PartialState

# A week: longer than any download or tokenization; a rank that dies meanwhile ends the launch anyway (the
# launcher stops the others).
PATIENCE = timedelta(days=7)


@contextlib.contextmanager
def local_main_first() -> Iterator[None]:
    """accelerate's local_main_process_first (the machine's first process runs the block, then the others, which
    find its caches), except that the others wait at a barrier of a gloo group of their own with no practical
    time-out: at the process group's (trainer.dist_timeout_s) a waiting rank's barrier failed and ended the run
    while the first one was still tokenizing a large corpus."""
    state = PartialState()
    if state.num_processes == 1 or not dist.is_initialized():
        yield
        return
    group = dist.new_group(backend="gloo", timeout=PATIENCE)  # every rank, in the same order
    if not state.is_local_main_process:
        dist.barrier(group=group)
    yield
    if state.is_local_main_process:
        dist.barrier(group=group)
    dist.destroy_process_group(group)
