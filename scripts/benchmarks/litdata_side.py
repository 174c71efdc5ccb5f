"""litdata's side of the data benchmark's library comparison (BENCHMARKS.md, "Choosing the data library"): the
same JSON Lines corpus tokenized by the same tokenizer with litdata's `optimize` (TokensLoader chunks) on N workers,
then read back by its StreamingDataset in windows. Run with an interpreter that has litdata and tokenizers (it needs
nothing else of this repository), beside `scripts/prepare_data.py` on the same corpus:

    python scripts/benchmarks/litdata_side.py CORPUS.jsonl TOKENIZER.json OUT --workers 2

Prints one JSON line: tokens, seconds and tokens/s of the preparation (the whole call, start-up included), bytes
per token on disk, and the reader's tokens/s over its first windows.
"""

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path


def line_ranges(corpus: Path, pieces: int) -> list[tuple[str, int, int]]:
    """The corpus cut into `pieces` byte ranges at line ends: litdata's inputs, one per task."""
    size = corpus.stat().st_size
    cuts = [0]
    with open(corpus, "rb") as file:
        for k in range(1, pieces):
            file.seek(k * size // pieces)
            file.readline()
            cuts.append(file.tell())
    cuts.append(size)
    return [(str(corpus), a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def tokenize(piece: tuple[str, int, int], tokenizer_file: str):
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_file)
    path, start, stop = piece
    with open(path, "rb") as file:
        file.seek(start)
        lines = file.read(stop - start).decode().splitlines()
    for first in range(0, len(lines), 1000):  # the batch path, as scripts/prepare_data.py uses it
        texts = [json.loads(line)["text"] for line in lines[first : first + 1000]]
        for encoding in tokenizer.encode_batch(texts):
            yield torch.tensor(encoding.ids, dtype=torch.int32)


def main() -> None:
    from litdata import StreamingDataset, TokensLoader, optimize

    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("tokenizer")
    parser.add_argument("out", type=Path)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--windows", type=int, default=20_000)
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // args.workers)))
    started = time.time()
    optimize(fn=partial(tokenize, tokenizer_file=args.tokenizer), inputs=line_ranges(args.corpus, 4 * args.workers),
             output_dir=str(args.out), chunk_bytes="64MB", item_loader=TokensLoader(), num_workers=args.workers)
    seconds = time.time() - started
    on_disk = sum(f.stat().st_size for f in args.out.rglob("*.bin"))
    dataset = StreamingDataset(str(args.out), item_loader=TokensLoader(block_size=args.block_size + 1), shuffle=True)
    tokens = len(dataset) * (args.block_size + 1)
    started_reading, read = time.perf_counter(), 0
    for window, _ in zip(dataset, range(args.windows)):
        read += window.numel()
    reading = time.perf_counter() - started_reading
    print(json.dumps({"workers": args.workers, "tokens_at_least": tokens, "seconds": round(seconds, 1),
                      "bytes_per_token_int32": round(on_disk / max(tokens, 1), 2),
                      "tokens_per_s": round(tokens / seconds), "reader_tokens_per_s": round(read / reading)}))


if __name__ == "__main__":
    main()
