"""Several datasets in one run, each drawn in proportion to its weight (`data=mixture`, config/data/mixture.yaml):

    accelerate launch train.py model=hf_causal_lm data=mixture objective=causal_lm \
        'data.sources=[{path: data/shakespeare_speeches.jsonl, weight: 3}, {path: corpus.parquet, weight: 1}]'

Each source is read as `data=hf_dataset` reads one (src/data/hf_dataset.py), with its own keys (path, text_column,
prompt_column, split, val_split, subset, val_fraction) and the run's shared ones (block_size, tokenizer, packing).
An epoch of the mixture is `samples_per_epoch` samples (null: as many as the sources hold together), each source's
share of them as its weight says. Which of a source's samples an epoch takes is a function of (seed, source,
epoch) alone: each source is walked through seeded orders of itself, computed as they go (no permutation held:
flat memory however large the source), an epoch taking the next share, so a source drawn less than its size
shows other samples each epoch, and one drawn more repeats only after a whole pass. The mixture is then one
map-style dataset like any other: shuffled by the run's seeded sampler, resumed bitwise, on another number of
processes too, and fingerprinted source by source (every source's files). The validation split is every
source's, whole.
"""

import bisect
import logging
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
from torch.utils.data import ConcatDataset, Dataset

from src.data.base import DataModule, model_size
from src.data.preference import LongPairs
from src.data.sampling import Permutation
from src.data.tokenizer import REVISION
from src.errors import UsageError
from src.schema.signature import Arg

log = logging.getLogger(__name__)

# The keys a source may set; the others are the run's, shared by every source.
SOURCE_KEYS = ("path", "weight", "text_column", "prompt_column", "split", "val_split", "subset", "val_fraction")


