"""A checkpoint is checked whole before anything of it is loaded: every file present, none truncated."""

import json
import zipfile
from pathlib import Path

from safetensors import safe_open

from src.checkpointing.layout import CONFIG_FILE, STATE_FILE
from src.schema.errors import UsageError

# What accelerate.save_state writes for the model and the optimizer: a file, or under FSDP's sharded state
# dict a torch.distributed.checkpoint directory (.metadata + .distcp shards).
MODEL_STATES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp_0.bin", "pytorch_model_fsdp_0")


OPTIMIZER_STATES = ("optimizer.bin", "optimizer_0.bin", "optimizer_0")


def check_readable(checkpoint: Path) -> None:
    """A clear error naming the file for a truncated or corrupt checkpoint, before anything is loaded.

    The CRC check reads every torch file once more, deliberately: torch.load does not verify CRCs, so a
    file corrupted in the middle would otherwise load silently (verified: 16 bad bytes in optimizer.bin).
    """
    for alternatives in (MODEL_STATES, OPTIMIZER_STATES, ("scheduler.bin",), (STATE_FILE,), (CONFIG_FILE,)):
        if not any((checkpoint / name).exists() for name in alternatives):
            raise UsageError(f"checkpoint {checkpoint} is incomplete: {checkpoint / alternatives[0]} is missing"
                             + (f" (nor {', '.join(alternatives[1:])})" if len(alternatives) > 1 else ""))
    for file in sorted(checkpoint.iterdir()):
        try:
            if file.is_dir():
                _check_sharded_state(file)
            elif file.suffix == ".safetensors":
                with safe_open(file, framework="pt"):  # validates the header against the file size
                    pass
            elif file.suffix in (".bin", ".pt", ".pkl"):
                with zipfile.ZipFile(file) as archive:  # torch.save's format; truncation breaks its index
                    if archive.testzip() is not None:
                        raise ValueError("CRC mismatch")
            elif file.suffix == ".json":
                json.loads(file.read_text())
        except Exception as error:
            raise UsageError(f"checkpoint file {file} is corrupt or truncated ({error}); "
                             f"resume from an older checkpoint with resume=PATH") from error


def _check_sharded_state(directory: Path) -> None:
    """A torch.distributed.checkpoint directory: its metadata loads, and every shard holds the bytes it lists."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory / '.metadata'} is missing")
    needed: dict[str, int] = {}
    for info in FileSystemReader(str(directory)).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = directory / name
        actual = shard.stat().st_size if shard.is_file() else None
        if actual is None or actual < size:
            raise ValueError(f"shard {shard} holds {actual or 0} bytes, the metadata lists {size}")
