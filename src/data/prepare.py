"""Tokenizing a corpus once, on several processes, into the token shards of src/data/shards.py.

datatrove runs the tasks (its LocalPipelineExecutor: a pool of worker processes, and completion markers, so that a
killed preparation started again skips the tasks it finished) and writes its token files; each task tokenizes a
contiguous slice of the source's rows by the rule every data option follows (src/data/jsonl.py:
tokenized_documents), so prompt/completion and chat data keep their label masks as data=hf_dataset gives them.
Preference pairs (`preference`) are tokenized by their own rule (src/data/preference.py: tokenized_pair), each
pair three documents in a row: its prompt, its chosen answer, its rejected answer.
"""

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from src.checkpointing.checksums import whole_file_digest
from src.data import preference as pairs
from src.data.fast_bpe import CheckedTwin, TwinDiffers, tiktoken_twin
from src.data.jsonl import IGNORE_INDEX, tokenized_documents
from src.data.shards import FORMAT, MANIFEST, PAIR_SAMPLE, SPLITS, cached_packing_plan, token_dtype
from src.data.text import _mix
from src.data.tokenizer import codec_for
from src.errors import UsageError

log = logging.getLogger(__name__)
KEYS = {"path": "SOURCE", "subset": "--subset", "split": "--split", "val_split": "--split"}  # in _load's messages
RECORDS = "tasks"  # one JSON per finished task and split: its file's tokens, documents and digests


@dataclass
class Source:
    """What data=hf_dataset reads (its keys, the same names), and the tokenizer."""

    path: str
    tokenizer: str = "byte"
    tokenizer_revision: Optional[str] = None
    text_column: str = "text"
    prompt_column: Optional[str] = None
    split: str = "train"
    subset: Optional[str] = None
    preference: bool = False  # rows are preference pairs: prompt (or none), chosen, rejected

    def rows(self) -> Any:
        from src.data.hf_dataset import _load
        from src.models.hub import dataset_path

        rows = _load(dataset_path(self.path, self.subset, refresh=True, key="SOURCE"), self.path, self.split, None,
                     self.subset, KEYS)[self.split]
        if self.preference:
            pairs.missing_columns(rows.column_names, self.path)
            return rows
        for key, column in (("--text-column", self.text_column), ("--prompt-column", self.prompt_column)):
            if column is not None and column not in rows.column_names:
                raise UsageError(f"{key}={column}: {self.path} has no such column; its columns: "
                                 f"{', '.join(rows.column_names)}")
        return rows

    def codec(self):
        if self.tokenizer == "char":
            raise UsageError("--tokenizer char: its vocabulary is the characters of the whole corpus, which no task "
                             "sees; use --tokenizer byte or a tokenizer")
        return codec_for(self.tokenizer, revision=self.tokenizer_revision, key="--tokenizer")


def held_out(row: int, seed: int, val_fraction: float) -> bool:
    """Whether a row (a whole document) validates: a hash of its index, so any split of the rows into tasks agrees."""
    return _mix(seed * 1_000_003 + row) % 1_000_000 < val_fraction * 1_000_000


