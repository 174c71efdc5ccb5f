"""A checkpoint is checked whole before anything of it is loaded: every file present, none truncated or corrupted,
and none in a pickle format.

Nothing of a checkpoint is ever unpickled (src/checkpointing/training_state.py writes safetensors and JSON only),
so a file in a pickle format (torch.save's .bin/.pt/.pkl, torch.distributed.checkpoint's .metadata and .distcp) is
not ours: an earlier version of this template or accelerate's save_state wrote it, or someone planted it. It is
refused, named, unread. So is a file the layout does not know, or one without a CRC-32 in checksums.json
(src/checkpointing/checksums.py): the small files' bytes are compared here, the weights' and states' by the rank
that reads them, as it reads them. The shards of an FSDP checkpoint are checked for their headers and for covering
every tensor whole.
"""

import json
import math
import re
from pathlib import Path

from safetensors import safe_open

from src.checkpointing.checksums import CHECKSUMS, recorded_checksums, verified
from src.checkpointing.layout import CONFIG_FILE, DATA_FILE, EMA_FILE, STATE_FILE
from src.checkpointing.plain_state import SHARD_FILE, shard_file_name
from src.checkpointing.training_state import (
    BASE_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PLAIN_VALUES,
    SCALER_FILE,
    SCHEDULER_FILE,
    SHARDED_MODEL,
    SHARDED_OPTIMIZER,
)
from src.errors import UsageError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".distcp", ".metadata")
EVAL_OUTPUT = "eval_metrics.json"  # eval.py's report, written beside what it scored; never read back
# Every name a checkpoint of ours holds (a second model, optimizer or schedule numbered _1, ...); anything else in
# one was put there by someone else, and is refused by name rather than left for something to pick up.
KNOWN_FILES = re.compile("|".join([
    r"(model|optimizer)(_\d+)?\.safetensors", r"scheduler(_\d+)?\.json", r"random_states_\d+\.safetensors",
    r"objective_state_\d+\.safetensors",
    r"data_position_\d+\.json",
    *map(re.escape, (SCALER_FILE, CHECKSUMS, EMA_FILE, STATE_FILE, CONFIG_FILE, DATA_FILE, BASE_FILE, EVAL_OUTPUT))]))
KNOWN_DIRS = re.compile(rf"({SHARDED_MODEL}|{SHARDED_OPTIMIZER})_\d+")


def check_readable(checkpoint: Path) -> None:
    """A clear error naming the file for a truncated, corrupt, incomplete or pickle-format checkpoint, before
    anything is loaded."""
    for pickled in sorted(checkpoint.rglob("*")):
        if pickled.suffix in PICKLE_SUFFIXES or pickled.name == ".metadata":
            remedy = (f", or start a new run from its weights with trainer.init_weights={checkpoint}"
                      if (checkpoint / MODEL_FILE).is_file() else "")
            raise UsageError(f"checkpoint file {pickled} is in a pickle format, which this template never writes "
                             "and never reads (unpickling can run code): refused, nothing of it was read. An "
                             "earlier version of this template, accelerate's save_state or someone else wrote it. "
                             f"Resume from a checkpoint this version wrote{remedy}.")
    strangers = _not_of_the_layout(checkpoint)
    if strangers:
        raise UsageError(f"checkpoint file {strangers[0]} is not one a checkpoint holds (src/checkpointing/layout.py): "
                         "refused, nothing of the checkpoint was read. Someone else put it there; remove it if you "
                         "know what it is, or resume from a checkpoint this template wrote.")
    for alternatives in ((MODEL_FILE, f"{SHARDED_MODEL}_0"), (OPTIMIZER_FILE, f"{SHARDED_OPTIMIZER}_0"),
                         (SCHEDULER_FILE,), (STATE_FILE,), (CONFIG_FILE,)):
        if not any((checkpoint / name).exists() for name in alternatives):
            raise UsageError(f"checkpoint {checkpoint} is incomplete: {checkpoint / alternatives[0]} is missing"
                             + (f" (nor {', '.join(alternatives[1:])})" if len(alternatives) > 1 else ""))
    recorded = recorded_checksums(checkpoint)
    for file in sorted(checkpoint.iterdir()):
        try:
            if file.is_dir():
                _check_shards(file)
                continue
            if file.suffix == ".safetensors":  # its header against its size; its bytes where a rank reads it
                with safe_open(file, framework="pt"):
                    pass
        except Exception as error:
            raise UsageError(f"checkpoint file {file} is corrupt or truncated ({error}); "
                             f"resume from an older checkpoint with resume=PATH") from None
    files = {file.relative_to(checkpoint).as_posix() for file in checkpoint.rglob("*") if file.is_file()}
    unrecorded = sorted(files - set(recorded) - {CHECKSUMS, EVAL_OUTPUT})
    if unrecorded:
        raise UsageError(f"checkpoint file {checkpoint / unrecorded[0]} has no checksum in {checkpoint / CHECKSUMS}, "
                         "so its bytes cannot be checked: refused. Resume from a checkpoint this version wrote.")
    missing = sorted(set(recorded) - files)
    if missing:
        raise UsageError(f"checkpoint {checkpoint} is incomplete: {checkpoint / missing[0]} is missing ({CHECKSUMS} "
                         "lists it); resume from an older checkpoint with resume=PATH")
    # The small files (the config, the position, the data's fingerprint, values): read by every rank, some before
    # the processes talk, so checked here; the weights and states by the rank that reads them (checksums.verified).
    for name in sorted(recorded):
        if name.endswith((".json", ".yaml")):
            verified(checkpoint, checkpoint / name)


