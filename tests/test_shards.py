"""Token shards: a corpus prepared once (scripts/prepare_data.py) and trained on memory-mapped (data=shards)."""

import itertools
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import (
    QUIET,
    ROOT,
    TINY_GPT,
    exported_weights,
    kill_when,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
    short_pairs,
)

pytest.importorskip("datatrove")
datasets = pytest.importorskip("datasets")


def prepare(source, out: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([str(source), str(out), *flags], script="scripts/prepare_data.py", check=check)


def documents(folder: Path, split: str = "train") -> tuple[list[list[int]], list[list[bool]] | None]:
    """Every document of a split as the files hold it, in task order: ids, and where prepared their loss masks."""
    manifest = json.loads((folder / "manifest.json").read_text())
    ids, masks = [], [] if manifest["loss_masks"] else None
    for shard in manifest["splits"][split]:
        tokens = np.fromfile(folder / shard["file"], dtype=manifest["dtype"])
        ends = np.fromfile(folder / (shard["file"] + ".index"), dtype=np.uint64).astype(int)
        loss = np.fromfile(folder / (shard["file"] + ".loss"), dtype=np.uint8) if masks is not None else None
        for begin, end in zip([0, *ends[:-1]], ends):
            ids.append(tokens[begin:end].tolist())
            if masks is not None:
                masks.append(loss[begin:end].astype(bool).tolist())
    return ids, masks


@pytest.fixture(scope="module")
def speeches(tmp_path_factory) -> Path:
    """The speeches corpus, prepared into three files per split (one process runs the three tasks in turn)."""
    out = tmp_path_factory.mktemp("shards") / "speeches"
    prepare(ROOT / "data" / "shakespeare_speeches.jsonl", out, "--tasks", "3", "--val-fraction", "0.1")
    return out


def shard_args(folder: Path, run_dir: Path, *extra: str, samples: str = "data.random_windows=true") -> list[str]:
    return [*TINY_GPT, *QUIET, "data=shards", f"data.path={folder}", "data.batch_size=4", samples,
            "trainer.max_steps=30", "trainer.checkpoint_every=10", "trainer.monitor=null", f"hydra.run.dir={run_dir}",
            *extra]


def test_prepared_documents_are_the_sources_rows_tokenized_with_whole_documents_held_out(speeches):
    """In row order, every row a document of exactly one split."""
    from src.data.prepare import held_out

    rows = [json.loads(line)["text"] for line in (ROOT / "data" / "shakespeare_speeches.jsonl").open()]
    train, val = documents(speeches, "train")[0], documents(speeches, "validation")[0]
    assert list(map(bytes, train)) == [text.encode() for i, text in enumerate(rows) if not held_out(i, 0, 0.1)]
    assert list(map(bytes, val)) == [text.encode() for i, text in enumerate(rows) if held_out(i, 0, 0.1)]
    assert 0 < len(val) < len(rows) / 5
    manifest = json.loads((speeches / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and len(manifest["splits"]["train"]) == 3
    assert sum(s["tokens"] for s in manifest["splits"]["train"]) == sum(map(len, train))


@pytest.mark.slow  # worker processes start Python afresh (spawn): 10 s more
def test_worker_processes_write_in_row_order_what_one_process_writes(speeches, tmp_path):
    parallel = tmp_path / "two_workers"
    prepare(ROOT / "data" / "shakespeare_speeches.jsonl", parallel, "--workers", "2", "--tasks", "3",
            "--val-fraction", "0.1")
    assert json.loads((parallel / "manifest.json").read_text())["splits"] == \
        json.loads((speeches / "manifest.json").read_text())["splits"]


@pytest.mark.parametrize("samples", [
    "data.random_windows=true",
    pytest.param("data.packing=true", marks=pytest.mark.slow),  # 25 s; its maths is the eval test's; CI runs it
])
def test_a_run_on_shards_killed_mid_epoch_resumes_bitwise_and_on_two_processes_trains_what_one_accumulating_does(
        speeches, tmp_path, samples):
    one, killed, two = tmp_path / "one", tmp_path / "killed", tmp_path / "two"
    accumulating = "trainer.gradient_accumulation_steps=2"
    run(shard_args(speeches, one, accumulating, samples=samples))
    kill_when(shard_args(speeches, killed, accumulating, samples=samples), 1,
              ready=lambda: (killed / "checkpoints" / "step_00000010").is_dir())
    assert not (killed / "model").exists()
    run([*shard_args(speeches, killed, accumulating, samples=samples), "resume=auto"])
    assert scalars(killed, "train/loss") == scalars(one, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0
    # N -> M: the 1-process checkpoint of step 10 resumed on 2 processes (the same global batch of 8) trains on
    # what the 1 process trained on, to float rounding.
    run([*shard_args(speeches, two, "trainer.gradient_accumulation_steps=1", samples=samples),
         f"resume={killed / 'checkpoints' / 'step_00000010'}"], nproc=2)
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5


def test_reading_ahead_in_a_thread_trains_the_same_weights_on_two_processes_and_a_killed_run_resumes_bitwise(
        tmp_path):
    # A corpus of about 9 steps an epoch: the 30 steps start the reader anew in each of 4 epochs, the kill at step
    # 10 falls in the second. Dropout draws from torch's generator in the training thread while the reader reads.
    small = tmp_path / "small.jsonl"
    small.write_text("".join((ROOT / "data" / "shakespeare_speeches.jsonl").read_text().splitlines(True)[:35]))
    prepare(small, tmp_path / "shards", "--val-fraction", "0.1")
    in_thread, ahead = tmp_path / "in_thread", tmp_path / "ahead"
    accumulating = ("trainer.gradient_accumulation_steps=2", "model.dropout=0.1")
    run(shard_args(tmp_path / "shards", in_thread, *accumulating), nproc=2)
    kill_when(shard_args(tmp_path / "shards", ahead, *accumulating, "data.read_ahead=true"), 2,
              ready=lambda: (ahead / "checkpoints" / "step_00000010").is_dir())
    resumed = run([*shard_args(tmp_path / "shards", ahead, *accumulating, "data.read_ahead=true"), "resume=auto"],
                  nproc=2)
    assert "a thread of this process reads the next optimizer step's micro-batches" in resumed.stdout
    assert scalars(ahead, "train/loss") == scalars(in_thread, "train/loss")
    assert max_abs_diff(exported_weights(ahead), exported_weights(in_thread)) == 0


def test_packed_shards_hold_every_document_whole_once_attending_to_itself_with_targets_inside_it(speeches):
    from src.data.jsonl import IGNORE_INDEX
    from src.data.shards import ShardData
    from src.errors import UsageError

    block = 64
    whole = [ids[:block] for ids in documents(speeches)[0]]
    data = ShardData(path=str(speeches), block_size=block, batch_size=4, packing=True)
    found = []
    for i in range(len(data.train)):
        sample = {key: value.tolist() for key, value in data.train[i].items()}
        assert len(sample["input_ids"]) <= block
        starts = [t for t, position in enumerate(sample["position_ids"]) if position == 0] + [len(sample["input_ids"])]
        for begin, end in zip(starts, starts[1:]):
            ids, labels = sample["input_ids"][begin:end], sample["labels"][begin:end]
            assert sample["position_ids"][begin:end] == list(range(end - begin))
            assert labels == [*ids[1:], IGNORE_INDEX]  # the next token, never one of the next document
            found.append(ids)
    assert sorted(found) == sorted(whole)
    assert len(data.train) < 0.9 * len(whole)  # packed: fewer blocks than documents
    padded = ShardData(path=str(speeches), block_size=block, batch_size=4, packing=False)
    assert [padded.train[i]["input_ids"].tolist() for i in range(len(padded.train))] == whole
    for wrong, names in (({"packing": True, "random_windows": True}, "data.random_windows"),
                         ({"packing": False, "long_documents": "split"}, "data.long_documents=split")):
        with pytest.raises(UsageError, match=names):
            ShardData(path=str(speeches), block_size=block, batch_size=4, **wrong)


def test_a_packing_plan_is_computed_once_then_read_memory_mapped_giving_the_same_samples(speeches, tmp_path):
    """The plan (which documents make each block) costs a pass over the `.ds.index` files: the first start saves it
    in the folder's plans/, later starts map it, so that a start reads nothing per document."""
    from src.data.shards import PLANS, ShardData

    folder = tmp_path / "shards"
    folder.mkdir()
    for file in speeches.iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())

    def samples(data) -> list:
        return [{key: value.tolist() for key, value in data.train[i].items()} for i in range(len(data.train))]

    first = ShardData(path=str(folder), block_size=64, batch_size=4, packing=True)
    assert first.train.plan_from is None and len(list((folder / PLANS).iterdir())) == 2  # train and validation
    second = ShardData(path=str(folder), block_size=64, batch_size=4, packing=True)
    assert second.train.plan_from is not None and isinstance(second.train.starts, np.memmap)
    assert samples(second) == samples(first) and len(second.val) == len(first.val)
    assert "read from" in second.train.summary(64, False) and first.train.summary(64, False) in \
        second.train.summary(64, False)
    ShardData(path=str(folder), block_size=64, batch_size=4, packing=False)  # another layout, other plans
    assert len(list((folder / PLANS).iterdir())) == 4
    starts = second.train.plan_from / "starts.npy"
    starts.write_bytes(starts.read_bytes()[:-8])  # damaged: computed again, the same, and saved whole again
    third = ShardData(path=str(folder), block_size=64, batch_size=4, packing=True)
    assert third.train.plan_from is None and samples(third) == samples(first)
    assert ShardData(path=str(folder), block_size=64, batch_size=4, packing=True).train.plan_from is not None


def test_a_preparation_told_the_block_size_saves_its_packing_plan_so_even_the_first_start_reads_no_index(tmp_path):
    from src.data.prepare import Source
    from src.data.prepare import prepare as prepare_here
    from src.data.shards import PLANS, ShardData, document_ends, packing_plan

    out = tmp_path / "shards"
    manifest = prepare_here(Source(str(ROOT / "data" / "shakespeare_speeches.jsonl")), out, tasks=2,
                            val_fraction=0.1, pack_for=[64])
    assert len(list((out / PLANS).iterdir())) == 2  # training's and validation's
    data = ShardData(path=str(out), block_size=64, batch_size=4, packing=True)
    assert data.train.plan_from is not None and data.val.plan_from is not None
    expected = packing_plan(document_ends(out, manifest, "train"), 64, pack=True, split_long=False)
    for name in ("starts", "lengths", "bounds"):
        assert np.array_equal(getattr(data.train, name), expected[name]), name


def mapping_flags(paths: set[str]) -> dict[str, list[str]]:
    """The kernel's flags (smaps' VmFlags) of this process's mappings of the given files."""
    flags, current = {}, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):  # a mapping's header line
            current = fields[5] if len(fields) > 5 and fields[5] in paths else None
        elif current and fields[0] == "VmFlags:":
            flags.setdefault(current, []).append(" ".join(fields[1:]))
    return flags


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="the kernel's mapping flags: Linux only")
def test_token_files_are_mapped_for_random_reads_so_a_window_pulls_in_no_read_ahead(speeches, tmp_path):
    """Windows are read in a shuffled order: with the kernel's read-ahead each one would read megabytes around it
    (RSS and disk reads growing with the corpus). `rr` is VM_RAND_READ, what madvise(MADV_RANDOM) sets."""
    from src.data.shards import ShardData
    from src.data.text import TokenData

    shards = ShardData(path=str(speeches), block_size=64, batch_size=4)
    manifest = json.loads((speeches / "manifest.json").read_text())
    files = {str(speeches / shard["file"]) for split in manifest["splits"].values() for shard in split}
    flags = mapping_flags(files)
    assert set(flags) == files and all("rr" in f.split() for found in flags.values() for f in found), flags
    bin_file = tmp_path / "tokens.bin"
    np.arange(5000, dtype=np.uint16).tofile(bin_file)
    tokens = TokenData(path=str(bin_file), vocab_size=5000, block_size=64, batch_size=4)
    assert all("rr" in f.split() for f in mapping_flags({str(bin_file)})[str(bin_file)])
    del shards, tokens


def test_a_models_validation_loss_on_shards_is_the_same_packed_or_padded_on_one_and_two_processes(speeches, tmp_path):
    run(shard_args(speeches, tmp_path / "run", "trainer.max_steps=10", samples="data.random_windows=false"))
    losses = {}
    for packing, nproc in (("false", 1), ("true", 1), ("true", 2)):
        output = tmp_path / f"{packing}_{nproc}.json"
        run([f"path={tmp_path / 'run' / 'model'}", f"+data.packing={packing}",
             f"output={output}"], script="eval.py", nproc=nproc)
        losses[packing, nproc] = json.loads(output.read_text())["eval/loss"]
    padded = losses["false", 1]
    assert abs(losses["true", 1] - padded) < 1e-5 and abs(losses["true", 2] - padded) < 1e-5, losses


def test_a_changed_shard_is_refused_on_resume_naming_it(speeches, tmp_path):
    folder, run_dir = tmp_path / "shards", tmp_path / "run"
    folder.mkdir()
    for file in speeches.iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    run(shard_args(folder, run_dir, "trainer.max_steps=10"))
    tokens = bytearray((folder / "train_00001.ds").read_bytes())
    tokens[1000:1002] = tokens[2000:2002]  # another token, the size kept
    (folder / "train_00001.ds").write_bytes(bytes(tokens))
    refused(run([*shard_args(folder, run_dir, "trainer.max_steps=20"), "resume=auto"], check=False),
            "train_00001.ds")
    (folder / "train_00001.ds").write_bytes(bytes(tokens[:-2]))  # cut short: named at the start of any run
    refused(run(shard_args(folder, tmp_path / "fresh"), check=False), "train_00001.ds", "prepare")


@pytest.fixture(scope="module")
def play(tmp_path_factory) -> Path:
    """A second prepared corpus for mixtures: the first 200 kB of tiny Shakespeare, a line a document."""
    folder = tmp_path_factory.mktemp("play")
    (folder / "play.txt").write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:200_000])
    prepare(folder / "play.txt", folder / "shards", "--val-fraction", "0.1")
    return folder / "shards"


