"""data: a corpus prepared once into token shards (scripts/prepare_data.py, data=shards) against data=hf_dataset
tokenizing it at the start of a run.

- Preparation: tokens/s of `scripts/prepare_data.py` with 1 and 2 worker processes (the whole command's wall time,
  start-up included) on a synthetic corpus of `--prepare-tokens` tokens (documents of words drawn from tiny
  Shakespeare), tokenized by a byte-level BPE of 8,192 tokens trained on tiny Shakespeare (or `--tokenizer`), and
  the raw `tokenizers` throughput of that tokenizer on one thread (encode one text at a time, and encode_batch);
  bytes per token on disk.
- Start-up and memory against the corpus size: a run of `python train.py data=shards` (a tiny GPT, one step) on
  shards of `--small` and of `--large` tokens (random ids written as prepared files: what matters is their size),
  from its start to its first optimizer step's TensorBoard event, and its peak resident memory (the summary's);
  beside it data=hf_dataset on the synthetic corpus, the same measure (tokenizing inside the run).
- The loader against the model: the summary's data wait per step (time the loop waited for a batch) of a run at
  the default GPT's shape and block, on the large shards.
- The host's time per GPU-sized step in the loader (in the process, with workers, read ahead by a thread; and
  in the process from a mixture of two folders, data.sources, whose draws compute each source's order), and
  whether the reading thread slows the training thread's own host work (a GPU's kernel launches; a tiny model's
  eager step stands in for them).
- Preference pairs (`--pairs`, data/shakespeare_pairs.jsonl repeated, each prompt numbered): prepared with
  --preference on 1 and 2 workers (pairs and tokens a second, bytes a pair), and a SimPO run's start to its first
  step on them against data=hf_dataset data.preference=true on the same file.
Each figure is one run, side by side in one invocation; the machine is named in scripts/BENCHMARKS.md.
"""

import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.benchmarks.common import ROOT, one_document_shards, run, scalars

TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=256"]


def bpe_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(ROOT / "data" / "tinyshakespeare.txt")], trainers.BpeTrainer(
        vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    tokenizer.save(str(path))
    return path


def synthetic_corpus(path: Path, characters: int, seed: int = 0) -> Path:
    """Documents of 20 to 400 words drawn from tiny Shakespeare's words, `characters` of text in all."""
    words = (ROOT / "data" / "tinyshakespeare.txt").read_text().split()
    rng = random.Random(seed)
    written = 0
    with open(path, "w") as out:
        while written < characters:
            text = " ".join(rng.choices(words, k=rng.randint(20, 400)))
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text)
    return path


def tokenizer_throughput(tokenizer_file: Path, corpus: Path, documents: int = 20_000) -> dict:
    from tokenizers import Tokenizer

    from src.data.fast_bpe import tiktoken_twin

    os.environ["RAYON_NUM_THREADS"] = "1"  # read when the pool starts: one thread, as one worker would
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    with open(corpus) as lines:
        texts = [json.loads(line)["text"] for line, _ in zip(lines, range(documents))]
    started = time.perf_counter()
    tokens = sum(len(tokenizer.encode(text).ids) for text in texts)
    one_by_one = tokens / (time.perf_counter() - started)
    started = time.perf_counter()
    ids = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    batch = tokens / (time.perf_counter() - started)
    report = {"encode_tokens_per_s": round(one_by_one), "encode_batch_tokens_per_s": round(batch),
              "characters_per_token": round(sum(map(len, texts)) / tokens, 2)}
    twin, why = tiktoken_twin(tokenizer)  # what the preparation encodes plain text with, where it can
    if twin is None:
        return {**report, "tiktoken twin": why}
    started = time.perf_counter()
    twins = twin.encode_batch(texts)
    return {**report, "tiktoken_twin_tokens_per_s": round(tokens / (time.perf_counter() - started)),
            "tiktoken_twin_same_ids": twins == ids}


