"""data=hf_dataset: a local Hugging Face dataset in any of its formats, tokenized through Dataset.map with its
cache, padded per batch or packed into blocks (per document, or across documents), and resumed bitwise like the
built-in data; packed per document, a model's validation loss is its padded one."""

import json

import pytest
import torch

from src.data.jsonl import IGNORE_INDEX
from src.errors import UsageError
from tests.conftest import QUIET, ROOT, exported_weights, kill_when, max_abs_diff, named, put_in_hub_cache, run, scalars

datasets = pytest.importorskip("datasets")
SPEECHES = [json.loads(line)["text"] for line in (ROOT / "data" / "shakespeare_speeches.jsonl").read_text().splitlines()
            if line.strip()]


def documents(n: int = 200) -> "datasets.Dataset":
    return datasets.Dataset.from_dict({"text": SPEECHES[:n], "speaker": [str(i % 7) for i in range(n)]})


@pytest.fixture
def formats(tmp_path) -> dict:
    """The same 200 speeches as each format data.path may name."""
    docs = documents()
    docs.to_parquet(str(tmp_path / "d.parquet"))
    docs.to_json(str(tmp_path / "d.jsonl"))
    docs.to_csv(str(tmp_path / "d.csv"), index=False)
    docs.save_to_disk(str(tmp_path / "saved"))
    return {"parquet": tmp_path / "d.parquet", "jsonl": tmp_path / "d.jsonl", "csv": tmp_path / "d.csv",
            "save_to_disk": tmp_path / "saved"}


def build(**kwargs):
    from src.data.hf_dataset import HFDataset

    return HFDataset(**{"block_size": 32, "batch_size": 4, **kwargs})


def test_every_format_gives_the_same_byte_tokenized_documents_with_the_last_tenth_validating(formats):
    expected = [list(text.encode())[:32] for text in SPEECHES[:200]]
    for name, path in formats.items():
        data = build(path=str(path))
        assert data.vocab_size == 256 and (len(data.train), len(data.val)) == (180, 20), name
        assert [data.train[i]["input_ids"].tolist() for i in (0, 179)] == [expected[0], expected[179]], name
        assert data.val[19]["input_ids"].tolist() == expected[199], name
        assert torch.equal(data.train[3]["labels"], data.train[3]["input_ids"])


def test_a_named_validation_split_of_a_saved_dataset_dict_validates(tmp_path):
    datasets.DatasetDict({"train": documents(100), "test": documents(10)}).save_to_disk(str(tmp_path / "dict"))
    data = build(path=str(tmp_path / "dict"), val_split="test")
    assert (len(data.train), len(data.val)) == (100, 10)
    with pytest.raises(UsageError) as refused:
        build(path=str(tmp_path / "dict"), val_split="validation")
    named(str(refused.value), "data.val_split=validation", "train, test")  # the key, and what is there


def test_cross_document_packing_cuts_the_documents_end_to_end_into_blocks_and_masks_starts_when_asked(formats):
    stream, starts = [], set()
    for text in SPEECHES[:180]:  # the training documents; a map batch holds all of them
        starts.add(len(stream))
        stream += list(text.encode())
    data = build(path=str(formats["parquet"]), packing="cross_document", mask_boundaries=True)
    assert len(data.train) == len(stream) // 32 and data.collate_fn is None
    block = data.train[5]
    assert block["input_ids"].tolist() == stream[5 * 32 : 6 * 32] and "position_ids" not in block
    masked = [t for t in range(32) if block["labels"][t] == IGNORE_INDEX]
    assert masked == [t for t in range(1, 32) if 5 * 32 + t in starts] and masked  # a start inside this block
    unmasked = build(path=str(formats["parquet"]), packing="cross_document")
    assert torch.equal(unmasked.train[5]["labels"], block["input_ids"])


