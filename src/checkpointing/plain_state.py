"""State dicts as files that hold no pickle: tensors in safetensors, everything else as JSON.

An optimizer's, a schedule's or a random generator's state is a tree of dicts, lists and tuples whose leaves are
tensors and plain values (numbers, strings, booleans, None, numpy's random state). torch.save pickles such a tree,
and reading a pickle back can build any object the file names: a checkpoint from someone else could run code.
Here the tensors go into a safetensors file and the tree, with every other leaf, into the JSON of that file's
header (or a .json file where there are no tensors); reading builds nothing but tensors, containers and plain
values, and a value of any other type is refused when it is saved, naming where it sits.
"""

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from src.checkpointing.checksums import SHARD_SUMS, checksum, verified

TREE = "tree"  # the header key holding the tree (safetensors keeps string metadata beside the tensors)


def save_tree(tree: Any, file: Path) -> None:
    """`tree` into `file`: a .safetensors file (its tensors as tensors) or a .json file (no tensors allowed)."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, (), tensors if file.suffix == ".safetensors" else None, file)
    if file.suffix == ".json":
        file.write_text(json.dumps(encoded))
    else:
        save_file(tensors, str(file), metadata={TREE: json.dumps(encoded), "format": "pt"})


def load_tree(file: Path, device: str = "cpu") -> Any:
    """What save_tree wrote into `file`."""
    if file.suffix == ".json":
        return _decode(json.loads(file.read_text()), None, file)
    with safe_open(str(file), framework="pt", device=device) as tensors:
        header = (tensors.metadata() or {}).get(TREE)
        if header is None:
            raise ValueError(f"{file} holds no state tree (its header has no {TREE!r} entry)")
        return _decode(json.loads(header), tensors, file)


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """A state dict as (its tensors, the rest): two dicts of the same nesting, each holding the entries the other
    lacks. Under FSDP the tensors go to torch.distributed.checkpoint, which would pickle the rest."""
    if isinstance(tree, dict):
        tensors, rest = {}, {}
        for key, value in tree.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, dict):
                tensors[key], rest[key] = split_tensors(value)
            else:
                rest[key] = value
        return tensors, rest
    return {}, tree


def merge(tensors: dict, rest: dict) -> dict:
    """split_tensors undone: `rest`'s entries put back into `tensors` (in place, which is returned)."""
    for key, value in rest.items():
        if isinstance(value, dict) and isinstance(tensors.get(key), dict):
            merge(tensors[key], value)
        else:
            tensors[key] = value
    return tensors


# A tree is encoded as JSON in which every container is a one-key object naming its kind ({"dict": [[key, value],
# ...]}, {"list": [...]}, {"tuple": [...]}, {"tensor": name}, {"ndarray": [...], "dtype": ...}) and every other value
# is a JSON scalar: so dict keys keep their types (an optimizer's state is keyed by int) and tuples stay tuples.


def _encode(value: Any, path: tuple, tensors: Optional[dict], file: Path) -> Any:
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise TypeError(f"{file}: the tensor at {_where(path)} cannot be kept in a JSON file")
        name = json.dumps(list(path), default=repr)  # unique: 1 and "1", "a/b" and a -> b are apart
        tensors[name] = value.detach().contiguous()
        return {"tensor": name}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, path, tensors, file), _encode(v, (*path, k), tensors, file)]
                         for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__ if type(value) in (list, tuple) else "list":
                [_encode(v, (*path, i), tensors, file) for i, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{file}: {type(value).__module__}.{type(value).__qualname__} at {_where(path)} cannot be "
                    "stored without pickle; a state dict may hold tensors, numbers, strings, booleans, None, and "
                    "dicts, lists and tuples of them")


def _decode(value: Any, tensors, file: Path) -> Any:
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and "dict" in value:
        return {_decode(k, tensors, file): _decode(v, tensors, file) for k, v in value["dict"]}
    if len(value) == 1 and "list" in value:
        return [_decode(v, tensors, file) for v in value["list"]]
    if len(value) == 1 and "tuple" in value:
        return tuple(_decode(v, tensors, file) for v in value["tuple"])
    if len(value) == 1 and "tensor" in value and tensors is not None:
        return tensors.get_tensor(value["tensor"])
    if set(value) == {"ndarray", "dtype"}:
        return np.array(value["ndarray"], dtype=np.dtype(value["dtype"]))
    raise ValueError(f"{file}: unknown entry {json.dumps(value)[:80]} in its state tree")