class MixedSamples(Dataset):
    """One epoch of the mixture: `counts[i]` samples of source i, walked through orders computed as they go
    (src/data/sampling.py: Permutation, one per source), not permutations held in memory: sources of millions of
    samples (prepared shards, data=shards data.sources) keep start-up and memory flat. The epoch reaches the
    sources too (their random windows or offsets)."""

    def __init__(self, sources: list[Dataset], counts: list[int], seed: int):
        self.sources, self.counts, self.seed, self.epoch = sources, counts, seed, 0
        self.starts = np.cumsum([0, *counts]).tolist()  # where each source's share begins in the epoch
        self.orders = [Permutation(len(source), seed=seed * 1_000_003 + i) for i, source in enumerate(sources)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for source in self.sources:
            if hasattr(source, "set_epoch"):
                source.set_epoch(epoch)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> Any:
        source = bisect.bisect_right(self.starts, index) - 1
        return self.sources[source][self.index_in(source, index - self.starts[source])]

    def index_in(self, source: int, k: int) -> int:
        """The sample of `source` at place k of its share in this epoch."""
        size = len(self.sources[source])
        drawn = self.epoch * self.counts[source] + k  # how far along the source's endless walk
        order = self.orders[source]
        order.set_epoch(drawn // size)  # each pass over the source its own order
        return order.at(drawn % size)

    def samples_by_source(self, indices: np.ndarray) -> np.ndarray:
        """How many of the samples at `indices` of an epoch each source gave (no sample read)."""
        return np.bincount(np.searchsorted(self.starts, indices, side="right") - 1, minlength=len(self.sources))

    def tokens_by_source(self, indices: np.ndarray, lengths: dict[tuple[int, int], int]) -> np.ndarray:
        """The tokens of the samples at `indices` of this epoch, summed per source. `lengths` remembers each
        (source, sample) read, so a sample drawn in many epochs is read once."""
        tokens = np.zeros(len(self.sources), dtype=np.int64)
        for index in indices.tolist():
            source = bisect.bisect_right(self.starts, index) - 1
            key = (source, self.index_in(source, index - self.starts[source]))
            if key not in lengths:
                lengths[key] = sample_tokens(self.sources[source][key[1]])
            tokens[source] += lengths[key]
        return tokens


def weighted_sources(sources: list, keys: tuple[str, ...], shared: str) -> list[tuple[dict, float]]:
    """data.sources as (source without its weight, weight), each checked: its keys among `keys`, a path and a
    weight above 0. `shared` says which keys are the run's instead ("KEYS are the run's")."""
    if not sources:
        raise UsageError("data.sources is empty: give at least one {path: ..., weight: ...}")
    checked = []
    for i, source in enumerate(sources):
        source = dict(source)
        unknown = sorted(set(source) - set(keys))
        if unknown or "path" not in source or "weight" not in source:
            what = f"has no key {unknown[0]!r}" if unknown else "needs a path and a weight"
            raise UsageError(f"data.sources[{i}] {what}; a source's keys: {', '.join(keys)} (path and weight "
                             f"mandatory; {shared}, data.KEY)")
        weight = source.pop("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise UsageError(f"data.sources[{i}].weight={weight}: a number above 0 (relative to the others)")
        checked.append((source, float(weight)))
    return checked


def sample_tokens(sample: dict) -> int:
    """A sample's tokens: a document's, or a preference pair's prompt and both answers."""
    if "input_ids" in sample:
        return len(sample["input_ids"])
    return sum(len(sample[key]) for key in ("prompt_ids", "chosen_ids", "rejected_ids"))


def shares(weights: list[float], total: int) -> list[int]:
    """`total` split in proportion to `weights`, whole numbers summing to it (largest remainders)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


class Mixture(DataModule):
    targets_are_inputs = True

    def __init__(
        self,
        sources: Annotated[list, Arg(
            "the datasets, each a mapping: path (as data=hf_dataset's) and weight (> 0, relative), optionally "
            "text_column, prompt_column, split, val_split, subset, val_fraction")],
        block_size: Annotated[int, Arg("tokens per sample: the longest document, or the packed block", ge=2)],
        samples_per_epoch: Annotated[Optional[int], Arg(
            "samples an epoch of the mixture draws, in proportion to the weights (null: as many as the sources "
            "hold together)", ge=1)] = None,
        seed: Annotated[int, Arg("seed of which samples each source gives each epoch", ge=0)] = 0,
        tokenizer: Annotated[Optional[str], Arg("byte, a tokenizers JSON file or a from_pretrained folder or hub "
                                                "id holding one, for every source (null: byte)")] = "byte",
        tokenizer_revision: Annotated[Optional[str], Arg(REVISION)] = None,
        packing: Annotated[Union[bool, Literal["cross_document"]], Arg(
            "as data=hf_dataset's, for every source")] = False,
        long_documents: Annotated[Literal["truncate", "split"], Arg("as data=hf_dataset's")] = "truncate",
        mask_boundaries: Annotated[bool, Arg("as data=hf_dataset's")] = False,
        preference: Annotated[bool, Arg("as data=hf_dataset's, for every source: preference pairs")] = False,
        long_pairs: Annotated[LongPairs, Arg("as data=hf_dataset's")] = "truncate",
        **loader,
    ):
        super().__init__(**loader)
        from accelerate import PartialState

        from src.data.hf_dataset import HFDataset

        built, weights = [], []
        for i, (source, weight) in enumerate(weighted_sources(sources, SOURCE_KEYS,
                                                              "block_size, tokenizer and packing are the run's")):
            try:
                built.append(HFDataset(block_size=block_size, tokenizer=tokenizer,
                                       tokenizer_revision=tokenizer_revision, packing=packing,
                                       long_documents=long_documents, mask_boundaries=mask_boundaries,
                                       preference=preference, long_pairs=long_pairs, batch_size=self.batch_size,
                                       **source))
            except UsageError as error:  # its keys are data.KEY to it: say which source
                raise UsageError(f"data.sources[{i}] ({source['path']}): {error}") from None
            weights.append(weight)
        total = samples_per_epoch or sum(len(b.train) for b in built)
        counts = shares(weights, total)
        self.codec, self.collate_fn = built[0].codec, built[0].collate_fn
        self.attends_per_document = built[0].attends_per_document
        if preference:  # every pair of every source its own number (precomputed reference log-probabilities)
            numbered = [b.train for b in built] + [b.val for b in built]
            for before, pairs in zip(numbered, numbered[1:]):
                pairs.first_index = before.first_index + len(before)
        self.train = MixedSamples([b.train for b in built], counts, seed)
        self.paths = [str(source["path"]) for source in sources]
        self.val = ConcatDataset([b.val for b in built])
        self.source_files = {f"source {i} {name}": path for i, b in enumerate(built)
                             for name, path in b.source_files.items()}
        for i, (source, count) in enumerate(zip(built, counts) if PartialState().is_main_process else []):
            tokens = sum(sample_tokens(source.train[j]) for j in range(min(len(source.train), 1000)))
            per_sample = tokens / max(1, min(len(source.train), 1000))
            log.info("data.sources[%d] %s: weight %g, %d of an epoch's %d samples (%.1f%%; it holds %d), about "
                     "%d tokens", i, sources[i]["path"], weights[i], count, total, 100 * count / total,
                     len(source.train), count * per_sample)

    def consumed(self, loader, state, epoch_samples: int) -> dict[str, int]:
        """The tokens each source gave the run: every epoch's samples so far, replayed in the order the run's
        seeded sampler drew them (the same on every rank; the ranks took that order's batches in turn)."""
        from accelerate import PartialState
        from accelerate.data_loader import get_sampler

        sampler = get_sampler(loader)
        if not PartialState().is_main_process:  # the summary is printed and written there alone
            return {}
        if loader.dataset is not self.train or not hasattr(sampler, "set_epoch"):
            return {}  # e.g. trainer.limit_train_batches: a subset of the mixture
        lengths: dict[tuple[int, int], int] = {}
        tokens = np.zeros(len(self.train.sources), dtype=np.int64)
        epoch_before, sampler_epoch_before = self.train.epoch, sampler.epoch
        for epoch in range(state.epoch + 1):
            sampler.set_epoch(epoch)
            self.train.set_epoch(epoch)
            order = np.fromiter(iter(sampler), dtype=np.int64)
            tokens += self.train.tokens_by_source(order[: epoch_samples if epoch < state.epoch
                                                        else state.samples_into_epoch], lengths)
        sampler.set_epoch(sampler_epoch_before)
        self.train.set_epoch(epoch_before)
        return {f"tokens from data.sources[{i}] ({path})": int(n)
                for i, (path, n) in enumerate(zip(self.paths, tokens))}

    @model_size
    def vocab_size(self) -> int:
        return self.codec.vocab_size
