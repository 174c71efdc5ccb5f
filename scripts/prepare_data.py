"""Tokenize a corpus once, on several processes, into token shards that `data=shards` reads memory-mapped.

    python scripts/prepare_data.py data/shakespeare_speeches.jsonl data/speeches_shards --tokenizer byte --workers 2
    accelerate launch train.py data=shards data.path=data/speeches_shards

SOURCE is what data=hf_dataset reads (a Parquet, JSON Lines, CSV or Arrow file, a folder of them, a save_to_disk
folder, a hub dataset id) and --tokenizer what its data.tokenizer takes; prompt/completion (--prompt-column) and
chat data keep their label masks. Whole documents are held out for validation (--val-fraction). Started again after
a kill, it skips the tasks it finished. With --preference, each row is a preference pair in TRL's format (columns
chosen, rejected and prompt, or a prompt implicit in their shared start; strings or conversations), tokenized as
data.preference=true tokenizes it, for objective=dpo/simpo/orpo on data=shards data.preference=true. Layout and
format: src/data/shards.py. On several nodes, as a SLURM array (each array task takes its share of --tasks; the last
to finish writes the manifest):

    sbatch --array=0-3 slurm/prepare_data.sbatch data/corpus data/corpus_shards --tasks 64

With --cifar10, SOURCE is a folder of CIFAR-10's binary files, written as shards of its records (data=cifar10
data.root=OUT reads them memory-mapped).
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from src.data.prepare import Source, prepare, prepare_cifar10  # noqa: E402
from src.errors import UsageError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="what data.path of data=hf_dataset names")
    parser.add_argument("out", type=Path, help="the folder to write the shards into")
    parser.add_argument("--cifar10", action="store_true", help="SOURCE is a folder of CIFAR-10's binary files: "
                                                                    "its records as shards (data=cifar10 reads them)")
    parser.add_argument("--tokenizer", default="byte", help="byte, a tokenizers JSON file, or a from_pretrained "
                                                            "folder or hub id holding one")
    parser.add_argument("--tokenizer-revision")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--prompt-column")
    parser.add_argument("--preference", action="store_true",
                        help="rows are preference pairs (prompt, chosen, rejected), not documents")
    parser.add_argument("--split", default="train")
    parser.add_argument("--subset")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenizing at once")
    parser.add_argument("--tasks", type=int, help="files per split, each a contiguous share of the rows "
                                                  "(default: --workers)")
    parser.add_argument("--no-fast-bpe", dest="fast_bpe", action="store_false",
                        help="tokenize plain text with tokenizers alone (by default a byte-level BPE's plain text goes "
                             "through tiktoken, 3x faster, the same ids, checked against tokenizers as it goes)")
    parser.add_argument("--pack-for", type=int, nargs="+", default=[], metavar="BLOCK_SIZE",
                        help="save the data.packing=true plan for these block sizes with the shards, so that a run's "
                             "first start maps it instead of reading every document's end (later starts do anyway)")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="the share of documents held out")
    parser.add_argument("--seed", type=int, default=0, help="which documents are held out")
    parser.add_argument("--node", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)),
                        help="this node's number, from 0 (default: $SLURM_ARRAY_TASK_ID, else 0)")
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1)),
                        help="nodes sharing the tasks (default: $SLURM_ARRAY_TASK_COUNT, else 1)")
    args = parser.parse_args()
    if not 0 <= args.node < args.nodes:
        parser.error(f"--node={args.node} of --nodes={args.nodes}: from 0 to {args.nodes - 1}")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction={args.val_fraction}: between 0 and 1, both excluded")
    if args.workers < 1 or (args.tasks is not None and args.tasks < 1):
        parser.error("--workers and --tasks: at least 1")
    if any(size < 1 for size in args.pack_for):
        parser.error(f"--pack-for {' '.join(map(str, args.pack_for))}: block sizes of at least 1 token")
    if args.preference and (args.text_column != "text" or args.prompt_column is not None):
        parser.error("--preference reads the columns chosen, rejected and prompt (TRL's names); --text-column and "
                     "--prompt-column are for documents")
    if args.cifar10:
        try:
            manifest = prepare_cifar10(Path(args.source), args.out)
        except UsageError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        images = {split: sum(shard["documents"] for shard in shards) for split, shards in manifest["splits"].items()}
        print(f"wrote {args.out} ({images['train']:,} training and {images['validation']:,} validation images); "
              f"train on it with data=cifar10 data.root={args.out}")
        return 0
    source = Source(args.source, args.tokenizer, args.tokenizer_revision, args.text_column, args.prompt_column,
                    args.split, args.subset, args.preference)
    try:
        manifest = prepare(source, args.out, args.workers, args.tasks, args.val_fraction, args.seed, args.node,
                           args.nodes, args.fast_bpe, args.pack_for)
    except (UsageError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if manifest is None:
        print(f"node {args.node} of {args.nodes}: its tasks are done; the node that finishes the last task writes "
              f"{args.out}/manifest.json")
        return 0
    for split, shards in manifest["splits"].items():
        tokens = sum(shard["tokens"] for shard in shards)
        if not sum(shard["documents"] for shard in shards):
            print(f"warning: the {split} split is empty, and a run on {args.out} is refused: prepare again with a "
                  f"{'larger' if split == 'validation' else 'smaller'} --val-fraction", file=sys.stderr)
        if args.preference:
            pairs, empty = (sum(shard[key] for shard in shards) for key in ("pairs", "pairs without an answer token"))
            print(f"{split}: {pairs:,} pairs, {tokens:,} tokens, {len(shards)} files"
                  + (f"; {empty:,} pairs without an answer token left out" if empty else ""))
            continue
        documents = sum(shard["documents"] for shard in shards)
        print(f"{split}: {tokens:,} tokens in {documents:,} documents, {len(shards)} files")
    tasks = manifest["splits"]["train"]
    by_twin = sum(task.get("encoder") == "tiktoken" for task in tasks)
    if by_twin:
        checked = sum(task["documents checked against tokenizers"] for split in manifest["splits"].values()
                      for task in split if task.get("encoder") == "tiktoken")
        print(f"{by_twin} of {len(tasks)} tasks tokenized by tiktoken ({checked:,} documents checked against "
              "tokenizers: the same ids)")
    for why in sorted({task["why"] for task in tasks if task.get("encoder") == "tokenizers"}):
        print(f"tokenized by tokenizers: {why}")
    print(f"wrote {args.out} ({manifest['dtype']} ids, vocabulary {manifest['vocab_size']:,}); train on it with "
          f"data=shards data.path={args.out}" + (" data.preference=true objective=dpo" if args.preference else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