def test_several_prepared_folders_mix_by_weight_each_epoch_drawing_the_next_share_of_each_in_a_computed_order(
        speeches, play):
    """data.sources: an epoch of samples_per_epoch takes each folder's share by weight (largest remainders), each
    sample one of that folder's own, a source's draws within a pass all different and the next epoch's the next ones
    (its order computed, not held: src/data/sampling.py); validation is every folder's, whole; the same mixture
    built again gives the same samples."""
    from src.data.shards import ShardData

    sources = [{"path": str(speeches), "weight": 3}, {"path": str(play), "weight": 1}]
    data = ShardData(sources=sources, samples_per_epoch=400, block_size=16, batch_size=4, random_windows=True)
    alone = [ShardData(path=str(folder), block_size=16, batch_size=4, random_windows=True)
             for folder in (speeches, play)]
    assert len(data.train) == 400 and data.train.counts == [300, 100]
    assert len(data.val) == sum(len(part.val) for part in alone)
    again = ShardData(sources=sources, samples_per_epoch=400, block_size=16, batch_size=4, random_windows=True)
    drawn = {0: [], 1: []}
    for epoch in (0, 1):
        data.train.set_epoch(epoch)
        again.train.set_epoch(epoch)
        for part in alone:
            part.train.set_epoch(epoch)  # random windows: the epoch reaches each source
        for i in range(0, 400, 7):
            source = 0 if i < 300 else 1
            index = data.train.index_in(source, i - 300 * source)
            drawn[source].append(index)
            x, y = data.train[i]
            assert torch.equal(x, alone[source].train[index][0]) and torch.equal(y, alone[source].train[index][1])
            assert torch.equal(x, again.train[i][0])
    for source, indices in drawn.items():
        assert len(set(indices)) == len(indices), source  # two epochs of shares smaller than the source: no repeat
    assert data.train.samples_by_source(np.array([0, 299, 300, 399])).tolist() == [2, 2]


