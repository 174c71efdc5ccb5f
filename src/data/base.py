"""What every dataset config builds: train/val datasets, their loaders, and what the model must know."""

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset


class DataModule:
    """Subclasses set `train`, `val` and `model_kwargs` (e.g. vocab_size, num_classes) in __init__.

    `batch_size` is per process and per micro-step: the global batch of one optimizer step is
    batch_size * num_processes * gradient_accumulation_steps.
    """

    train: Dataset
    val: Dataset
    model_kwargs: dict[str, Any]

    def __init__(self, batch_size: int, num_workers: int = 0):
        self.batch_size = batch_size
        self.num_workers = num_workers

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            # Full micro-batches only, so every optimizer step averages the same number of samples.
            drop_last=train,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            # Training workers restart each epoch so that they see the dataset's set_epoch (augmentation seeds).
            persistent_workers=self.num_workers > 0 and not train,
            # Its own generator: otherwise each new iterator draws a seed from the global RNG, and a run
            # resumed mid-epoch would see different dropout than the run it continues. (The shuffle order
            # comes from accelerate's seedable sampler, which re-seeds this generator from trainer.seed + epoch.)
            generator=torch.Generator() if train else None,
        )

    def train_dataloader(self) -> DataLoader:
        if len(self.train) < self.batch_size:
            raise ValueError(
                f"data.batch_size={self.batch_size} is larger than the training set ({len(self.train)} samples)"
            )
        return self._loader(self.train, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val, train=False)