@dataclass
class TokenizeTask:
    """One preparation task (a datatrove pipeline step): rows [start, stop) of the source, which datatrove's rank
    and world size pick, tokenized into one token file per split."""

    source: Source
    out: str
    val_fraction: float
    seed: int
    batch_rows: int = 1000
    fast_bpe: bool = True  # plain text through tiktoken where it twins the tokenizer (src/data/fast_bpe.py)
    check_every: int = 32  # the twin's documents compared with tokenizers' ids: one in check_every

    def __call__(self, data: Any, rank: int = 0, world_size: int = 1) -> None:
        rows, codec = self.source.rows(), self.source.codec()
        paired = self.source.preference
        masks = not paired and (self.source.prompt_column is not None
                                or _holds_conversations(rows, self.source.text_column))
        share, extra = divmod(len(rows), world_size)
        start = rank * share + min(rank, extra)
        stop = start + share + (rank < extra)
        twin, why = None, "prompts and chats need tokenizers' offsets" if masks else "--no-fast-bpe"
        if paired:
            why = "preference pairs: tokenized as data.preference=true tokenizes them"
        elif self.fast_bpe and not masks and codec.kind == "tokenizer":
            twin, why = tiktoken_twin(codec.tokenizer)
        files, counts = None, {}
        encoder = {"encoder": "tokenizers", "why": why} if codec.kind == "tokenizer" else {"encoder": codec.kind}
        if paired:
            files, counts = self._tokenize_pairs(rows, codec, start, stop, rank)
        elif twin is not None:
            checked = CheckedTwin(twin, codec, self.check_every)
            try:
                files = self._tokenize(rows, checked, codec, masks, start, stop, rank)
                encoder = {"encoder": "tiktoken", "documents checked against tokenizers": checked.checked}
            except TwinDiffers as differs:  # the whole task again: the twin's earlier documents were not all checked
                log.warning("task %d: tiktoken differs from the tokenizer (%s); tokenizing with tokenizers alone",
                            rank, differs)
                encoder = {"encoder": "tokenizers", "why": f"tiktoken differed: {differs}"}
        if files is None:
            files = self._tokenize(rows, codec, codec, masks, start, stop, rank)
        records = Path(self.out) / RECORDS
        records.mkdir(exist_ok=True)
        for split, file in files.items():
            file.close()
            path = Path(self.out) / file.filename
            record = {"file": path.name, "tokens": len(file), "documents": len(file.doc_ends), "rows": [start, stop],
                      "digest": whole_file_digest(path), **encoder}
            if masks:
                record["loss digest"] = whole_file_digest(path.with_name(path.name + ".loss"))
            if paired:
                record.update({"pairs": len(file.doc_ends) // 3, "pairs without an answer token": counts[split]})
            (records / f"{split}_{rank:05d}.json").write_text(json.dumps(record))

    def _tokenize(self, rows: Any, encoder: Any, codec: Any, masks: bool, start: int, stop: int, rank: int) -> dict:
        """Rows [start, stop) into one open token file per split; `encoder` encodes plain text (the codec, or the
        checked twin), `codec` the rest."""
        from datatrove.pipeline.tokens.tokenizer import TokenizedFile

        dtype = token_dtype(codec.vocab_size)
        files = {split: TokenizedFile(self.out, f"{split}_{rank:05d}.ds", save_index=True, save_loss_metadata=masks,
                                      token_size=dtype.itemsize) for split in SPLITS}
        try:
            for first in range(start, stop, self.batch_rows):
                batch = rows[first : min(stop, first + self.batch_rows)]
                texts = batch[self.source.text_column]
                prompts = batch[self.source.prompt_column] if self.source.prompt_column else None
                validates = [held_out(first + i, self.seed, self.val_fraction) for i in range(len(texts))]
                for split in SPLITS:
                    keep = [i for i, held in enumerate(validates) if held == (split == "validation")]
                    ids, labels = tokenized_documents(encoder, [texts[i] for i in keep],
                                                      [prompts[i] for i in keep] if prompts is not None else None)
                    for n, document in enumerate(ids):
                        files[split].write_bytes(np.asarray(document, dtype=dtype).tobytes())
                        if masks:  # prompts and chats: labels, -100 where a token is no target
                            trained = np.asarray(labels[n]) != IGNORE_INDEX
                            files[split].write_loss_bytes(trained.astype(np.uint8).tobytes())
        except TwinDiffers:
            for file in files.values():
                file.close()  # the files are opened anew ("wb") by the run without the twin
            raise
        return files

    def _tokenize_pairs(self, rows: Any, codec: Any, start: int, stop: int, rank: int) -> tuple[dict, dict]:
        """Rows [start, stop) of preference pairs into one open token file per split, three documents a pair
        (prompt, chosen, rejected; a prompt may be empty), whole: data.block_size is the run's to apply. A pair
        whose answers lack a token is left out (it has nothing to compare), and counted."""
        from datatrove.pipeline.tokens.tokenizer import TokenizedFile

        dtype = token_dtype(codec.vocab_size)
        files = {split: TokenizedFile(self.out, f"{split}_{rank:05d}.ds", save_index=True, token_size=dtype.itemsize)
                 for split in SPLITS}
        empty = dict.fromkeys(SPLITS, 0)
        for first in range(start, stop, self.batch_rows):
            batch = rows[first : min(stop, first + self.batch_rows)]
            prompts = batch["prompt"] if "prompt" in batch else [None] * len(batch["chosen"])
            for i, (prompt, chosen, rejected) in enumerate(zip(prompts, batch["chosen"], batch["rejected"])):
                split = "validation" if held_out(first + i, self.seed, self.val_fraction) else "train"
                pair = pairs.tokenized_pair(codec, prompt, chosen, rejected)
                if not pair[1] or not pair[2]:
                    empty[split] += 1
                    continue
                for ids in pair:
                    files[split].write_bytes(np.asarray(ids, dtype=dtype).tobytes())
        return files, empty


def _holds_conversations(rows: Any, column: str) -> bool:
    return len(rows) > 0 and isinstance(rows[0][column], list)


def prepare(source: Source, out: Path, workers: int = 1, tasks: Optional[int] = None, val_fraction: float = 0.01,
            seed: int = 0, node: int = 0, nodes: int = 1, fast_bpe: bool = True,
            pack_for: Sequence[int] = ()) -> Optional[dict]:
    """Tokenize `source` into `out` on `workers` processes, `tasks` files per split (default: one per worker);
    with `nodes` > 1 (a SLURM array), this node's share of the tasks only. `fast_bpe`: plain text through
    tiktoken where it twins the tokenizer (the same ids, checked as it goes). `pack_for`: block sizes whose
    data.packing=true plan is saved with the shards, so that no run's start reads the document index. The
    manifest is written by whichever node finds every task finished at its end, from the tasks' records;
    returned, or None while tasks remain."""
    from datatrove.executor import LocalPipelineExecutor

    tasks = tasks or workers
    if nodes > tasks:
        raise UsageError(f"--tasks={tasks} for {nodes} nodes: give each node a task at least (--tasks={nodes})")
    settings = {"source": vars(source), "val_fraction": val_fraction, "seed": seed, "tasks": tasks}
    settings_file = out / "preparation.json"
    if settings_file.is_file() and json.loads(settings_file.read_text()) != settings:
        raise UsageError(f"{out}: prepared with other settings ({settings_file}); give another output folder, or "
                         "remove this one")
    # A bad path, column or tokenizer is named before anything is written: the settings file would hold the typo,
    # and the command corrected would be refused as "other settings".
    codec = source.codec()
    rows = source.rows()
    if source.preference:
        if pack_for:
            raise UsageError("--pack-for saves the packing plan of documents; preference pairs need none (with "
                             "data.packing=true each batch's answers are packed as it is read)")
        if len(rows) and isinstance(rows[0]["chosen"], list) and codec.chat is None:
            raise UsageError(f"--tokenizer {source.tokenizer}: {source.path} holds conversations, which need a "
                             "tokenizer with a chat template (tokenizer_config.json's chat_template)")
    out.mkdir(parents=True, exist_ok=True)
    settings_file.write_text(json.dumps(settings, indent=2))
    task = TokenizeTask(source, str(out), val_fraction, seed, fast_bpe=fast_bpe)
    first, last = node * tasks // nodes, (node + 1) * tasks // nodes  # this node's tasks: [first, last)
    workers = min(workers, last - first)
    # Each worker's tokenizer batches on threads (tokenizers' rayon pool, sized when a process first uses it): this
    # node's CPUs shared among the workers, not each worker's pool as wide as all of them (2 workers of 2 threads
    # on 2 cores ran 1.3x slower than 1 worker). The workers are spawned, so they read it from the environment.
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
    executor = LocalPipelineExecutor([task], tasks=tasks, workers=workers,
                                     logging_dir=str(out / "logs"), start_method="spawn", local_tasks=last - first,
                                     local_rank_offset=first)
    executor.run()
    if executor.get_incomplete_ranks(range(tasks)):  # another node's; the last node to finish sees none
        return None
    records = {split: [json.loads((out / RECORDS / f"{split}_{rank:05d}.json").read_text()) for rank in range(tasks)]
               for split in SPLITS}
    codec.save(out)
    manifest = {"format": FORMAT, "dtype": token_dtype(codec.vocab_size).name, "vocab_size": codec.vocab_size,
                "tokenizer": codec.identity(), "loss_masks": (out / f"train_{0:05d}.ds.loss").is_file(),
                "rows": len(rows), **settings, "splits": records}
    if source.preference:
        manifest["sample"] = PAIR_SAMPLE
    (out / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1))
    (out / (MANIFEST + ".tmp")).replace(out / MANIFEST)
    for block_size in pack_for:
        for split in SPLITS:
            cached_packing_plan(out, manifest, split, block_size, pack=True, split_long=False)
    return manifest


def prepare_cifar10(root: Path, out: Path) -> dict:
    """CIFAR-10's binary files as shards of the same format: each record (its label byte, then 3,072 pixel bytes)
    one document of uint8 "tokens", a file per source file (data_batch_* train, test_batch validates), so that
    data=cifar10 reads its images memory-mapped from a folder like any other prepared corpus."""
    from src.data.cifar10 import RECORD_BYTES

    files = {"train": sorted(root.glob("data_batch_*.bin")), "validation": [root / "test_batch.bin"]}
    if not files["train"] or not files["validation"][0].is_file():
        raise UsageError(f"--cifar10 {root}: CIFAR-10's binary files (data_batch_*.bin and test_batch.bin) are not "
                         "there; scripts/make_synthetic_cifar10.py writes a small set in that format")
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, sources in files.items():
        splits[split] = []
        for task, source in enumerate(sources):
            size = source.stat().st_size
            if size % RECORD_BYTES:
                raise UsageError(f"{source}: {size} bytes is not a whole number of {RECORD_BYTES}-byte records")
            name = f"{split}_{task:05d}.ds"
            shutil.copyfile(source, out / name)  # CIFAR's records are already the documents, end to end
            ends = np.arange(RECORD_BYTES, size + 1, RECORD_BYTES, dtype=np.uint64)
            ends.tofile(out / (name + ".index"))
            splits[split].append({"file": name, "tokens": size, "documents": len(ends), "rows": [0, len(ends)],
                                  "digest": whole_file_digest(out / name), "source": source.name})
    manifest = {"format": FORMAT, "dtype": "uint8", "vocab_size": 256, "tokenizer": "none: CIFAR-10 records",
                "sample": "cifar10 record: a label byte, then 3x32x32 pixel bytes (R, G, B planes)",
                "loss_masks": False, "splits": splits}
    (out / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1))
    (out / (MANIFEST + ".tmp")).replace(out / MANIFEST)
    return manifest
