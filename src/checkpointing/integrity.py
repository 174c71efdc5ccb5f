"""A checkpoint is checked whole before anything of it is loaded: every file present, none truncated."""

import dataclasses
import enum
import importlib
import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open

from src.checkpointing.layout import CONFIG_FILE, STATE_FILE
from src.errors import UsageError

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
        except pickle.UnpicklingError as error:
            raise UsageError(f"checkpoint file {file}: {error}; nothing of it was executed. Resume only from "
                             "checkpoints this template wrote") from None
        except Exception as error:
            raise UsageError(f"checkpoint file {file} is corrupt or truncated ({error}); "
                             f"resume from an older checkpoint with resume=PATH") from error


def _check_sharded_state(directory: Path) -> None:
    """A torch.distributed.checkpoint directory: its metadata loads, every shard holds the bytes it lists, and its
    values that are not tensors are plain values."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (directory / ".metadata").is_file():
        raise ValueError(f"{directory / '.metadata'} is missing")
    _MetadataOnly(io.BytesIO((directory / ".metadata").read_bytes())).load()  # before torch unpickles it
    metadata = FileSystemReader(str(directory)).read_metadata()
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = directory / name
        actual = shard.stat().st_size if shard.is_file() else None
        if actual is None or actual < size:
            raise ValueError(f"shard {shard} holds {actual or 0} bytes, the metadata lists {size}")
    _check_plain_values(directory, metadata)


def _check_plain_values(directory: Path, metadata) -> None:
    """torch.distributed.checkpoint stores what is not a tensor (an optimizer's learning rates, betas, parameter
    names...) as torch.save'd bytes inside the shards, and its load planner unpickles them with
    weights_only=False: a planted one would run code on every rank at resume. Each is read here first with
    torch's weights-only loader, which builds nothing but plain values."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = f"{directory / info.relative_path}, value {index.fqn}"
        if info.transform_descriptors:  # compression and the like: torch's default writer, which we use, adds none
            raise pickle.UnpicklingError(f"refused: {where} is stored through {list(info.transform_descriptors)}")
        with open(directory / info.relative_path, "rb") as shard:
            shard.seek(info.offset)
            value = shard.read(info.length)
        try:
            torch.load(io.BytesIO(value), weights_only=True)
        except pickle.UnpicklingError as error:
            named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            raise pickle.UnpicklingError(f"refused: {where} names {named.group(1) if named else 'an object'}, "
                                         "which could run code") from None


class _MetadataOnly(pickle.Unpickler):
    """torch.distributed.checkpoint reads its `.metadata` with a plain pickle.load: a planted one would run code
    on every rank at resume. Read first with this, it may build nothing but the metadata's own dataclasses and
    enums, torch's dtypes, sizes and layouts, and paths; anything else is refused (Python's "Restricting
    Globals" recipe)."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed.checkpoint.planner")

    def find_class(self, module: str, name: str):
        if module in self.MODULES:
            found = getattr(importlib.import_module(module), name, None)  # torch's own modules, no others
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                                ("pathlib", "WindowsPath"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused: the metadata names {module}.{name}, which could run code")
