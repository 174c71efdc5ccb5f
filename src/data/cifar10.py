"""CIFAR-10 from its binary distribution: records of 1 label byte + 3072 pixel bytes (R, G, B planes, 32x32); or
the same records prepared as shards (scripts/prepare_data.py --cifar10), read memory-mapped as a vision corpus of
any size would be."""

from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from torch.utils.data import Dataset

from src.data.base import DataModule, model_size
from src.data.shards import MANIFEST, SPLITS, open_split, read_manifest
from src.errors import UsageError
from src.schema.signature import Arg

RECORD_BYTES = 1 + 3 * 32 * 32
# Per-channel statistics of the real CIFAR-10 training set.
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)


def read_records(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    chunks = []
    for file in files:
        raw = np.fromfile(file, dtype=np.uint8)
        if raw.size % RECORD_BYTES:
            raise ValueError(f"{file}: size {raw.size} is not a multiple of the {RECORD_BYTES}-byte CIFAR record")
        chunks.append(raw.reshape(-1, RECORD_BYTES))
    records = np.concatenate(chunks)
    return records[:, 1:].reshape(-1, 3, 32, 32), records[:, 0].astype(np.int64)


class CifarImages(Dataset):
    def __init__(self, images: np.ndarray, labels: np.ndarray, augment: bool, seed: int = 0):
        self.images, self.labels, self.augment = torch.from_numpy(images), torch.from_numpy(labels), augment
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def record(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Image i's pixels (uint8, 3x32x32) and its label."""
        return self.images[i], self.labels[i]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        pixels, label = self.record(i)
        image = (pixels.float() / 255 - MEAN) / STD
        if self.augment:  # the standard CIFAR recipe: random 4-pixel-padded crop and horizontal flip
            # Drawn from (seed, epoch, index) alone, not from a global or worker RNG, so the same sample gets
            # the same augmentation whichever worker loads it, and a resumed run sees exactly what it would have.
            rng = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.epoch) * 10_000_019 + i) % 2**63)
            if torch.rand((), generator=rng) < 0.5:
                image = image.flip(-1)
            dx, dy = torch.randint(0, 9, (2,), generator=rng).tolist()
            image = torch.nn.functional.pad(image, (4, 4, 4, 4))[:, dy : dy + 32, dx : dx + 32]
        return image, label


class ShardedImages(CifarImages):
    """CIFAR records from prepared shards, memory-mapped: each read where its record lies, nothing at start."""

    def __init__(self, records, augment: bool, seed: int = 0):
        self.records, self.augment, self.seed, self.epoch = records, augment, seed, 0

    def __len__(self) -> int:
        return len(self.records) // RECORD_BYTES

    def record(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.from_numpy(np.array(self.records[i * RECORD_BYTES : (i + 1) * RECORD_BYTES]))
        return raw[1:].view(3, 32, 32), raw[0].long()


class Cifar10Data(DataModule):
    """Trains on every `data_batch_*.bin` under `root`, validates on `test_batch.bin`; or, where `root` is a folder
    that scripts/prepare_data.py --cifar10 wrote, on its shards of the same records."""

    def __init__(
        self,
        root: Annotated[str, Arg("directory with data_batch_*.bin and test_batch.bin, or their prepared shards "
                                 "(scripts/prepare_data.py --cifar10)")] = "data/cifar-10-batches-bin",
        augment: Annotated[bool, Arg("random crop + flip on training images")] = True,
        seed: Annotated[int, Arg("seed of the augmentation (with epoch and sample index)", ge=0)] = 0,
        **loader,
    ):
        super().__init__(**loader)
        root_dir = Path(root).expanduser()
        if (root_dir / MANIFEST).is_file():
            self._from_shards(root_dir, augment, seed)
            return
        train_files = sorted(root_dir.glob("data_batch_*.bin"))
        if not train_files or not (root_dir / "test_batch.bin").is_file():
            raise FileNotFoundError(
                f"data.root={root!r} must hold CIFAR-10's binary files (data_batch_*.bin and test_batch.bin); "
                "scripts/make_synthetic_cifar10.py writes a small set in that format"
            )
        self.source_files = {file.name: file for file in [*train_files, root_dir / "test_batch.bin"]}
        self.train = CifarImages(*read_records(train_files), augment=augment, seed=seed)
        self.val = CifarImages(*read_records([root_dir / "test_batch.bin"]), augment=False)

    def _from_shards(self, folder: Path, augment: bool, seed: int) -> None:
        manifest = read_manifest(folder, "data.root")
        if manifest["dtype"] != "uint8" or not manifest.get("sample", "").startswith("cifar10 record"):
            raise UsageError(f"data.root={folder}: shards of {manifest.get('sample', manifest['dtype'] + ' token ids')}"
                             ", not of CIFAR-10 records (scripts/prepare_data.py --cifar10 writes those)")
        (train, _), (val, _) = (open_split(folder, manifest, split, "data.root") for split in SPLITS)
        self.source_files = {MANIFEST: folder / MANIFEST, **{
            shard["file"]: folder / shard["file"] for split in SPLITS for shard in manifest["splits"][split]}}
        self.train = ShardedImages(train, augment=augment, seed=seed)
        self.val = ShardedImages(val, augment=False)

    @model_size
    def num_classes(self) -> int:
        return 10