@pytest.mark.parametrize("long_documents", ["truncate", "split"])
def test_packing_per_document_batches_whole_documents_with_their_positions_and_says_what_it_cut(
        formats, caplog, long_documents):
    with caplog.at_level("INFO"):
        data = build(path=str(formats["parquet"]), block_size=64, packing=True, long_documents=long_documents)
    documents = [list(text.encode()) for text in SPEECHES[:180]]
    cut = sum(len(ids) > 64 for ids in documents)
    pieces = ([ids[:64] for ids in documents] if long_documents == "truncate" else
              [ids[i : i + 64] for ids in documents for i in range(0, len(ids), 64)])
    found = []
    for i in range(len(data.train)):
        block = data.train[i]
        positions = block["position_ids"].tolist()
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
        found += [block["input_ids"][a:b].tolist() for a, b in zip(starts, starts[1:])]
        assert all(block["labels"][a] == IGNORE_INDEX for a in starts[:-1])
    assert sorted(found) == sorted(pieces) and len(data.train) < len(pieces) and cut
    named(caplog.text, "data.packing=true", f"{len(pieces)} documents in {len(data.train)} blocks", f"{cut} longer",
          *(["data.long_documents=split"] if long_documents == "truncate" else []))
    batch = data.collate_fn([data.train[i] for i in range(3)])
    assert sorted(batch) == ["input_ids", "labels", "position_ids"]  # no attention_mask: positions say it all


def test_a_second_build_reuses_the_map_cache(formats):
    build(path=str(formats["save_to_disk"]))
    cached = sorted(p.name for p in formats["save_to_disk"].glob("cache-*.arrow"))
    assert cached  # train and validation tokenized, next to the saved dataset
    build(path=str(formats["save_to_disk"]))
    assert sorted(p.name for p in formats["save_to_disk"].glob("cache-*.arrow")) == cached


def test_the_fingerprint_of_a_saved_dataset_names_its_files_and_ignores_the_caches_runs_add(formats):
    saved = formats["save_to_disk"]
    fingerprint = build(path=str(saved)).fingerprint()
    arrow = [key for key in fingerprint if key.startswith("file ") and key.endswith(".arrow")]
    assert arrow and not any("cache-" in key for key in arrow)
    build(path=str(saved), packing=True)  # caches of other settings, written into the folder
    assert build(path=str(saved)).fingerprint() == fingerprint


@pytest.mark.parametrize("kwargs, names", [
    ({"text_column": "body"}, ("data.text_column=body", "{path}", "text, speaker")),
    ({"split": "validation"}, ("data.split=validation", "{path}", "train")),
    ({"mask_boundaries": True}, ("data.mask_boundaries=true", "data.packing=cross_document")),
    ({"mask_boundaries": True, "packing": True}, ("data.mask_boundaries=true", "data.packing=cross_document")),
    ({"long_documents": "split"}, ("data.long_documents=split", "data.packing=true")),
])
def test_a_column_or_split_that_does_not_exist_is_refused_naming_what_there_is(formats, kwargs, names):
    with pytest.raises(UsageError) as error:
        build(path=str(formats["parquet"]), **kwargs)
    named(str(error.value), *(name.format(path=formats["parquet"]) for name in names))
    suggested = next((name.split("=")[1] for name in names if name.startswith("data.packing=")), None)
    if suggested:  # the suggestion, typed
        packing = {"true": True, "cross_document": "cross_document"}[suggested]
        assert build(path=str(formats["parquet"]), **{**kwargs, "packing": packing}).train


CARD = """---
configs:
- config_name: speeches
  data_files:
  - {split: train, path: speeches/train-*}
  - {split: test, path: speeches/test-*}
- config_name: short
  data_files:
  - {split: train, path: short/train-*}
---
Speeches from tiny Shakespeare, in two subsets.
"""


@pytest.fixture
def hub_dataset(tmp_path, offline_hub) -> str:
    """A dataset repository as the hub holds one, cached as `hf download` leaves it: a card naming two subsets,
    each a folder of Parquet files (the same folder, local, is tmp_path / "repo")."""
    repo = tmp_path / "repo"
    for name, docs in (("speeches/train", documents(180)), ("speeches/test", documents(200).select(range(180, 200))),
                       ("short/train", documents(50))):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        docs.to_parquet(str(repo / f"{name}-00000-of-00001.parquet"))
    (repo / "README.md").write_text(CARD)
    put_in_hub_cache(repo, offline_hub.parent, "tiny-org/speeches", "dataset")
    return "tiny-org/speeches"


