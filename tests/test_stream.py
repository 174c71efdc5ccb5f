"""A corpus streamed as it trains (data=stream): read in a fixed order, its held-out rows never trained on however it
is split, resumed exactly from the position its loader saved (nothing read again; where the processes share one
stream, on any number of them); refused on a layout that would read it in another order."""

import copy
import json
import re
from pathlib import Path

import pytest

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
)

pytest.importorskip("datasets")
SPEECHES = ROOT / "data" / "shakespeare_speeches.jsonl"


def stream_args(source: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*TINY_GPT, *QUIET, "data=stream", f"data.path={source}", "data.val_documents=100", "data.batch_size=4",
            "trainer.max_steps=30", "trainer.checkpoint_every=10", "trainer.monitor=null", f"hydra.run.dir={run_dir}",
            *extra]


def test_the_stream_trains_windows_across_its_documents_in_their_order_after_the_held_out_ones():
    from src.data.stream import StreamData
    from src.errors import UsageError

    texts = [json.loads(line)["text"] for line in SPEECHES.read_text().splitlines()]
    data = StreamData(path=str(SPEECHES), block_size=16, val_documents=100)
    training = [text for text in texts[100:] if text not in texts[:100]]  # a copy of a held-out text never trains
    stream = [b for text in training[:1000] for b in text.encode()]  # the first map batch's documents, as bytes
    for i, sample in zip(range(50), data.train):
        assert sample["input_ids"].tolist() == stream[16 * i : 16 * i + 16]
        assert sample["labels"].tolist() == stream[16 * i + 1 : 16 * i + 17]
    held_out = [b for text in texts[:100] for b in text.encode()]
    assert data.val[0][0].tolist() == held_out[:16] and len(data.val) == (len(held_out) - 1) // 16
    with pytest.raises(UsageError, match="data.text_column=body.*its columns: text"):
        StreamData(path=str(SPEECHES), block_size=16, text_column="body")
    rows = len(texts)  # every row held out to validate: refused at the start, naming the key
    with pytest.raises(UsageError, match=f"holds {rows} rows, and data.val_documents={rows} .*none is left"):
        StreamData(path=str(SPEECHES), block_size=16, val_documents=rows)
    assert len(StreamData(path=str(SPEECHES), block_size=16, val_documents=rows - 1).val) > 0  # one row trains
    # Its loader keeps its position: a thread reading ahead of the loop would move it past what trained.
    with pytest.raises(UsageError, match="data.read_ahead=true.*has none.*data.num_workers"):
        StreamData(path=str(SPEECHES), block_size=16, read_ahead=True).train_dataloader()


def two_files(folder: Path, first: slice, second: slice) -> Path:
    folder.mkdir()
    lines = SPEECHES.read_text().splitlines(keepends=True)
    (folder / "part0.jsonl").write_text("".join(lines[first]))
    (folder / "part1.jsonl").write_text("".join(lines[second]))
    return folder


