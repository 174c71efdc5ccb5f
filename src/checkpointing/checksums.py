"""A CRC-32 of every file of a checkpoint, recorded when it is written and compared by each rank for the files that
rank reads, when it reads them.

safetensors checks a file's header against its size, not the bytes of its tensors, so a file corrupted in the middle
(a bad disk, a partial copy, someone's edit) would otherwise load silently. `checksums.json` maps each file's path in
the checkpoint (`model.safetensors`, `optimizer_0/shard-00001-of-00002.safetensors`) to its CRC-32: rank 0 computes
those of the files it wrote and of every rank's small random state; each rank the CRCs of its own shards as it
writes them (FSDP), which reach rank 0 with torch.distributed.checkpoint's own gathering of the write results.
"""

import hashlib
import json
import mmap
import os
import zlib
from pathlib import Path
from typing import Iterable

from src.errors import UsageError

CHECKSUMS = "checksums.json"
SHARD_SUMS = "written_shards.json"  # the CRCs of a sharded state's files, until the commit merges them in


def checksum(file: Path) -> str:
    """CRC-32 of the file, read through a memory map: twice as fast as reading it into buffers (about 2 GB/s from
    the page cache, where a file just written or about to be read is)."""
    if file.stat().st_size == 0:
        return f"{0:08x}"
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return f"{zlib.crc32(mapped):08x}"


def write_checksums(directory: Path, sharded: Iterable[Path] = ()) -> None:
    """Rank 0, before the commit: a CRC-32 of each file directly in `directory` and of each sharded state's
    plain values, with the CRCs its writers recorded of the shards of every rank (`sharded`: the states' folders)."""
    sums = {file.name: checksum(file) for file in sorted(directory.iterdir())
            if file.is_file() and file.name != CHECKSUMS}
    for folder in sharded:
        written = folder / SHARD_SUMS
        sums.update({f"{folder.name}/{name}": crc for name, crc in json.loads(written.read_text()).items()})
        written.unlink()
        sums.update({f"{folder.name}/{file.name}": checksum(file) for file in sorted(folder.glob("*.json"))})
    (directory / CHECKSUMS).write_text(json.dumps(sums, indent=2))


def recorded_checksums(checkpoint: Path) -> dict[str, str]:
    file = checkpoint / CHECKSUMS
    if not file.is_file():
        raise UsageError(f"checkpoint {checkpoint} is incomplete: {file} is missing")
    try:
        return json.loads(file.read_text())
    except ValueError as error:
        raise UsageError(f"checkpoint file {file} is corrupt or truncated ({error}); resume from an older "
                         "checkpoint with resume=PATH") from None


def verified(checkpoint: Path, file: Path) -> Path:
    """`file` of `checkpoint`, once its bytes are those checksums.json records for it; a clear error naming it
    otherwise. Called by the rank that reads the file, before it reads it (the bytes then come from the page cache)."""
    name = file.relative_to(checkpoint).as_posix()
    recorded = recorded_checksums(checkpoint).get(name)
    if recorded is None:
        raise UsageError(f"checkpoint file {file} has no checksum in {checkpoint / CHECKSUMS}, so its bytes cannot "
                         "be checked: refused. Resume from a checkpoint this version wrote.")
    if checksum(file) != recorded:
        raise UsageError(f"checkpoint file {file} is corrupt: its content is not what was written (CRC mismatch "
                         f"with {CHECKSUMS}); resume from an older checkpoint with resume=PATH")
    return file


def whole_file_digest(file: Path) -> str:
    """A hash of every byte of a (large, read-only) file such as a pretrained model's weights: computed once per
    machine and version of the file, then found by its path, size and modification time in a cache of small JSON
    files (~/.cache/training-template/file_digests; XDG_CACHE_HOME moves it), so a start of a LoRA run on a 7 GB base
    costs a stat, not a read of 7 GB."""
    stat = file.stat()
    key = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "training-template" / "file_digests"
    cached = root / f"{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}.json"
    try:
        record = json.loads(cached.read_text())
        if record.get("key") == key:
            return record["digest"]
    except (OSError, ValueError):
        pass
    with open(file, "rb") as f:
        hashed = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16))
    digest = f"{stat.st_size} bytes, blake2b {hashed.hexdigest()}"
    try:  # written aside and renamed: ranks that hash the same file at once never read half a record
        root.mkdir(parents=True, exist_ok=True)
        aside = cached.with_suffix(f".{os.getpid()}.tmp")
        aside.write_text(json.dumps({"key": key, "digest": digest}))
        aside.replace(cached)
    except OSError:  # a read-only home: hashed again next time
        pass
    return digest