def test_a_hub_dataset_id_reads_the_chosen_subset_from_the_hugging_face_cache_as_its_folder_would(
        tmp_path, hub_dataset):
    data = build(path=hub_dataset, subset="speeches", val_split="test")
    local = build(path=str(tmp_path / "repo"), subset="speeches", val_split="test")
    assert (len(data.train), len(data.val)) == (180, 20)
    assert data.val[19]["input_ids"].tolist() == list(SPEECHES[199].encode())[:32]
    assert data.fingerprint() == local.fingerprint()  # the same files, documents and ids
    assert "file speeches/train-00000-of-00001.parquet" in data.fingerprint()  # a key of the fingerprint
    short = build(path=hub_dataset, subset="short")
    assert (len(short.train), len(short.val)) == (45, 5)


def test_only_the_data_files_a_dataset_card_gives_the_subset_are_fetched(tmp_path):
    """A repository may hold many large subsets (wikitext: 4, one of them 300 MB): its card's `configs` name
    each one's files, and the fetch asks for those alone; where the card does not say, for every data file."""
    from src.models.hub import subset_files

    (tmp_path / "README.md").write_text(CARD)
    assert subset_files(tmp_path / "README.md", "short") == ["short/train-*"]
    assert subset_files(tmp_path / "README.md", "speeches") == ["speeches/train-*", "speeches/test-*"]
    assert subset_files(tmp_path / "README.md", None) == []  # two subsets, none the default: datasets asks which
    assert subset_files(tmp_path / "README.md", "long") == []  # not in the card: datasets names those there are
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: all\n  default: true\n  data_files: "
                                        "data/*.parquet\n- config_name: other\n  data_files: [o/a.csv, o/b.csv]\n"
                                        "---\n")
    assert subset_files(tmp_path / "README.md", None) == ["data/*.parquet"]
    assert subset_files(tmp_path / "README.md", "other") == ["o/a.csv", "o/b.csv"]
    assert subset_files(tmp_path / "no_card.md", "short") == []


@pytest.mark.parametrize("kwargs, names", [
    ({}, ("data.subset", "tiny-org/speeches", "speeches, short", "data.subset=NAME")),
    ({"subset": "long"}, ("data.subset=long", "tiny-org/speeches", "speeches, short")),
    ({"path": "nobody/nothing"}, ("data.path=nobody/nothing", "hf download nobody/nothing --repo-type dataset")),
])
def test_a_hub_dataset_without_the_subset_asked_for_or_out_of_reach_is_refused_naming_the_key(hub_dataset, kwargs,
                                                                                             names):
    with pytest.raises(UsageError) as error:
        build(**{"path": hub_dataset, **kwargs})
    named(str(error.value), *names)
    if "speeches, short" in names:  # a subset it names, typed
        assert build(**{"path": hub_dataset, **kwargs, "subset": "short"}).train


def test_a_subset_of_one_file_is_refused(formats):
    with pytest.raises(UsageError) as refused:
        build(path=str(formats["parquet"]), subset="short")
    named(str(refused.value), "data.subset=short", str(formats["parquet"]))