def one_parquet_file(path: Path, *row_groups: list[str]) -> Path:
    """One Parquet file holding each list of texts as one row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for texts in row_groups:
            writer.write_table(pa.table({"text": texts}), row_group_size=len(texts))
    return path


def test_resharding_gives_each_process_its_own_row_groups_of_one_parquet_file_and_never_a_held_out_row(
        tmp_path, caplog):
    from torch.utils.data import DataLoader

    from src.data.stream import StreamData

    source = one_parquet_file(tmp_path / "corpus.parquet",
                              *[[f"<{i:03d}>" for i in range(group, group + 20)] for group in range(0, 200, 20)])
    assert StreamData(path=str(source), block_size=8, val_documents=20).train.n_shards == 1
    data = StreamData(path=str(source), block_size=8, val_documents=20, reshard=True)  # rows 0-19 validate
    assert data.train.n_shards == 10
    read = []
    for process in range(2):  # what accelerate gives each of two processes: its own row groups
        loader = DataLoader(data.train.shard(num_shards=2, index=process), batch_size=10)
        text = "".join(data.decode(window.tolist()) for batch in loader for window in batch["input_ids"])
        read.append({int(row) for row in re.findall(r"<(\d{3})>", text)})
    assert not (read[0] | read[1]) & set(range(20)), "a held-out row trained"
    assert min(read[0]) == 20 and max(read[0]) < 100 <= min(read[1]) and max(read[1]) >= 190  # five groups each
    assert "stream parts (row groups)" in data.fingerprint()
    lines = tmp_path / "corpus.jsonl"
    lines.write_text("".join(json.dumps({"text": f"<{i:03d}>"}) + "\n" for i in range(200)))
    StreamData(path=str(lines), block_size=8, val_documents=20, reshard=True)
    assert "could not be split further than its 1 files" in caplog.text  # JSON Lines: nothing to split


@pytest.mark.parametrize("workers", [0, 2])
def test_the_held_out_rows_never_train_however_the_stream_is_split_among_processes_or_workers(tmp_path, workers):
    from torch.utils.data import DataLoader

    from src.data.stream import StreamData

    folder = tmp_path / "corpus"
    folder.mkdir()
    for part in range(2):  # rows that name themselves, so that a window shows which rows it came from
        (folder / f"part{part}.jsonl").write_text("".join(json.dumps({"text": f"<{part}-{i:03d}>"}) + "\n"
                                                          for i in range(200)))
    data = StreamData(path=str(folder), block_size=8, val_documents=20)  # the first 20 rows of part0 validate
    text = ""
    for process in range(2):  # what accelerate gives each of two processes: its own file
        loader = DataLoader(data.train.shard(num_shards=2, index=process), batch_size=10, num_workers=workers)
        # Consecutive windows are the stream itself (a map batch's tail shorter than a window left out).
        text += "".join(data.decode(window.tolist()) for batch in loader for window in batch["input_ids"]) + "|"
    assert not any(f"<0-{i:03d}>" in text for i in range(20)), "a held-out row trained"
    assert "<0-020>" in text and "<1-000>" in text and "<1-019>" in text  # every other row of both files does


def test_processes_sharing_one_stream_take_their_shares_of_each_global_micro_batch_and_one_position_serves_any_count(
        monkeypatch):
    from torchdata.stateful_dataloader import StatefulDataLoader

    import src.data.stream as stream

    monkeypatch.setattr(stream, "ROWS_PER_MAP", 10)  # positions inside many map batches
    data = stream.StreamData(path=str(SPEECHES), block_size=16, val_documents=100)
    windows = [w["input_ids"].tolist() for w, _ in zip(data.train, range(200))]  # the stream, in order

    def loader(rank: int, processes: int, batch: int) -> StatefulDataLoader:  # each process its own stream object
        dealt = stream.DealtWindows(copy.deepcopy(data.train), batch, rank, processes)
        return StatefulDataLoader(dealt, batch_size=batch)

    def ids(batch) -> list:
        return batch["input_ids"].tolist()

    two = [loader(rank, 2, 4) for rank in range(2)]
    taken = [iter(two[0]), iter(two[1])]
    for g in range(10):  # global micro-batch g: windows 8g..8g+7, rank r the r-th 4 of them
        assert [ids(next(taken[r])) for r in range(2)] == [windows[8 * g: 8 * g + 4], windows[8 * g + 4: 8 * g + 8]]
    position = two[0].state_dict()
    assert position["dataset_state"] == two[1].state_dict()["dataset_state"]  # the same on every process
    # Where the 2 processes stood, 1 process of 8 windows and 4 of 2 continue with the same global micro-batches.
    one = loader(0, 1, 8)
    one.load_state_dict(position)
    assert [ids(b) for b, _ in zip(one, range(3))] == [windows[80 + 8 * g: 88 + 8 * g] for g in range(3)]
    four = loader(3, 4, 2)
    four.load_state_dict(position)
    assert [ids(b) for b, _ in zip(four, range(3))] == [windows[86 + 8 * g: 88 + 8 * g] for g in range(3)]


@pytest.mark.parametrize("workers, row_groups", [(0, False), (2, False), (2, True)],
                         ids=["in the process", "two workers, one file", "two workers, each its row groups"])
def test_a_loader_restored_from_its_saved_position_continues_the_stream_without_tokenizing_what_it_read(
        tmp_path, monkeypatch, workers, row_groups):
    from accelerate import Accelerator

    import src.data.stream as stream
    from src.checkpointing.checksums import write_checksums
    from src.launch.accelerator import loader_configuration
    from src.loop.stream_position import StreamPosition, position_file
    from src.loop.train_state import TrainState

    monkeypatch.setattr(stream, "ROWS_PER_MAP", 10)  # many map batches in a few hundred rows
    accelerator = Accelerator(cpu=True, dataloader_config=loader_configuration(stateful_loaders=True))  # train.py's

    source, extra = SPEECHES, {}
    if row_groups:  # data.reshard=true: each worker reads its own row groups, and each keeps its own position
        texts = [json.loads(line)["text"] for line in SPEECHES.read_text().splitlines()]
        source = one_parquet_file(tmp_path / "corpus.parquet", *[texts[i : i + 100] for i in range(0, 800, 100)])
        extra = {"reshard": True}

    def loader():
        data = stream.StreamData(path=str(source), block_size=16, val_documents=100, batch_size=8,
                                 num_workers=workers, **extra)
        return accelerator.prepare(data.train_dataloader())

    def ids(batch) -> list:
        return batch["input_ids"].tolist()

    first, state = loader(), TrainState()
    batches = iter(first)
    read = [ids(next(batches)) for _ in range(60)]  # past several map batches (and a loader's look-ahead)
    saved = tmp_path / "saved"
    saved.mkdir()
    StreamPosition(accelerator, first).save(saved, state)
    expected = [ids(next(batches)) for _ in range(20)]
    write_checksums(saved)  # as a checkpoint's commit does: the resume verifies the file against it
    second = loader()
    tokenized = []  # the texts the restored loader tokenizes, from here on
    real = stream.tokenized_documents
    monkeypatch.setattr(stream, "tokenized_documents", lambda codec, texts: tokenized.append(texts) or real(codec,
                                                                                                         texts))
    position = StreamPosition(accelerator, second)
    position.load(saved, state, data_changed=False)
    assert position.restored and json.loads((saved / position_file(0)).read_text())["pass"] == 0
    batches = iter(second)
    assert [ids(next(batches)) for _ in range(20)] == expected
    assert read[-1] != expected[0]
    if workers == 0:  # in this process: the rows it tokenized start at the map batch the position was in
        texts = [json.loads(line)["text"] for line in SPEECHES.read_text().splitlines()]
        first_read = texts.index(tokenized[0][0])
        # 60 batches of 8 windows of 16 bytes: ~7.7 kB, ~50 speeches of ~157 bytes after the 100 held out.
        assert first_read >= 150, first_read  # the map batch (10 rows) the position was in, not row 100
        assert sum(map(len, tokenized)) <= 4 * 10  # what 20 more batches (~2.6 kB, ~16 rows) need


@pytest.mark.slow  # 15 s, four launches; the stream's order is the in-process test's; CI runs it
def test_a_streamed_run_killed_mid_run_resumes_bitwise_and_two_processes_train_what_one_accumulating_does(
        tmp_path):
    one, killed, two = tmp_path / "one", tmp_path / "killed", tmp_path / "two"
    accumulating = "trainer.gradient_accumulation_steps=2"
    run(stream_args(SPEECHES, one, accumulating))
    kill_when(stream_args(SPEECHES, killed, accumulating), 1,
              ready=lambda: (killed / "checkpoints" / "step_00000010").is_dir())
    assert not (killed / "model").exists()
    assert (killed / "checkpoints" / "step_00000010" / "data_position_0.json").is_file()
    resumed = run([*stream_args(SPEECHES, killed, accumulating), "resume=auto"])
    assert "resuming the stream where its loader stood (pass 0): no window is read again" in resumed.stdout
    assert scalars(killed, "train/loss") == scalars(one, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0
    # The summary says where in the stream the run ended: 30 steps of 2 micro-batches of 4 windows.
    assert re.search(r"windows of \d+ tokens read in this pass +240\n", resumed.stdout), resumed.stdout[-2000:]
    # One file, so one stream for every process: each takes its share of each global batch in the stream's order.
    run(stream_args(SPEECHES, two), nproc=2)
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5


@pytest.mark.slow  # 30 s, four launches; CI runs it
def test_processes_sharing_one_stream_resume_from_its_one_saved_position_bitwise_and_on_another_count(tmp_path):
    whole, killed, one = tmp_path / "whole", tmp_path / "killed", tmp_path / "one"
    run(stream_args(SPEECHES, whole), nproc=2)
    kill_when(stream_args(SPEECHES, killed), 2, ready=lambda: (killed / "checkpoints" / "step_00000010").is_dir())
    saved = killed / "checkpoints" / "step_00000010"
    assert (saved / "data_position_0.json").is_file() and not (saved / "data_position_1.json").exists()
    resumed = run([*stream_args(SPEECHES, killed), "resume=auto"], nproc=2)
    assert "resuming the stream where its loader stood (pass 0): no window is read again" in resumed.stdout
    assert scalars(killed, "train/loss") == scalars(whole, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(whole)) == 0
    # The same position on one process accumulating the same global batch: the same windows, to float rounding.
    moved = run([*stream_args(SPEECHES, one, "trainer.gradient_accumulation_steps=2"), f"resume={saved}"])
    assert "no window is read again" in moved.stdout
    assert max_abs_diff(exported_weights(one), exported_weights(whole)) <= 1e-5


@pytest.mark.slow  # 25 s each, three two-process launches; CI runs it
@pytest.mark.parametrize("layout", ["two files", "one Parquet file of two row groups, resharded"])
def test_processes_reading_their_own_files_each_start_theirs_again_and_resume_bitwise_from_their_positions(
        tmp_path, layout):
    # part0: the 100 held-out rows and 25 that train (105 windows); part1: 12 rows (66 windows). At 4 windows a
    # step, process 1 starts its part again after step 16, process 0 after step 26: the kill at 20 falls between.
    if layout == "two files":
        folder, extra = two_files(tmp_path / "corpus", slice(0, 125), slice(200, 212)), []
    else:  # the same parts as row groups of one file: data.reshard=true gives each process its own
        texts = [json.loads(line)["text"] for line in SPEECHES.read_text().splitlines()]
        folder = one_parquet_file(tmp_path / "corpus.parquet", texts[0:125], texts[200:212])
        extra = ["data.reshard=true"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run(stream_args(folder, whole, *extra), nproc=2)
    kill_when(stream_args(folder, killed, *extra), 2,
              ready=lambda: (killed / "checkpoints" / "step_00000020").is_dir())
    saved = killed / "checkpoints" / "step_00000020"
    passes = [json.loads((saved / f"data_position_{rank}.json").read_text())["pass"] for rank in range(2)]
    assert passes == [0, 1], passes
    resumed = run([*stream_args(folder, killed, *extra), "resume=auto"], nproc=2)
    assert "each process at its own" in resumed.stdout
    assert scalars(killed, "train/loss") == scalars(whole, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(whole)) == 0
    assert re.search(r"passes over process 0's files completed +1\n", resumed.stdout), resumed.stdout[-2000:]


@pytest.mark.slow  # 8 s, two launches; CI runs it
def test_a_stream_whose_files_are_shared_among_processes_refuses_to_resume_on_another_count(tmp_path):
    lines = len(SPEECHES.read_text().splitlines())
    folder = two_files(tmp_path / "corpus", slice(0, lines, 2), slice(1, lines, 2))
    run_dir = tmp_path / "run"
    run(stream_args(folder, run_dir, "trainer.max_steps=10"), nproc=2)
    refused(run([*stream_args(folder, run_dir, "trainer.max_steps=20"), "resume=auto"], check=False),
            "stream order", "2 files shared among 2 processes")


@pytest.mark.slow  # 9 s for a guard; CI runs it
def test_a_stream_too_short_for_one_global_batch_is_refused_rather_than_read_again_forever(tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(SPEECHES.read_text().splitlines(keepends=True)[:150]))
    # 50 training documents: some windows, fewer than one global batch of 4 x 64 windows.
    proc = run(stream_args(short, tmp_path / "run", "data.batch_size=64", "trainer.gradient_accumulation_steps=4"),
               check=False, timeout=120)
    refused(proc, "global batch", "data.path")
    message = next(line for line in proc.stdout.splitlines() if "ended before one global batch" in line)
    named(message, "data.val_documents")  # the overrides printed with it name it too
