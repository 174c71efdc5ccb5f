"""A corpus streamed as it trains (data=stream): read in a fixed order, resumed exactly by reading it again to
the run's position, refused on a layout that would read it in another order."""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import QUIET, ROOT, TINY_GPT, exported_weights, kill_when, max_abs_diff, refused, run, scalars

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
    stream = [b for text in texts[100:1100] for b in text.encode()]  # the first map batch's documents, as bytes
    for i, sample in zip(range(50), data.train):
        assert sample["input_ids"].tolist() == stream[16 * i : 16 * i + 16]
        assert sample["labels"].tolist() == stream[16 * i + 1 : 16 * i + 17]
    held_out = [b for text in texts[:100] for b in text.encode()]
    assert data.val[0][0].tolist() == held_out[:16] and len(data.val) == (len(held_out) - 1) // 16
    with pytest.raises(UsageError, match="data.text_column=body.*its columns: text"):
        StreamData(path=str(SPEECHES), block_size=16, text_column="body")


@pytest.mark.slow  # 15 s, four launches; the stream's order is the in-process test's; CI runs it
def test_a_streamed_run_killed_mid_run_resumes_bitwise_and_two_processes_train_what_one_accumulating_does(
        tmp_path):
    one, killed, two = tmp_path / "one", tmp_path / "killed", tmp_path / "two"
    accumulating = "trainer.gradient_accumulation_steps=2"
    run(stream_args(SPEECHES, one, accumulating))
    kill_when(stream_args(SPEECHES, killed, accumulating), 1,
              ready=lambda: (killed / "checkpoints" / "step_00000010").is_dir())
    assert not (killed / "model").exists()
    resumed = run([*stream_args(SPEECHES, killed, accumulating), "resume=auto"])
    assert "resuming 80 samples into pass 0" in resumed.stdout  # where in the stream it picks up (step 10)
    assert scalars(killed, "train/loss") == scalars(one, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0
    # The summary says where in the stream the run ended: 30 steps of 2 micro-batches of 4 windows.
    assert re.search(r"windows of \d+ tokens read in this pass +240\n", resumed.stdout), resumed.stdout[-2000:]
    # One file, so one stream for every process: each takes its share of each global batch in the stream's order.
    run(stream_args(SPEECHES, two), nproc=2)
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5


@pytest.mark.slow  # 8 s, two launches; CI runs it
def test_a_stream_whose_files_are_shared_among_processes_refuses_to_resume_on_another_count(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    lines = SPEECHES.read_text().splitlines(keepends=True)
    for part in range(2):
        (folder / f"part{part}.jsonl").write_text("".join(lines[part::2]))
    run_dir = tmp_path / "run"
    run(stream_args(folder, run_dir, "trainer.max_steps=10"), nproc=2)
    refused(run([*stream_args(folder, run_dir, "trainer.max_steps=20"), "resume=auto"], check=False),
            "stream order", "2 files shared among 2 processes")


@pytest.mark.slow  # 9 s for a guard; CI runs it
def test_a_stream_too_short_for_one_global_batch_is_refused_rather_than_read_again_forever(tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(SPEECHES.read_text().splitlines(keepends=True)[:150]))
    # 50 training documents: some windows, fewer than one global batch of 4 x 64 windows.
    refused(run(stream_args(short, tmp_path / "run", "data.batch_size=64", "trainer.gradient_accumulation_steps=4"),
                check=False, timeout=120), "global batch", "data.path")