def synthetic_shards(folder: Path, tokens: int, vocab: int = 8192, files: int = 4) -> Path:
    """A prepared folder of `tokens` random ids (uint16), as scripts/prepare_data.py lays it out."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {"train": [], "validation": []}
    for split, count in (("train", tokens), ("validation", max(tokens // 1000, 100_000))):
        for task in range(files):
            name, size = f"{split}_{task:05d}.ds", count // files
            with open(folder / name, "wb") as out:
                for start in range(0, size, 1 << 24):
                    rng.integers(0, vocab, min(1 << 24, size - start), dtype=np.uint16).tofile(out)
            written[split].append((name, size))
    return one_document_shards(folder, written, vocab, "synthetic", "synthetic")


def first_step(overrides: list[str], tmp: Path) -> dict:
    run_dir = tmp / f"run_{time.monotonic_ns()}"
    started = time.time()
    run([sys.executable, "train.py", *overrides, "trainer.log_every=1", "trainer.eval_every=0",
         "trainer.eval_batches=1", "trainer.checkpoint_every=0", f"hydra.run.dir={run_dir}"],
        env={**os.environ, "TQDM_DISABLE": "1"})
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = summary["peak_memory_gib"]
    return {"first_step_s": round(scalars(run_dir, "train/loss")[0].wall_time - started, 2),
            "rss_before_first_step_gib": round(memory["rss_per_rank_before_the_first_step"][0], 3),
            "peak_rss_gib": round(memory["rss_max_over_ranks"], 3), "summary": summary,
            "data_wait": [event.value for event in scalars(run_dir, "train/data_wait")]}


def training_loader(data):
    """The loader train.py trains from: accelerate's, torchdata's StatefulDataLoader for a stream (which hands each
    batch's stream position over from its worker)."""
    from accelerate import Accelerator

    from src.launch.accelerator import loader_configuration

    accelerator = Accelerator(cpu=True, dataloader_config=loader_configuration(type(data).loader_state))
    return accelerator.prepare(data.train_dataloader())


def loader_tokens_per_s(data, batches: int) -> dict:
    """Tokens/s one process's training loader gives (no model: what it could feed), after its first batch."""
    loader = iter(training_loader(data))
    first = next(loader)
    started, tokens = time.perf_counter(), 0
    for batch, _ in zip(loader, range(batches)):
        inputs = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        tokens += inputs.numel()
    return {"batches": batches, "tokens_per_s": round(tokens / (time.perf_counter() - started)),
            "batch_shape": list((first["input_ids"] if isinstance(first, dict) else first[0]).shape)}


def host_ms_per_step(data, steps: int, micro_batches: int, pause_s: float, read_ahead: bool = False) -> dict:
    """The training process's own time in the loader per optimizer step of `micro_batches` when each step is
    `pause_s` of waiting (a GPU-bound step: the host launches its kernels and waits), what train/data_wait counts:
    the loader's work in this process, or with workers, receiving what they prepared in the pause, or with
    `read_ahead`, taking what train.py's reading thread prepared (src/loop/read_ahead.py). As in train.py, a step's
    micro-batches are freed after the next step's are taken, outside the time counted."""
    import itertools

    import torch

    from src.loop.read_ahead import EpochBatches

    loader = training_loader(data)
    steps = min(steps, len(loader) // micro_batches - 1)  # within one epoch (a small corpus has fewer)
    batches = iter(loader)
    if read_ahead:
        batches = EpochBatches(batches, (steps + 1) * micro_batches, micro_batches, torch.device("cpu"))
    window = list(itertools.islice(batches, micro_batches))
    spent = []
    for _ in range(steps):
        time.sleep(pause_s)
        started = time.perf_counter()
        taken = list(itertools.islice(batches, micro_batches))
        spent.append(time.perf_counter() - started)
        window = taken
    del window
    if read_ahead:
        batches.close()
    spent.sort()
    return {"steps": steps, "micro_batches": micro_batches, "pause_ms": pause_s * 1e3,
            "median_ms": round(spent[len(spent) // 2] * 1e3, 4), "mean_ms": round(sum(spent) / len(spent) * 1e3, 4),
            "worst_ms": round(spent[-1] * 1e3, 3), "median_share_of_step": round(spent[len(spent) // 2] / pause_s, 5)}


def launches_beside_the_reader(prepared: Path, rounds: int, micro_batches: int = 5, period_s: float = 0.139) -> dict:
    """Whether the reading thread of data.read_ahead slows the training thread's own host work. On a GPU that work
    is launching kernels: Python and dispatch, holding the interpreter's lock most of the time, as a tiny model's
    eager step on a CPU does (the template's GPT, 12 layers of width 32: its time is dispatch, not arithmetic).
    Each optimizer step takes its micro-batches (12 x 1,024 from the shards), runs `micro_batches` forward and
    backward passes of that model, and waits out the rest of `period_s` (the GPU's step). Three ways, a step each
    in turn, `rounds` times: no data taken (the host work alone), read in the process, read ahead (the reader reads
    the next step while this one's passes run: the lock shared at its worst). The host work's time off the CPU
    (wall time less the thread's CPU time) is its wait for the lock, steadier than its wall time on a shared VM."""
    import itertools
    import statistics

    import torch

    from src.data.shards import ShardData
    from src.loop.read_ahead import EpochBatches
    from src.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=16, n_layer=12, n_head=2, n_embd=32)
    inputs = torch.randint(0, 256, (2, 16))

    def host_work() -> None:
        for _ in range(micro_batches):
            model(inputs).float().pow(2).mean().backward()

    ways = ("no data", "data.num_workers=0", "data.read_ahead=true")
    batches, held = {}, {}
    for way in ways:
        loader = iter(training_loader(ShardData(path=str(prepared), block_size=1024, batch_size=12,
                                                random_windows=True)))
        if way == "data.read_ahead=true":
            loader = EpochBatches(loader, (rounds + 2) * micro_batches, micro_batches, torch.device("cpu"))
        batches[way], held[way] = loader, list(itertools.islice(loader, micro_batches))
    host_work()
    spent = {way: {"data": [], "host_work": [], "off_cpu": []} for way in ways}
    for round_ in range(rounds):
        for way in ways if round_ % 2 == 0 else ways[::-1]:
            started = time.perf_counter()
            taken = list(itertools.islice(batches[way], micro_batches)) if way != "no data" else []
            read, on_cpu = time.perf_counter(), time.thread_time()
            host_work()
            done, on_cpu = time.perf_counter(), time.thread_time() - on_cpu
            held[way] = taken  # the previous step's batches freed after the next step's are taken, as in train.py
            spent[way]["data"].append(read - started)
            spent[way]["host_work"].append(done - read)
            spent[way]["off_cpu"].append(done - read - on_cpu)
            time.sleep(max(0.0, period_s - (time.perf_counter() - started)))
    batches["data.read_ahead=true"].close()

    def median_ms(values: list[float], digits: int = 2) -> float:
        return round(statistics.median(values) * 1e3, digits)

    report = {"steps_each": rounds, "micro_batches": micro_batches, "period_ms": period_s * 1e3}
    for way, times in spent.items():
        report[way] = {"data_ms": median_ms(times["data"], 3), "host_work_ms": median_ms(times["host_work"]),
                       "host_work_off_cpu_ms": median_ms(times["off_cpu"], 3),
                       "host_ms": median_ms([data + work for data, work in zip(times["data"], times["host_work"])])}
    return report


def as_parquet(corpus: Path, path: Path) -> Path:
    """The JSON Lines corpus as one Parquet file of row groups of 10,000 rows (at least 8 groups: what
    data.reshard splits among workers)."""
    import pyarrow.json
    import pyarrow.parquet

    table = pyarrow.json.read_json(corpus)
    pyarrow.parquet.write_table(table, path, row_group_size=min(10_000, max(1, len(table) // 8)))
    return path


def prepare_timed(source: Path, out: Path, tokenizer: Path, workers: int, *flags: str) -> dict:
    """scripts/prepare_data.py on `workers` workers (two tasks each), timed as a whole command."""
    started = time.time()
    run([sys.executable, "scripts/prepare_data.py", str(source), str(out), "--tokenizer", str(tokenizer),
         "--workers", str(workers), "--tasks", str(2 * workers), *flags])
    seconds = time.time() - started
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(s["tokens"] for split in manifest["splits"].values() for s in split)
    on_disk = sum(f.stat().st_size for f in out.iterdir() if f.name.endswith((".ds", ".ds.index")))
    return {"tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds),
            "bytes_per_token": round(on_disk / tokens, 2)}


def synthetic_pairs(path: Path, pairs: int) -> Path:
    """data/shakespeare_pairs.jsonl's 600 pairs over and over, each prompt numbered (no two pairs alike), as JSON
    Lines: TRL's string form with an explicit prompt."""
    rows = [json.loads(line) for line in (ROOT / "data" / "shakespeare_pairs.jsonl").read_text().splitlines()]
    with path.open("w") as out:
        for i in range(pairs):
            row = rows[i % len(rows)]
            out.write(json.dumps({**row, "prompt": f"{i}. {row['prompt']}"}) + "\n")
    return path


def preference_pairs(tmp: Path, tokenizer: Path, pairs: int) -> dict:
    """Pairs prepared once (--preference, 1 and 2 workers) against data=hf_dataset data.preference=true tokenizing
    them at the start: the preparation's pairs and tokens a second, bytes a pair on disk, and each run's start to
    its first step (a tiny GPT, objective=simpo: no reference, whose pass over every pair would be timed too)."""
    source, report = synthetic_pairs(tmp / "pairs.jsonl", pairs), {}
    for workers in (1, 2):
        out = tmp / f"pairs_{workers}"
        started = time.time()
        run([sys.executable, "scripts/prepare_data.py", str(source), str(out), "--preference", "--tokenizer",
             str(tokenizer), "--workers", str(workers), "--tasks", str(2 * workers)])
        seconds = time.time() - started
        manifest = json.loads((out / "manifest.json").read_text())
        shards = [shard for split in manifest["splits"].values() for shard in split]
        tokens, kept = sum(s["tokens"] for s in shards), sum(s["pairs"] for s in shards)
        on_disk = sum(f.stat().st_size for f in out.iterdir() if f.name.endswith((".ds", ".ds.index")))
        report[f"prepare {pairs:,} pairs, {workers} worker(s)"] = {
            "seconds": round(seconds, 1), "pairs_per_s": round(kept / seconds), "tokens_per_s": round(tokens / seconds),
            "bytes_per_pair": round(on_disk / kept, 1), "tokens_per_pair": round(tokens / kept, 1)}
    simpo = [*TINY, "objective=simpo", "data.preference=true", "data.batch_size=8", "trainer.max_steps=1"]
    for name, overrides in (("data=hf_dataset", ["data=hf_dataset", f"data.path={source}",
                                                 f"data.tokenizer={tokenizer}"]),
                            ("data=shards", ["data=shards", f"data.path={tmp / 'pairs_1'}"])):
        measured = first_step([*simpo, *overrides], tmp)
        report[f"{pairs:,} pairs, {name}: start to the first step"] = {
            key: value for key, value in measured.items() if key not in ("summary", "data_wait")}
    return report


PARTS = ("tokenizer", "prepare", "tiny", "startup", "wait", "wait_gpt2", "loaders", "pairs")


def data(args) -> dict:
    report, parts = {}, args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: {', '.join(unknown)} unknown; choose among {', '.join(PARTS)}")
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        tmp = Path(scratch)
        tokenizer = Path(args.tokenizer) if args.tokenizer else bpe_tokenizer(tmp / "bpe.json")
        # 3.9 characters a token: this BPE gives 3.8 on it, so the corpus holds at least --prepare-tokens
        corpus = synthetic_corpus(tmp / "corpus.jsonl", int(args.prepare_tokens * 3.9))
        if "tokenizer" in parts:
            report["tokenizer"] = {"file": args.tokenizer or "byte-level BPE, 8,192 tokens, trained on tiny "
                                   "Shakespeare", **tokenizer_throughput(tokenizer, corpus)}
        if "prepare" in parts:
            for workers in (1, 2):
                out = tmp / f"prepared_{workers}"
                report[f"prepare, {workers} worker(s)"] = prepare_timed(corpus, out, tokenizer, workers)
                if workers == 2:
                    shutil.rmtree(out)
            out = tmp / "prepared_tokenizers"  # the same, plain text by tokenizers alone (--no-fast-bpe)
            report["prepare, 1 worker(s), tokenizers alone"] = prepare_timed(corpus, out, tokenizer, 1, "--no-fast-bpe")
            shutil.rmtree(out)
        if "tiny" in parts:  # tiny Shakespeare, a line a document: the preparation's fixed costs, a small corpus
            tiny = ROOT / "data" / "tinyshakespeare.txt"
            for workers in (1, 2):
                out = tmp / f"tiny_{workers}"
                report[f"prepare tiny Shakespeare, {workers} worker(s)"] = prepare_timed(tiny, out, tokenizer, workers)
            hf = ["data=hf_dataset", f"data.path={tiny}", f"data.tokenizer={tokenizer}", "objective=causal_lm",
                  "model=hf_causal_lm", "model.config.n_layer=2", "model.config.n_head=2", "model.config.n_embd=64",
                  "model.block_size=256", "data.packing=cross_document", "trainer.max_steps=20"]
            for name, overrides in (("data=hf_dataset", hf), ("data=shards", [*TINY, "data=shards",
                                                                                f"data.path={tmp / 'tiny_1'}",
                                                                                "trainer.max_steps=20"])):
                measured = first_step(overrides, tmp)
                later = sorted(measured["data_wait"][1:])
                report[f"tiny Shakespeare, {name}"] = {
                    "first_step_s": measured["first_step_s"], "peak_rss_gib": measured["peak_rss_gib"],
                    "later_steps_median_data_wait_share": round(later[len(later) // 2], 4) if later else None}
        if "startup" in parts:
            hf = ["data=hf_dataset", f"data.path={corpus}", f"data.tokenizer={tokenizer}", "objective=causal_lm",
                  "model=hf_causal_lm", "model.config.n_layer=2", "model.config.n_head=2", "model.config.n_embd=64",
                  "model.block_size=256", "data.packing=cross_document", "trainer.max_steps=1"]
            report[f"data=hf_dataset on the corpus ({args.prepare_tokens:,} tokens)"] = {
                key: value for key, value in first_step(hf, tmp).items() if key not in ("summary", "data_wait")}
            for name, tokens in (("small", args.small), ("large", args.large)):
                shards = synthetic_shards(tmp / f"shards_{name}", tokens)
                measured = first_step([*TINY, "data=shards", f"data.path={shards}", "trainer.max_steps=1"], tmp)
                report[f"data=shards, {tokens:,} tokens"] = {k: v for k, v in measured.items()
                                                             if k not in ("summary", "data_wait")}
        if "wait" in parts:
            large = tmp / "shards_large"
            if not large.is_dir():
                synthetic_shards(large, args.large)
            shapes = [("default GPT", [], args.steps)]
            if "wait_gpt2" in parts:  # a step of minutes' worth on a CPU: the loader's share at the recipe's shape
                shapes.append(("GPT-2-124M", ["model.n_layer=12", "model.n_head=12", "model.n_embd=768",
                                              "model.block_size=1024", "data.batch_size=4"], 4))
            for shape, overrides, steps in shapes:
                measured = first_step([*overrides, "data=shards", f"data.path={large}", f"trainer.max_steps={steps}",
                                       "data.random_windows=true"], tmp)
                time_s, later = measured["summary"]["time_s"], sorted(measured["data_wait"][1:])
                report[f"data wait, {shape} on the large shards"] = {
                    "steps": steps, "data_wait_s": round(time_s["of which data wait"], 3),
                    "training_s": round(time_s["training"], 3),
                    "first_step_share": round(measured["data_wait"][0], 4),
                    "later_steps_median_share": round(later[len(later) // 2], 4) if later else None,
                    "later_steps_max_share": round(later[-1], 4) if later else None,
                    "tokens_per_s": round(measured["summary"]["tokens_per_second"])}
        if "loaders" in parts:
            from src.data.shards import ShardData
            from src.data.stream import StreamData

            parquet = as_parquet(corpus, tmp / "corpus.parquet")
            prepared = tmp / "prepared_1"
            if not prepared.is_dir():
                run([sys.executable, "scripts/prepare_data.py", str(corpus), str(prepared), "--tokenizer",
                     str(tokenizer)])
            for block, batch in ((256, 32), (1024, 8)):
                shards = ShardData(path=str(prepared), block_size=block, batch_size=batch, random_windows=True)
                report[f"loader, data=shards, block {block}"] = loader_tokens_per_s(shards, 200)
                for source, name, extra in ((corpus, "one JSON Lines file", {}),
                                            (parquet, "one Parquet file, data.reshard=true", {"reshard": True})):
                    for workers in (0, 2):
                        stream = StreamData(path=str(source), block_size=block, batch_size=batch, val_documents=100,
                                            tokenizer=str(tokenizer), num_workers=workers, **extra)
                        report[f"loader, data=stream ({name}), block {block}, {workers} workers"] = (
                            loader_tokens_per_s(stream, 200))
            # The GPU benchmark's step (5 micro-batches of 12 x 1,024, 139 ms on one H100): the host's share of it
            # that the data takes, in the process, with workers, and read ahead by a thread.
            for name, loader in (("0 workers", {}), ("1 workers", {"num_workers": 1}),
                                 ("2 workers", {"num_workers": 2}), ("data.read_ahead=true", {"read_ahead": True})):
                shards = ShardData(path=str(prepared), block_size=1024, batch_size=12, random_windows=True, **loader)
                report[f"host time per step, data=shards, 5 x 12 x 1024, {name}"] = host_ms_per_step(
                    shards, 60, 5, 0.139, read_ahead=loader.get("read_ahead", False))
            for name, loader in (("0 workers", {}), ("data.read_ahead=true", {"read_ahead": True})):
                mixed = ShardData(sources=[{"path": str(prepared), "weight": 3}, {"path": str(prepared), "weight": 1}],
                                  block_size=1024, batch_size=12, random_windows=True, **loader)  # one folder twice
                report[f"host time per step, data=shards data.sources (2 folders), 5 x 12 x 1024, {name}"] = (
                    host_ms_per_step(mixed, 60, 5, 0.139, read_ahead=loader.get("read_ahead", False)))
            report["host work per step beside the reader"] = launches_beside_the_reader(prepared, args.launch_rounds)
        if "pairs" in parts:
            report.update(preference_pairs(tmp, tokenizer, args.pairs))
    return report


def add_commands(commands) -> dict:
    c = commands.add_parser("data", help="token shards prepared once against data=hf_dataset: preparation tokens/s, "
                                         "start-up and memory against the corpus size, the loader's wait")
    c.add_argument("--prepare-tokens", type=int, default=20_000_000, help="tokens of the synthetic corpus prepared")
    c.add_argument("--tokenizer", help="a tokenizers JSON file (default: a BPE trained on tiny Shakespeare)")
    c.add_argument("--small", type=int, default=10_000_000, help="tokens of the small shards")
    c.add_argument("--large", type=int, default=1_000_000_000, help="tokens of the large shards")
    c.add_argument("--steps", type=int, default=20, help="steps of the data-wait run")
    c.add_argument("--launch-rounds", type=int, default=90,
                   help="steps each way of the host-work measure (no data, in the process, read ahead), in turns")
    c.add_argument("--pairs", type=int, default=200_000, help="preference pairs prepared and trained on (pairs)")
    c.add_argument("--parts", default=",".join(PARTS), help=f"which measures, among {', '.join(PARTS)}")
    c.add_argument("--scratch", default=None, help="where to write the corpus and shards (a few GB at the default)")
    return {"data": data}