@pytest.mark.slow  # 5 s; resumes of every other data option stay in the default suite; CI runs it
def test_a_packed_hf_dataset_run_of_a_transformers_model_killed_on_two_processes_resumes_bitwise(tmp_path, formats):
    """Two processes of one machine: rank 0 maps first, rank 1 reads its cache. Then a kill and a resume of a
    transformers model with its dropout on and accumulation: losses and weights bitwise the uninterrupted run's."""
    dropout = [f"model.config.{key}=0.1" for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")]
    args = ["model=hf_causal_lm", "model.config.n_layer=2", "model.config.n_embd=32", "model.config.n_head=2",
            *dropout, "model.block_size=32", "data=hf_dataset", f"data.path={formats['parquet']}", "data.packing=true",
            "objective=causal_lm", "data.batch_size=2",
            "trainer.gradient_accumulation_steps=2", "trainer.max_steps=8", "trainer.checkpoint_every=4",
            "trainer.monitor=null", *QUIET]
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    run([*args, f"hydra.run.dir={reference}"], nproc=2)
    kill_when([*args, f"hydra.run.dir={killed}"], 2, ready=lambda: (killed / "checkpoints" / "step_00000004").is_dir())
    assert not (killed / "model").exists()
    run([*args, f"hydra.run.dir={killed}", "resume=auto"], nproc=2)
    assert scalars(killed, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(killed)) == 0


MODELS = {
    "template_gpt": ["model=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2"],
    "llama": ["model=hf_causal_lm", "~model.config", "+model.config={model_type: llama, hidden_size: 32, "
              "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, "
              "vocab_size: ${dataset:vocab_size}, max_position_embeddings: 64}"],
}


@pytest.mark.parametrize("model", MODELS)
def test_a_models_validation_loss_is_the_same_packed_per_document_or_padded_on_one_and_two_processes(
        tmp_path, formats, model):
    """Each validation document whole in a packed block, attending to itself only: every token's loss is its
    padded one, so the mean over the split is too, whatever the number of processes."""
    run([*MODELS[model], "model.block_size=64", "data=hf_dataset", f"data.path={formats['parquet']}",
         "objective=causal_lm", "trainer.max_steps=3", "data.batch_size=4", *QUIET, f"hydra.run.dir={tmp_path}/run"])
    losses = {}
    for packing, nproc in (("false", 1), ("true", 1), ("true", 2)):
        output = tmp_path / f"{packing}_{nproc}.json"
        run([f"path={tmp_path / 'run' / 'model'}", f"+data.packing={packing}", f"output={output}"], script="eval.py",
            nproc=nproc)
        losses[packing, nproc] = json.loads(output.read_text())["eval/loss"]
    padded = losses["false", 1]
    assert abs(losses["true", 1] - padded) < 1e-5 and abs(losses["true", 2] - padded) < 1e-5, losses


@pytest.mark.parametrize("packing", [False, True, "cross_document"])
def test_tokenizing_on_several_processes_gives_the_samples_of_one(tmp_path, packing):
    """data.num_proc slices the rows among processes; the samples (packed blocks included, which are made from
    batches of rows) are those of one process, so a machine with other CPUs resumes on the same data."""
    rows = datasets.Dataset.from_dict({"text": (SPEECHES * 2)[:2500] + [""] * 10,
                                       "prompt": [f"{i}:" for i in range(2510)]})
    built = {}
    for num_proc in (1, 3):
        rows.to_parquet(str(tmp_path / f"rows_{num_proc}.parquet"))  # a file each: no cache shared
        data = build(path=str(tmp_path / f"rows_{num_proc}.parquet"), prompt_column="prompt", packing=packing,
                     num_proc=num_proc, block_size=256)
        built[num_proc] = [{key: value.tolist() for key, value in data.train[i].items()} for i in range(len(data.train))]
    assert built[1] == built[3] and len(built[1]) > 100


@pytest.mark.slow  # a corpus large enough to take seconds to tokenize
def test_ranks_wait_for_a_tokenization_longer_than_the_process_groups_time_out(tmp_path):
    """Each machine's first process tokenizes while the others wait, as long as it takes: at
    trainer.dist_timeout_s the waiting rank's barrier used to fail and end the run before its first step."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": SPEECHES[i % len(SPEECHES)][:200]}) + "\n" for i in range(200_000)))
    proc = run(["model=hf_causal_lm", "data=hf_dataset", f"data.path={corpus}", "objective=causal_lm", "data.num_proc=1",
                "model.config.n_layer=1", "model.config.n_head=1", "model.config.n_embd=16", "model.block_size=64",
                "trainer.max_steps=2", "trainer.dist_timeout_s=1", *QUIET, f"hydra.run.dir={tmp_path / 'run'}"],
               nproc=2)
    assert (tmp_path / "run" / "model").is_dir(), proc.stdout[-3000:]