def test_mixed_folders_refuse_another_tokenizer_a_bad_source_or_both_keys_naming_the_source(speeches, play,
                                                                                            tmp_path, pretrained):
    from src.data.shards import ShardData
    from src.errors import UsageError

    other = tmp_path / "other"
    prepare(ROOT / "data" / "shakespeare_speeches.jsonl", other, "--tokenizer", str(pretrained))
    with pytest.raises(UsageError, match=r"data.sources\[1\] .*other.* another tokenizer than data.sources\[0\]"):
        ShardData(sources=[{"path": str(speeches), "weight": 1}, {"path": str(other), "weight": 1}], block_size=16,
                  batch_size=2)
    with pytest.raises(UsageError, match=r"data.sources\[1\] .*missing.*no such folder"):
        ShardData(sources=[{"path": str(speeches), "weight": 1}, {"path": str(tmp_path / "missing"), "weight": 1}],
                  block_size=16, batch_size=2)
    with pytest.raises(UsageError, match=r"data.sources\[0\].weight=0: a number above 0"):
        ShardData(sources=[{"path": str(speeches), "weight": 0}], block_size=16, batch_size=2)
    with pytest.raises(UsageError, match=r"data.sources\[0\] has no key 'packing'.*every other key is the run's"):
        ShardData(sources=[{"path": str(speeches), "weight": 1, "packing": True}], block_size=16, batch_size=2)
    with pytest.raises(UsageError, match="data.path .* or data.sources .*not both"):
        ShardData(path=str(play), sources=[{"path": str(speeches), "weight": 1}], block_size=16, batch_size=2)
    with pytest.raises(UsageError, match="data.path .* or data.sources .*give one of them"):
        ShardData(block_size=16, batch_size=2)
    with pytest.raises(UsageError, match="data.samples_per_epoch is for data.sources"):
        ShardData(path=str(play), samples_per_epoch=10, block_size=16, batch_size=2)


