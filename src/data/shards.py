"""Token shards: a corpus tokenized once (scripts/prepare_data.py, on many processes) and read memory-mapped, so
that a run's start-up and memory do not grow with the corpus.

A prepared folder holds datatrove's token files (the format its DocumentTokenizer writes and nanotron reads), per
preparation task and split: `{split}_{task:05d}.ds`, the token ids end to end (uint16, or uint32 for a vocabulary
above 65,536), `.ds.index`, each document's end (uint64), and for data with label masks (prompt/completion, chats)
`.ds.loss`, one byte per token, 1 where the token is a target. Preference pairs (prepared with --preference) are
three documents each: the prompt, the chosen and the rejected answer. `manifest.json` names them with their tokens,
documents and digests, the tokenizer and the source; `tokenizer.json` (or `vocabulary.json`) is the tokenizer, so
that a run decodes, samples and exports without the source.
"""

import bisect
import functools
import hashlib
import itertools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from src.data.base import model_size
from src.data.jsonl import IGNORE_INDEX, pad_right
from src.data.packing import best_fit, pad_packed, summary_line
from src.data.preference import PAIR_RULE, LongPairs, LongPairsArg, fitted, pair_collator, pair_sample, report
from src.data.sampling import Permutation
from src.data.text import TokenWindows, WindowStream, random_access_memmap
from src.data.tokenizer import Codec
from src.errors import UsageError
from src.schema.signature import Arg

MANIFEST = "manifest.json"
FORMAT = "datatrove token files + manifest, version 1"
SPLITS = ("train", "validation")
# The manifest's "sample" of a folder of preference pairs; the rule is in it, so that shards of another rule are
# refused.
PAIR_SAMPLE = f"preference pairs, three documents each: prompt, chosen, rejected (rule {PAIR_RULE})"
GROUP = 4096  # documents packed together (data.packing=true): best fit among them, a bounded cost per document

log = logging.getLogger(__name__)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