def _where(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path) or "the top"


def sharded_writer(directory: Path):
    """A torch.distributed.checkpoint storage writer whose files hold no pickle: each rank's shards as one
    safetensors file (`shard-<i>-of-<n>.safetensors`, i counting ranks from 1), each tensor's offset in the whole
    in its header, as torch's HuggingFaceStorageReader reads them back, resharded to any number of ranks. No
    metadata file: the reader builds it from the headers. torch's default writer pickles its metadata and each
    tensor, and its own safetensors writer builds each file in memory first (one more copy of the rank's shards);
    this one writes from the tensors' own memory. Non-tensor values are refused: save them apart (split_tensors)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._hf_utils import (
        CUSTOM_METADATA_KEY,
        DCP_VERSION_KEY,
        FORMAT_KEY,
        FORMAT_VALUE,
        HF_DCP_VERSION,
        SAVED_OFFSETS_KEY,
    )
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    from src.checkpointing.shard_written import ShardWritten

    class ShardWriter(HuggingFaceStorageWriter):
        def __init__(self):
            super().__init__(str(directory), save_distributed=True)  # no consolidation: its finish writes nothing

        def prepare_global_plan(self, plans):
            return [replace(plan, storage_data={**plan.storage_data, "shards": len(plans)})
                    for plan in super().prepare_global_plan(plans)]

        def write_data(self, plan, planner):
            done = Future()
            name = shard_file_name(plan.storage_data["shard_index"], plan.storage_data["shards"])
            tensors, offsets, sizes = {}, {}, []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise TypeError(f"{directory}: {item.index.fqn} is not a tensor; it would have to be pickled")
                tensor = planner.resolve_data(item).detach().to("cpu").contiguous()
                tensors[item.index.fqn] = tensor
                offsets[item.index.fqn] = {SAVED_OFFSETS_KEY: list(item.tensor_data.chunk.offsets)}
                sizes.append((item.index, tensor.numel() * tensor.element_size()))
            # Written even where empty (a rank may hold nothing of this state): every one of the n files is there.
            save_file(_unshared(tensors), str(directory / name),
                      metadata={CUSTOM_METADATA_KEY: json.dumps(offsets), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                                FORMAT_KEY: FORMAT_VALUE})
            crc = checksum(directory / name)  # from the page cache the file was just written to
            done.set_result([WriteResult(index=index, size_in_bytes=nbytes,
                                         storage_data=ShardWritten(name, 0, nbytes, crc=crc))
                             for index, nbytes in sizes])
            return done

        def finish(self, metadata, results) -> None:
            """The coordinator (rank 0), once every rank's file is written: their CRCs, for the commit's
            checksums.json (src/checkpointing/checksums.py)."""
            sums = {result.storage_data.relative_path: result.storage_data.crc for written in results
                    for result in written}
            for empty in directory.glob("shard-*.safetensors"):  # a rank that held nothing reported no result
                sums.setdefault(empty.name, checksum(empty))
            (directory / SHARD_SUMS).write_text(json.dumps(sums))

    return ShardWriter()


def sharded_reader(directory: Path):
    """The reader of what sharded_writer wrote (torch's own: safetensors and JSON headers only), each file this rank
    reads checked against the checkpoint's checksums.json first (`directory` is one of a checkpoint's folders)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class VerifyingReader(HuggingFaceStorageReader):
        def read_data(self, plan, planner):
            for file in sorted({Path(self.storage_data[item.storage_index].relative_path).name
                                for item in plan.items}):
                verified(directory.parent, directory / file)
            return super().read_data(plan, planner)

    return VerifyingReader(str(directory))


SHARD_FILE = re.compile(r"shard-(\d+)-of-(\d+)\.safetensors")


def shard_file_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.safetensors"


def _unshared(tensors: dict) -> dict:
    """safetensors refuses tensors that share memory; such shards (views of one buffer) are copied apart."""
    seen: set = set()
    out = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen and tensor.numel() else tensor
        seen.add(storage)
    return out