def test_mixed_folders_of_pairs_number_every_pair_once_as_a_precomputed_reference_reads_them(tmp_path):
    """data.preference=true over two prepared folders of pairs: the training pairs of each, then the validation
    pairs of each, numbered one set after the other from 0 (the rows of DPO's precomputed table), and a pair drawn
    by the mixture carries its set's number."""
    from src.data.shards import ShardData
    from src.objectives.reference import pair_sets

    folders = [tmp_path / "shipped", tmp_path / "short"]
    prepare(ROOT / "data" / "shakespeare_pairs.jsonl", folders[0], "--preference", "--val-fraction", "0.1")
    prepare(short_pairs(tmp_path / "short.jsonl"), folders[1], "--preference", "--val-fraction", "0.1")
    data = ShardData(sources=[{"path": str(folders[0]), "weight": 1}, {"path": str(folders[1]), "weight": 2}],
                     block_size=64, batch_size=2, preference=True, packing=True)
    sets = pair_sets(data)
    assert len(sets) == 4 and sets[0].first_index == 0
    assert all(later.first_index == earlier.first_index + len(earlier) for earlier, later in zip(sets, sets[1:]))
    for i in (0, len(data.train) - 1):
        source = int(data.train.samples_by_source(np.array([i])).argmax())
        index = data.train.index_in(source, i - data.train.starts[source])
        assert data.train[i]["pair_index"] == data.train.sources[source].first_index + index
    assert data.collate_fn([data.train[0], data.train[1]])["input_ids"].shape[0] <= 4  # the run's packing