class Concatenated:
    """Several memory-mapped arrays as one: a length and slices, read where a slice falls, nothing at start."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = [0]
        for array in arrays:
            self.starts.append(self.starts[-1] + len(array))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, where: slice) -> np.ndarray:
        start, stop = where.start or 0, min(len(self), len(self) if where.stop is None else where.stop)
        parts, i = [], bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            low, high = start - self.starts[i], min(stop, self.starts[i + 1]) - self.starts[i]
            parts.append(self.arrays[i][low:high])
            start += high - low
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.uint16)


class MaskedWindows(TokenWindows):
    """TokenWindows whose targets are -100 where the prepared loss mask says a token is no target (a prompt, a
    user's turn), so that windows across prompted documents train what the padded documents train."""

    def __init__(self, tokens: Concatenated, targets: Optional[Concatenated], block_size: int, **windows):
        super().__init__(tokens, block_size, **windows)
        self.targets = targets

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().__getitem__(i)
        if self.targets is not None:
            start = self.start(i)
            counts = torch.from_numpy(self.targets[start + 1 : start + self.block_size + 1].astype(np.bool_))
            targets = targets.masked_fill(~counts, IGNORE_INDEX)
        return inputs, targets


def read_manifest(folder: Path, key: str = "data.path") -> dict[str, Any]:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        why = "no such folder" if not folder.is_dir() else f"it has no {MANIFEST}"
        raise UsageError(f"{key}={folder}: {why}; a folder that `python scripts/prepare_data.py SOURCE {folder}` "
                         "wrote (a preparation still running, or killed, writes its manifest last: run it again)")
    record = json.loads(manifest.read_text())
    if record.get("format") != FORMAT:
        raise UsageError(f"{key}={folder}: {MANIFEST} is of format {record.get('format')!r}; this template reads "
                         f"{FORMAT!r}")
    return record


def open_split(folder: Path, manifest: dict, split: str, key: str = "data.path") -> tuple[Concatenated,
                                                                                          Optional[Concatenated]]:
    """A split's tokens (and loss masks, where prepared) as one memory-mapped stream; each file's size checked
    against the manifest (a file cut short or replaced by another of another size is named)."""
    dtype = np.dtype(manifest["dtype"])
    tokens, masks = [], []
    for shard in manifest["splits"][split]:
        for suffix, width, arrays in (("", dtype.itemsize, tokens), (".loss", 1, masks)):
            if suffix and not manifest["loss_masks"]:
                continue
            path = folder / (shard["file"] + suffix)
            if not path.is_file():
                raise UsageError(f"{key}={folder}: {path.name} is missing (the manifest names it)")
            if path.stat().st_size != shard["tokens"] * width:
                raise UsageError(f"{key}={folder}: {path.name} holds {path.stat().st_size} bytes where the manifest "
                                 f"says {shard['tokens']} tokens of {width} bytes: prepare the folder again")
            if shard["tokens"]:
                arrays.append(random_access_memmap(path, dtype if width > 1 else np.uint8))
    return Concatenated(tokens), Concatenated(masks) if manifest["loss_masks"] else None


def document_ends(folder: Path, manifest: dict, split: str, key: str = "data.path") -> np.ndarray:
    """Where each document of a split ends in its stream of tokens (the files end to end), from the `.ds.index`
    files: 8 bytes a document, read at start by the packings that keep documents whole."""
    ends, offset = [np.zeros(0, np.int64)], 0
    for shard in manifest["splits"][split]:
        path = folder / (shard["file"] + ".index")
        if not path.is_file() or path.stat().st_size != 8 * shard["documents"]:
            found = f"holds {path.stat().st_size} bytes" if path.is_file() else "is missing"
            raise UsageError(f"{key}={folder}: {path.name} {found} where the manifest says {shard['documents']} "
                             "documents of 8 bytes: prepare the folder again")
        ends.append(np.fromfile(path, dtype=np.uint64).astype(np.int64) + offset)
        offset += shard["tokens"]
    return np.concatenate(ends)


PLANS = "plans"  # the prepared folder's cache of packing plans, one per split and layout
PLAN_ARRAYS = ("starts", "lengths", "bounds")


def packing_plan(ends: np.ndarray, block_size: int, pack: bool, split_long: bool) -> dict[str, Any]:
    """Which pieces of the stream make each sample: documents (truncated to block_size, or with `split_long` cut
    into documents of block_size), packed best fit within groups of GROUP consecutive documents (`pack`) or one a
    sample. 16 bytes a document, 8 a sample."""
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    cut = int((lengths > block_size).sum())
    if split_long:
        counts = np.maximum(1, -(-lengths // block_size))
        document = np.repeat(np.arange(len(lengths)), counts)
        within = np.arange(len(document)) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = starts[document] + within * block_size
        lengths = np.minimum(block_size, ends[document] - starts)
    else:
        lengths = np.minimum(lengths, block_size)
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    order, bounds = np.arange(len(starts)), np.arange(len(starts) + 1)
    if pack:  # best fit within groups of consecutive documents: the same blocks however long the corpus
        order, bounds = [], [0]
        for group in range(0, len(lengths), GROUP):
            for block in best_fit(lengths[group : group + GROUP].tolist(), block_size):
                order += [group + piece for piece in block]
                bounds.append(len(order))
    return {"starts": starts[order].astype(np.int64), "lengths": lengths[order].astype(np.int64),
            "bounds": np.asarray(bounds, dtype=np.int64),
            "summary": {"pieces": len(order), "tokens": int(lengths.sum()), "cut": cut}}


def cached_packing_plan(folder: Path, manifest: dict, split: str, block_size: int, pack: bool,
                        split_long: bool) -> dict[str, Any]:
    """The packing plan, memory-mapped from the folder's plans/ when an earlier run saved it for these shards and
    this layout (so that a start reads nothing per document), else computed from the `.ds.index` files and saved
    there by the main process, where the folder is writable. Saved with numpy's format, never a pickle."""
    key = {"shards": [[shard["file"], shard["digest"], shard["tokens"], shard["documents"]]
                      for shard in manifest["splits"][split]],
           "block_size": block_size, "pack": pack, "split_long": split_long, "group": GROUP, "version": 1}
    where = folder / PLANS / f"{split}-{hashlib.blake2b(json.dumps(key).encode(), digest_size=8).hexdigest()}"
    try:
        meta = json.loads((where / "plan.json").read_text())
        if meta["key"] == key:
            plan = {name: np.load(where / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in PLAN_ARRAYS}
            if len(plan["starts"]) == len(plan["lengths"]) == plan["bounds"][-1] == meta["summary"]["pieces"]:
                return {**plan, "summary": meta["summary"], "from": where}
    except (OSError, ValueError, KeyError, IndexError):
        pass  # none yet, or one damaged: computed again
    plan = packing_plan(document_ends(folder, manifest, split), block_size, pack, split_long)
    from accelerate import PartialState

    if PartialState().is_main_process:
        partial = where.with_name(f"{where.name}.partial-{os.getpid()}")
        try:  # complete or absent: the folder appears whole, by one rename
            shutil.rmtree(where, ignore_errors=True)  # a damaged one (a whole one was returned above)
            partial.mkdir(parents=True, exist_ok=True)
            for name in PLAN_ARRAYS:
                np.save(partial / f"{name}.npy", plan[name], allow_pickle=False)
            (partial / "plan.json").write_text(json.dumps({"key": key, "summary": plan["summary"]}))
            partial.rename(where)
        except OSError as error:  # a read-only folder, or another run saved it first
            shutil.rmtree(partial, ignore_errors=True)
            log.debug("packing plan not saved in %s: %s", where, error)
    return plan


class PackedDocuments(Dataset):
    """Whole documents of a token stream as samples: packed best fit into blocks of block_size (`pack`), each
    document with positions from 0, or one document per sample. Labels are next-token targets that never cross a
    document's end (so its first token is never one, as in a padded batch) and skip tokens the loss mask leaves
    out. A document longer than block_size is truncated, or with `split_long` cut into documents of block_size.
    `plan`: packing_plan's, or cached_packing_plan's (memory-mapped); tokens are read per sample."""

    def __init__(self, tokens: Concatenated, masks: Optional[Concatenated], plan: dict[str, Any], pack: bool):
        self.tokens, self.masks, self.pack = tokens, masks, pack
        self.starts, self.lengths, self.bounds = plan["starts"], plan["lengths"], plan["bounds"]
        self.plan_summary, self.plan_from = plan["summary"], plan.get("from")

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def summary(self, block_size: int, split_long: bool) -> str:
        line = summary_line(self.plan_summary["pieces"], len(self), self.plan_summary["tokens"],
                            self.plan_summary["cut"], block_size, split_long)
        return line + (f" (the plan read from {self.plan_from})" if self.plan_from else "")

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels, positions = [], [], []
        for start, length in zip(self.starts[self.bounds[i] : self.bounds[i + 1]].tolist(),
                                 self.lengths[self.bounds[i] : self.bounds[i + 1]].tolist()):
            piece = torch.from_numpy(self.tokens[start : start + length].astype(np.int64))
            target = torch.full_like(piece, IGNORE_INDEX)
            target[:-1] = piece[1:]
            if self.masks is not None:
                counts = torch.from_numpy(self.masks[start + 1 : start + length].astype(np.bool_))
                target[:-1] = target[:-1].masked_fill(~counts, IGNORE_INDEX)
            ids.append(piece)
            labels.append(target)
            positions.append(torch.arange(length))
        sample = {"input_ids": torch.cat(ids), "labels": torch.cat(labels)}
        if self.pack:
            sample["position_ids"] = torch.cat(positions)
        return sample


class PreparedPairs(Dataset):
    """The preference pairs of a prepared split (three documents each: prompt, chosen, rejected), read per sample
    and fitted to block_size as every data option fits them (src/data/preference.py: fitted), numbered from
    `first_index`. Only the documents' ends are read at start, 24 bytes a pair."""

    def __init__(self, tokens: Concatenated, ends: np.ndarray, block_size: int, long_pairs: LongPairs,
                 first_index: int = 0):
        self.tokens, self.ends, self.block_size, self.long_pairs = tokens, ends, block_size, long_pairs
        self.first_index = first_index
        lengths = np.diff(ends, prepend=0).reshape(-1, 3)
        fits = lengths[:, 0] + lengths[:, 1:].max(axis=1) <= block_size
        self.kept = np.flatnonzero(fits) if long_pairs == "drop" else None  # the pairs' numbers in the split
        self.counts = {"dropped" if long_pairs == "drop" else "truncated": int((~fits).sum())}

    def __len__(self) -> int:
        return len(self.ends) // 3 if self.kept is None else len(self.kept)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        pair = int(self.kept[i]) if self.kept is not None else i
        bounds = [int(self.ends[3 * pair - 1]) if pair else 0, *self.ends[3 * pair : 3 * pair + 3].tolist()]
        ids = tuple(self.tokens[begin:end].astype(np.int64).tolist() for begin, end in zip(bounds, bounds[1:]))
        return pair_sample(*fitted(ids, self.block_size, self.long_pairs), self.first_index + i)


class ShardData(WindowStream):
    """A folder of prepared token shards (scripts/prepare_data.py). By default windows of block_size tokens across
    documents, as data=tokens cuts them, over every training shard end to end; with data.packing=true whole
    documents packed into blocks, each attending to itself only; with false one document per sample, padded.
    Validation is the documents the preparation held out. With label masks (prompt/completion, chats), the masked
    tokens are no targets. Targets are the next tokens already (objective=cross_entropy, the default). With
    data.sources instead of data.path, several folders (one tokenizer) read alike, mixed by weight."""

    def __init__(
        self,
        path: Annotated[Optional[str], Arg("a folder of token shards that scripts/prepare_data.py wrote (null: "
                                           "data.sources)")] = None,
        sources: Annotated[Optional[list], Arg(
            "several prepared folders in one run instead of data.path, each a mapping {path: FOLDER, weight: W}: "
            "an epoch draws from each in proportion to its weight (the same tokenizer for all; every other key "
            "is the run's)")] = None,
        samples_per_epoch: Annotated[Optional[int], Arg(
            "with data.sources: the samples an epoch draws (null: as many as the sources hold together)", ge=1)
        ] = None,
        packing: Annotated[Union[bool, Literal["cross_document"]], Arg(
            "cross_document: windows of block_size across documents (pretraining); true: whole documents packed "
            "into blocks of block_size, each attending to itself only (trains as padded documents do); false: one "
            "document per sample, padded. With preference: true packs each batch's answers (TRL's padding_free), "
            "the others pad them")] = "cross_document",
        long_documents: Annotated[Literal["truncate", "split"], Arg(
            "with packing true or false, a document longer than block_size is truncated to it, or (packing=true) "
            "split into documents of block_size")] = "truncate",
        preference: Annotated[bool, Arg(
            "the folder holds preference pairs (scripts/prepare_data.py --preference), for objective=dpo/simpo/orpo; "
            "each pair is fitted to block_size as it is read")] = False,
        long_pairs: LongPairsArg = "truncate",
        **stream,
    ):
        super().__init__(**stream)
        if (path is None) == (sources is None):
            raise UsageError("data=shards reads data.path (a prepared folder) or data.sources (several, each "
                             "{path: FOLDER, weight: W}): give one of them" + (", not both" if path else ""))
        if sources is not None:
            self._mix(sources, samples_per_epoch, stream, packing=packing, long_documents=long_documents,
                      preference=preference, long_pairs=long_pairs)
            return
        if samples_per_epoch is not None:
            raise UsageError("data.samples_per_epoch is for data.sources (an epoch of one folder is all of it)")
        self.folder = Path(path).expanduser()
        self.manifest = read_manifest(self.folder)
        if preference or self.manifest.get("sample", "").startswith("preference pairs"):
            self._read_pairs(path, preference, packing, long_pairs)
            return
        whole = packing != "cross_document"
        if whole and (self.random_offset or self.random_windows):
            raise UsageError(f"data.packing={str(packing).lower()} keeps documents whole; data.random_offset and "
                             "data.random_windows move windows across documents (data.packing=cross_document)")
        if long_documents == "split" and packing is not True:
            raise UsageError("data.long_documents=split is for data.packing=true (one document per sample is "
                             "truncated to block_size; cross_document windows cut every document at block edges)")
        (train, train_masks), (val, val_masks) = (open_split(self.folder, self.manifest, s) for s in SPLITS)
        if whole:
            split_long = long_documents == "split"
            self.train, self.val = (
                PackedDocuments(tokens, masks, cached_packing_plan(self.folder, self.manifest, split, self.block_size,
                                                                   pack=packing is True, split_long=split_long),
                                pack=packing is True)
                for split, tokens, masks in (("train", train, train_masks), ("validation", val, val_masks)))
            self.collate_fn = pad_packed if packing is True else functools.partial(pad_right, pad_id=0)
            self.attends_per_document = packing is True  # the model must read documents from position_ids
            from accelerate import PartialState

            if packing is True and PartialState().is_main_process:
                for name, blocks in (("training", self.train), ("validation", self.val)):
                    log.info("data.packing=true, %s: %s", name, blocks.summary(self.block_size, split_long))
        else:
            self.train = MaskedWindows(train, train_masks, self.block_size, random_offset=self.random_offset,
                                       seed=self.seed, random_windows=self.random_windows)
            self.val = MaskedWindows(val, val_masks, self.block_size)
        for name, samples in (("training", self.train), ("validation", self.val)):
            if len(samples) == 0:
                raise UsageError(f"data.path={path}: its {name} split holds {len(samples.tokens)} tokens, no "
                                 + ("document" if whole else f"window of data.block_size={self.block_size}"))
        self.codec = Codec.load(self.folder)
        self.source_files = self._files_read(("", *((".loss",) if self.manifest["loss_masks"] else ()),
                                              *((".index",) if whole else ())))

    def _files_read(self, suffixes: tuple[str, ...]) -> dict[str, Path]:
        """The files a run reads, for its data fingerprint: the manifest (it holds each shard's digest from the
        preparation; file_digest samples each file's content) and the shards' files with these suffixes."""
        return {MANIFEST: self.folder / MANIFEST, **{
            shard["file"] + suffix: self.folder / (shard["file"] + suffix)
            for split in SPLITS for shard in self.manifest["splits"][split] for suffix in suffixes}}

    def _read_pairs(self, path: str, preference: bool, packing: Union[bool, str], long_pairs: LongPairs) -> None:
        sample = self.manifest.get("sample", "documents")
        if not preference:
            raise UsageError(f"data.path={path} holds preference pairs (prepared with --preference): train on them "
                             "with data.preference=true and objective=dpo, simpo or orpo")
        if sample != PAIR_SAMPLE:
            raise UsageError(f"data.path={path} holds {sample.split(' (')[0]}, "
                             + ("prepared by another rule than this template's: prepare the folder again"
                                if sample.startswith("preference pairs") else
                                "not preference pairs: prepare the pairs with scripts/prepare_data.py SOURCE OUT "
                                "--preference"))
        if self.random_offset or self.random_windows:
            raise UsageError("data.random_offset and data.random_windows are for documents; preference pairs "
                             "(data.preference=true) are read whole, each pair's answers side by side")
        (train, _), (val, _) = (open_split(self.folder, self.manifest, split) for split in SPLITS)
        ends = {split: document_ends(self.folder, self.manifest, split) for split in SPLITS}
        self.train = PreparedPairs(train, ends["train"], self.block_size, long_pairs)
        self.val = PreparedPairs(val, ends["validation"], self.block_size, long_pairs, first_index=len(self.train))
        from accelerate import PartialState

        for name, pairs in (("training", self.train), ("validation", self.val)):
            if len(pairs.ends) == 0:
                raise UsageError(f"data.path={path}: its {name} split holds no preference pair; prepare it again "
                                 f"with a {'larger' if name == 'validation' else 'smaller'} --val-fraction (the "
                                 "share of the rows held out)")
            if len(pairs) == 0:
                raise UsageError(f"data.path={path}: no {name} preference pair fits data.block_size={self.block_size} "
                                 f"(data.long_pairs={long_pairs}: use truncate, or a larger block)")
            if PartialState().is_main_process:
                report(pairs.counts, len(pairs), self.block_size, f"data.path={path}, {name}")
        self.collate_fn = pair_collator(packing, self.block_size)
        self.attends_per_document = packing is True  # packed answers: the model reads them from position_ids
        self.codec = Codec.load(self.folder)
        self.source_files = self._files_read(("", ".index"))

    def _mix(self, sources: list, samples_per_epoch: Optional[int], stream: dict, **shared) -> None:
        """data.sources: each folder read as data.path reads one, with the run's keys; an epoch draws from each in
        proportion to its weight, in orders computed as they go (src/data/mixture.py: MixedSamples)."""
        from accelerate import PartialState

        from src.data.mixture import MixedSamples, shares, weighted_sources

        parts, weights = [], []
        checked = weighted_sources(sources, ("path", "weight"), "every other key is the run's")
        for i, (source, weight) in enumerate(checked):
            try:
                parts.append(ShardData(path=str(source["path"]), **shared, **stream))
            except UsageError as error:
                raise UsageError(f"data.sources[{i}] ({source['path']}): {error}") from None
            weights.append(weight)
        for i, part in enumerate(parts[1:], 1):
            if part.manifest["tokenizer"] != parts[0].manifest["tokenizer"]:
                raise UsageError(f"data.sources[{i}] ({sources[i]['path']}) was prepared with another tokenizer than "
                                 f"data.sources[0] ({sources[0]['path']}): the same ids would mean other tokens; "
                                 "prepare every source with one tokenizer (scripts/prepare_data.py --tokenizer)")
        if shared["preference"]:  # every pair its own number (a precomputed reference's table)
            numbered = [part.train for part in parts] + [part.val for part in parts]
            for before, pairs in zip(numbered, numbered[1:]):
                pairs.first_index = before.first_index + len(before)
        total = samples_per_epoch or sum(len(part.train) for part in parts)
        counts = shares(weights, total)
        self.train = MixedSamples([part.train for part in parts], counts, self.seed)
        self.val = torch.utils.data.ConcatDataset([part.val for part in parts])
        self.manifest, self.codec, self.collate_fn = parts[0].manifest, parts[0].codec, parts[0].collate_fn
        self.attends_per_document = parts[0].attends_per_document
        self.paths = [str(source["path"]) for source in sources]
        self.windows = isinstance(parts[0].train, MaskedWindows)  # every sample block_size tokens
        self.source_files = {f"source {i} {name}": file for i, part in enumerate(parts)
                             for name, file in part.source_files.items()}
        for i, (part, count) in enumerate(zip(parts, counts) if PartialState().is_main_process else []):
            log.info("data.sources[%d] %s: weight %g, %d of an epoch's %d samples (%.1f%%; it holds %d)", i,
                     self.paths[i], weights[i], count, total, 100 * count / total, len(part.train))

    def consumed(self, loader, state, epoch_samples: Optional[int]) -> dict[str, int]:
        """data.sources: the samples each source gave the run (windows of block_size tokens, or documents, blocks
        or pairs), from the run's order of every epoch so far: no sample is read."""
        from accelerate import PartialState

        if not hasattr(self, "paths") or not PartialState().is_main_process or loader.dataset is not self.train:
            return {}
        samples = np.zeros(len(self.paths), dtype=np.int64)
        order = self.train_sampler(self.train)  # the run's order: a function of (seed, epoch) alone
        for epoch in range(state.epoch + 1):
            order.set_epoch(epoch)
            taken = epoch_samples if epoch < state.epoch else state.samples_into_epoch
            samples += self.train.samples_by_source(
                np.fromiter(itertools.islice(iter(order), taken), dtype=np.int64, count=taken))
        unit = f"windows of {self.block_size} tokens" if self.windows else "samples"
        return {f"{unit} from data.sources[{i}] ({path})": int(n) for i, (path, n) in enumerate(zip(self.paths,
                                                                                                   samples))}

    def train_sampler(self, dataset) -> Permutation:
        # Millions of windows: an order computed as the loader goes, not a list of the epoch (src/data/sampling.py).
        return Permutation(len(dataset), self.seed)

    @model_size
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def fingerprint(self) -> dict:
        found = {**super().fingerprint(), "vocabulary": self.manifest["tokenizer"]}
        if hasattr(self, "paths"):  # data.sources: how an epoch shares itself among them (weights, epoch size)
            found["samples an epoch draws from each source"] = list(self.train.counts)
        return found

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)