def _not_of_the_layout(checkpoint: Path) -> list[Path]:
    """Files and folders in a checkpoint that its layout has no place for."""
    strangers = []
    for path in sorted(checkpoint.iterdir()):
        if path.is_dir() and KNOWN_DIRS.fullmatch(path.name):
            strangers += [inner for inner in sorted(path.iterdir()) if not (
                inner.is_file() and (SHARD_FILE.fullmatch(inner.name) or inner.name == PLAIN_VALUES))]
        elif not (path.is_file() and KNOWN_FILES.fullmatch(path.name)):
            strangers.append(path)
    return strangers


def _check_shards(directory: Path) -> None:
    """A sharded state (training_state.save_sharded): each of the n ranks' files present with a valid header, and
    the shards of each tensor covering it whole, so that no rank's part is missing."""
    from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY

    shards = {int(m.group(1)): (int(m.group(2)), shard) for shard in sorted(directory.glob("*.safetensors"))
              if (m := SHARD_FILE.fullmatch(shard.name))}
    counts = {count for count, _ in shards.values()}
    if len(counts) != 1:
        raise ValueError(f"{directory} holds no complete set of shard-<i>-of-<n>.safetensors files")
    (count,) = counts
    for index in range(1, count + 1):
        if index not in shards:
            raise ValueError(f"{directory / shard_file_name(index, count)} is missing (shard {index} of {count})")
    covered: dict[str, int] = {}
    extent: dict[str, list[int]] = {}
    for _, shard in shards.values():
        try:
            with safe_open(shard, framework="pt") as tensors:  # the header against the file's size
                offsets = json.loads((tensors.metadata() or {}).get(CUSTOM_METADATA_KEY, "{}"))
                for name in tensors.keys():
                    shape = tensors.get_slice(name).get_shape()
                    start = offsets.get(name, {}).get(SAVED_OFFSETS_KEY, [0] * len(shape))
                    covered[name] = covered.get(name, 0) + math.prod(shape)
                    whole = extent.setdefault(name, [0] * len(shape))
                    extent[name] = [max(w, s + n) for w, s, n in zip(whole, start, shape)]
        except Exception as error:
            raise ValueError(f"shard {shard}: {error}") from None
    for name, values in covered.items():
        if values != math.prod(extent[name]):
            raise ValueError(f"the shards in {directory} hold {values} of the {math.prod(extent[name])} values of "
                             f"{name}")