@pytest.mark.slow  # four launches, ~40 s; the in-process test above pins the mixture's samples
def test_a_run_on_mixed_folders_resumes_bitwise_after_a_kill_trains_alike_on_two_processes_and_counts_each_share(
        speeches, play, tmp_path):
    mixed = [f"data.sources=[{{path: {speeches}, weight: 3}}, {{path: {play}, weight: 1}}]", "~data.path",
             "data.samples_per_epoch=200", "trainer.gradient_accumulation_steps=2"]
    one, killed, two = tmp_path / "one", tmp_path / "killed", tmp_path / "two"
    run([*shard_args(speeches, one), *mixed])
    kill_when([*shard_args(speeches, killed), *mixed], 1,
              ready=lambda: (killed / "checkpoints" / "step_00000010").is_dir())
    run([*shard_args(speeches, killed), *mixed, "resume=auto"])
    assert scalars(killed, "train/loss") == scalars(one, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0
    run([*shard_args(speeches, two), *mixed[:-1], "trainer.gradient_accumulation_steps=1",
         f"resume={killed / 'checkpoints' / 'step_00000010'}"], nproc=2)
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5
    consumed = json.loads((one / "summary.json").read_text())["data"]
    shares = [consumed[f"windows of 32 tokens from data.sources[{i}] ({path})"] for i, path in enumerate((speeches,
                                                                                                          play))]
    assert sum(shares) == 30 * 8 and shares[0] > 2 * shares[1]  # 30 steps of 8 windows, about 3 to 1


def test_a_vocabulary_above_65536_is_prepared_as_uint32_and_trains(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": " ".join(words[j] for j in rng.integers(60_000, 70_000, 50))})
                              + "\n" for _ in range(200)))
    prepare(source, tmp_path / "shards", "--tokenizer", str(tmp_path / "tokenizer.json"), "--val-fraction", "0.2")
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == 70_001
    ids = documents(tmp_path / "shards")[0]
    assert min(map(min, ids)) > 60_000  # no id folded into 16 bits
    run([*TINY_GPT, *QUIET, "data=shards", f"data.path={tmp_path / 'shards'}", "data.batch_size=4",
         "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert (tmp_path / "run" / "model").is_dir()


def with_chat_template(pretrained: Path, tmp_path: Path) -> Path:
    """A copy of the pretrained folder whose tokenizer has a chat template."""
    chat_folder = tmp_path / "chat_model"
    chat_folder.mkdir()
    for file in pretrained.iterdir():
        (chat_folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((chat_folder / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (chat_folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return chat_folder


def test_prompt_and_chat_label_masks_survive_preparation_as_every_data_option_makes_them(tmp_path, pretrained):
    """The tokens and targets of a prompted and of a chat corpus, prepared, are those of tokenized_documents (the
    rule data=hf_dataset and data=jsonl train on)."""
    from src.data.jsonl import IGNORE_INDEX, tokenized_documents
    from src.data.prepare import held_out
    from src.data.tokenizer import codec_for

    chat_folder = with_chat_template(pretrained, tmp_path)
    prompted = [{"prompt": f"Who speaks in scene {i}?", "text": f" ROMEO, {i} times."} for i in range(60)]
    chats = [{"messages": [{"role": "user", "content": f"Scene {i}?"}, {"role": "assistant", "content": f"ROMEO {i}"},
                           {"role": "user", "content": "Then?"}, {"role": "assistant", "content": "JULIET"}]}
             for i in range(60)]
    for name, rows, flags in (("prompted", prompted, ["--prompt-column", "prompt"]),
                              ("chats", chats, ["--text-column", "messages"])):
        source = tmp_path / f"{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(source))
        out = tmp_path / f"{name}_shards"
        prepare(source, out, "--tokenizer", str(chat_folder), "--tasks", "2", "--val-fraction", "0.2", *flags)
        codec = codec_for(str(chat_folder))
        column = flags[1] if name == "chats" else "text"
        kept = [row for i, row in enumerate(rows) if not held_out(i, 0, 0.2)]
        ids, labels = tokenized_documents(codec, [row[column] for row in kept],
                                          [row["prompt"] for row in kept] if name == "prompted" else None)
        got_ids, got_masks = documents(out)
        assert got_ids == ids, name
        assert got_masks == [[label != IGNORE_INDEX for label in document] for document in labels], name
        assert 0 < sum(map(sum, got_masks)) < sum(map(len, got_masks))
    # Trained on, the masked tokens are no targets.
    from src.data.shards import ShardData

    data = ShardData(path=str(tmp_path / "prompted_shards"), block_size=16, batch_size=2)
    inputs, targets = data.train[0]
    tokens = np.fromfile(tmp_path / "prompted_shards" / "train_00000.ds", dtype=np.uint16)[:17].astype(int)
    counts = np.fromfile(tmp_path / "prompted_shards" / "train_00000.ds.loss", dtype=np.uint8)[1:17].astype(bool)
    assert inputs.tolist() == tokens[:16].tolist()
    assert targets.tolist() == np.where(counts, tokens[1:], IGNORE_INDEX).tolist()


def test_preference_pairs_survive_preparation_as_data_preference_tokenizes_them_numbered_once_whole_pairs_held_out(
        tmp_path, pretrained):
    """Strings with a prompt (bytes) and conversations with a prompt implicit in their shared start (a chat
    template), prepared on 2 tasks: data=shards data.preference=true gives, in row order, the pairs tokenized_pairs
    gives (TRL's rule, which data=jsonl and data=hf_dataset train on), fitted to block_size or dropped alike, each
    pair numbered once across both splits; a pair without an answer token is left out, as there."""
    from src.data.preference import tokenized_pairs
    from src.data.prepare import held_out
    from src.data.shards import ShardData
    from src.data.tokenizer import codec_for

    strings = [json.loads(line) for line in (ROOT / "data" / "shakespeare_pairs.jsonl").read_text().splitlines()]
    strings = strings[:79] + [{"prompt": "Speak.", "chosen": "", "rejected": "No."}]  # no answer token: left out
    turn = [{"role": "user", "content": "Who speaks?"}]
    conversations = [{"chosen": turn + [{"role": "assistant", "content": f"ROMEO, {i} times"}],
                      "rejected": turn + [{"role": "assistant", "content": "JULIET" * (i % 9)}]} for i in range(80)]
    for name, rows, tokenizer, block_size in (
            ("strings", strings, "byte", 96),
            ("strings, BPE", strings, str(pretrained), 64),  # encoded in batches: tokenizers' batch path
            ("conversations", conversations, str(with_chat_template(pretrained, tmp_path)), 48)):
        source, out = tmp_path / f"{name}.parquet", tmp_path / f"{name}_shards"
        datasets.Dataset.from_list(rows).to_parquet(str(source))
        proc = prepare(source, out, "--preference", "--tokenizer", tokenizer, "--tasks", "2", "--val-fraction", "0.2")
        if tokenizer == "byte":  # no end-of-text token: an empty answer has none
            assert "1 pairs without an answer token left out" in proc.stdout, proc.stdout
        codec = codec_for(tokenizer)
        for long_pairs in ("truncate", "drop"):
            data = ShardData(path=str(out), block_size=block_size, batch_size=2, preference=True,
                             long_pairs=long_pairs)
            for split, validates, first in (("train", False, 0), ("val", True, len(data.train))):
                kept = [row for i, row in enumerate(rows) if held_out(i, 0, 0.2) == validates]
                columns = {key: [row.get(key) for row in kept] for key in ("prompt", "chosen", "rejected")}
                expected, counts = tokenized_pairs(codec, columns, block_size, long_pairs)
                got = getattr(data, split)
                assert counts["truncated" if long_pairs == "truncate" else "dropped"] > 0, (name, split)
                assert 0 < len(got) == len(expected["chosen_ids"]), (name, split, long_pairs)
                for i in range(len(got)):
                    sample = got[i]
                    assert [sample[f"{key}_ids"].tolist() for key in ("prompt", "chosen", "rejected")] == [
                        expected[f"{key}_ids"][i] for key in ("prompt", "chosen", "rejected")], (name, split, i)
                    assert int(sample["pair_index"]) == first + i


@pytest.mark.slow  # a preparation and four launches, two of them of two processes: ~50 s
def test_dpo_on_prepared_pairs_is_the_same_however_the_global_batch_is_split_and_resumes_bitwise_after_a_kill(
        tmp_path):
    """Pairs read from shards through the precomputed reference (its table indexed by each pair's number): 2
    processes of 2 pairs accumulating 2, packed (data.packing=true), train the weights of 1 process of 4 padded
    (<= 1e-5); a run killed after a checkpoint resumes bitwise, reading the table it kept."""
    from src.data.shards import ShardData

    pairs = tmp_path / "pairs"
    prepare(short_pairs(tmp_path / "pairs.jsonl"), pairs, "--preference", "--tasks", "2")
    packed = ShardData(path=str(pairs), block_size=96, batch_size=2, preference=True, packing=True)
    assert any(packed.collate_fn([packed.train[i], packed.train[i + 1]])["input_ids"].shape[0] < 4  # rows to fill
               for i in range(0, 8, 2))
    one, two, killed = (tmp_path / name for name in ("one", "two", "killed"))

    def dpo(run_dir: Path, *extra: str) -> list[str]:
        return [*TINY_GPT, *QUIET, "model.block_size=96", "data=shards", f"data.path={pairs}", "data.preference=true",
                "objective=dpo", "objective.reference=precomputed", "optimizer.lr=3e-3", "trainer.max_steps=6",
                "trainer.checkpoint_every=3", "trainer.gradient_accumulation_steps=2", "trainer.monitor=null",
                f"hydra.run.dir={run_dir}", *extra]

    run(dpo(one, "data.batch_size=4"))
    run(dpo(two, "data.batch_size=2", "data.packing=true"), nproc=2)
    ones = scalars(one, "train/loss")
    assert ones[1] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference: each pair found its row
    assert len(ones) == 6 and all(scalars(two, "train/loss")[s] == pytest.approx(ones[s], abs=1e-6) for s in ones)
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5
    kill_when(dpo(killed, "data.batch_size=4"), 1, ready=lambda: (killed / "checkpoints" / "step_00000003").is_dir())
    resumed = run([*dpo(killed, "data.batch_size=4"), "resume=auto"]).stdout
    assert "objective.reference=precomputed: read" in resumed
    assert scalars(killed, "train/loss") == ones
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0


def test_prepared_pairs_and_documents_are_each_refused_where_the_other_is_expected(tmp_path, speeches):
    from src.data.shards import ShardData
    from src.errors import UsageError

    pairs = tmp_path / "pairs"
    prepare(ROOT / "data" / "shakespeare_pairs.jsonl", pairs, "--preference")
    with pytest.raises(UsageError, match="holds preference pairs.*data.preference=true"):
        ShardData(path=str(pairs), block_size=64, batch_size=2)
    with pytest.raises(UsageError, match="data.random_windows are for documents.*preference pairs"):
        ShardData(path=str(pairs), block_size=64, batch_size=2, preference=True, random_windows=True)
    with pytest.raises(UsageError, match="holds documents.*--preference"):
        ShardData(path=str(speeches), block_size=64, batch_size=2, preference=True)
    refused(prepare(ROOT / "data" / "shakespeare_speeches.jsonl", tmp_path / "no", "--preference", check=False),
            "chosen", "rejected", "text")
    refused(prepare(ROOT / "data" / "shakespeare_pairs.jsonl", tmp_path / "no", "--preference", "--pack-for", "64",
                    check=False), "--pack-for")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                 "rejected": [{"role": "user", "content": "a"}]}) + "\n")
    refused(prepare(chats, tmp_path / "no", "--preference", check=False), "--tokenizer", "chat template")
    assert not (tmp_path / "no").exists()


def test_prepared_pairs_that_leave_a_split_empty_are_refused_naming_what_fills_it(tmp_path):
    from src.data.shards import ShardData
    from src.errors import UsageError

    few = tmp_path / "few.jsonl"
    few.write_text("\n".join((ROOT / "data" / "shakespeare_pairs.jsonl").read_text().splitlines()[:20]) + "\n")
    proc = prepare(few, tmp_path / "pairs", "--preference", "--val-fraction", "0.001")
    named(proc.stdout, "validation split is empty", "--val-fraction")
    with pytest.raises(UsageError, match="validation split holds no preference pair.*larger --val-fraction"):
        ShardData(path=str(tmp_path / "pairs"), block_size=64, batch_size=2, preference=True)
    prepare(few, tmp_path / "halves", "--preference", "--val-fraction", "0.5")
    with pytest.raises(UsageError, match="no training preference pair fits data.block_size=16"):
        ShardData(path=str(tmp_path / "halves"), block_size=16, batch_size=2, preference=True, long_pairs="drop")


def test_a_killed_preparation_started_again_skips_its_finished_tasks_and_writes_what_an_uninterrupted_one_does(
        tmp_path):
    source = tmp_path / "corpus.jsonl"
    lines = (ROOT / "data" / "shakespeare_speeches.jsonl").read_text().splitlines()
    source.write_text("\n".join(lines * 8) + "\n")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    prepare(source, whole, "--tasks", "6")
    done = killed / "logs" / "completions"
    kill_when([str(source), str(killed), "--tasks", "6"], 1, ready=lambda: (done / "00000").is_file(),
              script="scripts/prepare_data.py")
    finished = sorted(p.name for p in done.iterdir())
    assert len(finished) < 6 and not (killed / "manifest.json").exists(), finished  # it died mid-way
    first = (killed / "train_00000.ds").stat()
    proc = prepare(source, killed, "--tasks", "6")
    assert "Skipping" in proc.stdout or "already been completed" in proc.stdout, proc.stdout[-2000:]
    assert (killed / "train_00000.ds").stat().st_mtime_ns == first.st_mtime_ns  # not written again
    ours, theirs = (json.loads((f / "manifest.json").read_text()) for f in (killed, whole))
    for split in ("train", "validation"):
        assert [s["digest"] for s in ours["splits"][split]] == [s["digest"] for s in theirs["splits"][split]]
    # Another setting into the same folder is refused, not mixed in.
    refused(prepare(source, killed, "--tasks", "3", check=False), "preparation.json")


def test_bad_inputs_name_the_flag_or_key_and_leave_nothing_that_refuses_the_corrected_command(tmp_path):
    speeches = ROOT / "data" / "shakespeare_speeches.jsonl"
    refused(prepare(speeches, tmp_path / "out", "--text-column", "body", check=False), "--text-column=body", "text")
    refused(prepare(speeches, tmp_path / "out", "--tokenizer", str(tmp_path / "typo.json"), check=False),
            "--tokenizer", "typo.json")
    for flags, names in ((["--split", "test"], ["--split=test", "train"]), (["--subset", "x"], ["--subset=x"])):
        refused(prepare(speeches, tmp_path / "out", *flags, check=False), *names)
    missing = prepare(tmp_path / "typo.jsonl", tmp_path / "out", check=False)  # the script's words, not data.path's
    refused(missing, "SOURCE=", "typo.jsonl")
    assert "data.path" not in missing.stdout
    assert not (tmp_path / "out").exists()
    prepare(speeches, tmp_path / "out", "--val-fraction", "0.1")  # corrected, into the same folder
    refused(run([*TINY_GPT, "data=shards", f"data.path={tmp_path / 'nothing'}",
                 f"hydra.run.dir={tmp_path / 'run'}"], check=False), "data.path", "prepare_data.py")


@pytest.mark.slow
@pytest.mark.slurm
def test_a_slurm_array_shares_the_tasks_among_its_nodes_and_writes_what_one_process_writes(speeches, tmp_path):
    from tests.test_slurm import CPU_NODES, cluster_is_up

    if not cluster_is_up():
        pytest.skip("no SLURM cluster here (start one: scripts/local_slurm.sh start)")
    out = tmp_path / "array"
    subprocess.run(["sbatch", "--wait", "--array=0-1", *CPU_NODES, f"--output={tmp_path}/log-%a",
                    "slurm/prepare_data.sbatch", str(ROOT / "data" / "shakespeare_speeches.jsonl"), str(out),
                    "--tasks", "3", "--val-fraction", "0.1"], cwd=ROOT, check=True, timeout=600)
    logs = [(tmp_path / f"log-{node}").read_text() for node in (0, 1)]
    assert any("wrote" in log for log in logs) and sum("its tasks are done" in log for log in logs) <= 1, logs
    assert json.loads((out / "manifest.json").read_text())["splits"] == \
        json.loads((speeches / "manifest.json").read_text())["splits"]


def test_a_corpus_of_17_billion_tokens_gives_its_first_batch_without_listing_its_windows(speeches, tmp_path):
    import shutil
    import sys

    from src.data.sampling import Permutation

    huge = tmp_path / "huge"
    shutil.copytree(speeches, huge)
    manifest = json.loads((huge / "manifest.json").read_text())
    first = manifest["splits"]["train"][0]
    tokens, block_size = 2**34, 64  # a sparse file: 32 GiB of ids that take no disk
    os.truncate(huge / first["file"], tokens * 2)
    first["tokens"] = tokens
    (huge / "manifest.json").write_text(json.dumps(manifest))
    # The windows the run's order starts with get ids of their own, so that the batch tells which windows came.
    windows = (sum(shard["tokens"] for shard in manifest["splits"]["train"]) - 1) // block_size
    starts = [i * block_size for i in itertools.islice(Permutation(windows, seed=0), 4)]
    with open(huge / first["file"], "r+b") as file:
        for n, start in enumerate(starts):
            file.seek(start * 2)
            file.write(np.full(block_size, n + 1, dtype=np.uint16).tobytes())

    reader = (f"import json, resource; from src.data.shards import ShardData\n"
              f"data = ShardData(path={str(huge)!r}, block_size={block_size}, batch_size=4, seed=0)\n"
              f"inputs, _ = next(iter(data.train_dataloader()))\n"
              f"print(json.dumps([len(data.train), inputs[:, 0].tolist(), resource.getrusage(resource.RUSAGE_SELF)"
              f".ru_maxrss]))")
    out = subprocess.run([sys.executable, "-c", reader], cwd=ROOT, capture_output=True, text=True, check=True)
    length, firsts, peak_kib = json.loads(out.stdout.splitlines()[-1])
    assert length == windows and firsts == [1, 2, 3, 4]
    assert peak_kib < 1 << 20  # torch's sampler lists the epoch's 2**28 indices first: 2 GiB, then 10 as a list
    # Mixed with another folder (data.sources): neither the epoch's order nor a source's is listed either.
    mixed = reader.replace(f"path={str(huge)!r}", f"sources=[{{'path': {str(huge)!r}, 'weight': 1}}, "
                                                   f"{{'path': {str(speeches)!r}, 'weight': 1}}]")
    out = subprocess.run([sys.executable, "-c", mixed], cwd=ROOT, capture_output=True, text=True, check=True)
    length, _, peak_kib = json.loads(out.stdout.splitlines()[-1])
    assert length > windows and peak_kib < 1 << 20


@pytest.mark.slow  # 13 s: two preparations and three launches; CI runs it
def test_cifar10_images_prepared_as_shards_train_the_weights_their_binary_files_train(cifar_root, tmp_path):
    """The shard format holds other samples too: CIFAR-10's records, one a document, read memory-mapped."""
    shards = tmp_path / "cifar_shards"
    proc = prepare(cifar_root, shards, "--cifar10")
    assert "1,000 training and 301 validation images" in proc.stdout
    resnet = ["experiment=cifar10_resnet", "model.width=4", "data.batch_size=16", "data.num_workers=0",
              "trainer.max_steps=4", "trainer.eval_batches=2", *QUIET]
    for name, root in (("binary", cifar_root), ("shards", shards)):
        run([*resnet, f"data.root={root}", f"hydra.run.dir={tmp_path / name}"])
    assert max_abs_diff(exported_weights(tmp_path / "shards"), exported_weights(tmp_path / "binary")) == 0
    assert scalars(tmp_path / "shards", "eval/loss") == scalars(tmp_path / "binary", "eval/loss")
    prepare(ROOT / "data" / "shakespeare_speeches.jsonl", tmp_path / "text")  # shards of token ids, not images
    refused(run([*resnet, f"data.root={tmp_path / 'text'}", f"hydra.run.dir={tmp_path / 'wrong'}"], check=False),
            "data.root", "--cifar10")
