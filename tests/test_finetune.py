"""Fine-tuning: a run starts from a pretrained model, a from_pretrained folder or a hub id (weights, architecture,
tokenizer), resumes bitwise, and exports a folder that another run fine-tunes in turn."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from src.errors import UsageError
from tests.conftest import (
    HF_HOME,
    PRETRAINED_VOCAB,
    QUIET,
    ROOT,
    exported_weights,
    kill_when,
    max_abs_diff,
    named,
    put_in_hub_cache,
    refused,
    run,
    scalars,
)

transformers = pytest.importorskip("transformers")
VOCAB = PRETRAINED_VOCAB


def finetune_args(pretrained, run_dir, batch_size: int = 8) -> list[str]:
    return ["model=hf_causal_lm", f"model.pretrained={pretrained}", "model.block_size=48", "data=jsonl",
            "objective=causal_lm", f"data.batch_size={batch_size}", "optimizer.lr=3e-3", "scheduler.warmup_steps=2",
            *QUIET, f"hydra.run.dir={run_dir}"]


def test_a_run_starts_from_a_pretrained_folder_with_its_tokenizer_and_its_export_is_fine_tuned_by_another(
        tmp_path, pretrained):
    first, second = tmp_path / "first", tmp_path / "second"
    run([*finetune_args(pretrained, first), "trainer.max_steps=12", "trainer.checkpoint_every=12"])
    # Step 1's loss is the pretrained weights' (random ones score about ln 320 = 5.8 on the tokenizer's ids).
    first_losses = scalars(first, "train/loss")
    assert first_losses[1] < math.log(VOCAB) - 1.0
    data = json.loads((first / "checkpoints" / "step_00000012" / "data.json").read_text())
    assert data["vocab_size"] == VOCAB  # the folder's tokenizer, not bytes (256)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (first / "model" / name).is_file(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(first / "model")
    assert tokenizer.get_vocab() == transformers.AutoTokenizer.from_pretrained(pretrained).get_vocab()

    # The export is a from_pretrained folder again: the next run starts where this one ended.
    run([*finetune_args(first / "model", second), "trainer.max_steps=2", "trainer.sample_every=2",
         "trainer.sample_tokens=8", "trainer.sample_prompts=[To be]"])
    assert "sample 0 at step 2:\nTo be" in (second / "train.log").read_text()  # transformers' generate
    second_losses = scalars(second, "train/loss")
    assert second_losses[1] < first_losses[1]  # the same first batch (same seed), scored by the trained weights
    assert (second / "model" / "tokenizer.json").is_file()
    from src.checkpointing.export import load_exported_model

    exported = load_exported_model(second / "model")
    assert exported.get_input_embeddings().num_embeddings == VOCAB
    sampled = run([str(second / "model"), "--prompt", "To be", "--tokens", "8"], command=[sys.executable, "sample.py"])
    assert sampled.stdout.startswith("To be"), sampled.stdout


def test_a_fine_tuning_run_killed_mid_run_resumes_bitwise(tmp_path, pretrained):
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    args = ["trainer.max_steps=12", "trainer.checkpoint_every=4", "trainer.monitor=null",
            "model.attn_implementation=eager"]
    run([*finetune_args(pretrained, reference), *args])
    kill_when([*finetune_args(pretrained, killed), *args], 1,
              ready=lambda: (killed / "checkpoints" / "step_00000004").is_dir())
    assert not (killed / "model").exists()
    run([*finetune_args(pretrained, killed), *args, "resume=auto"])
    assert scalars(killed, "train/loss") == scalars(reference, "train/loss")


def test_pretrained_weights_load_in_the_dtype_and_attention_kernel_asked_for(pretrained):
    from src.models.hf_causal_lm import causal_lm_from_config

    model = causal_lm_from_config({}, block_size=48, pretrained=str(pretrained), dtype="bfloat16",
                                  attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"


def test_another_runs_weights_for_a_pretrained_model_are_refused_and_its_folder_as_model_pretrained_accepted(
        pretrained):
    """trainer.init_weights with model.pretrained: the refusal suggests model.pretrained=PATH; typed, it builds."""
    from omegaconf import OmegaConf

    from src.checkpointing.load import load_initial_weights
    from src.models.hf_causal_lm import causal_lm_from_config

    model = causal_lm_from_config({}, block_size=48, pretrained=str(pretrained))
    with pytest.raises(UsageError) as refused:
        load_initial_weights(model, pretrained, OmegaConf.create({"pretrained": "gpt2"}), None, {})
    named(str(refused.value), f"trainer.init_weights={pretrained}", "model.pretrained=PATH")
    typed = causal_lm_from_config({}, block_size=48, pretrained=str(pretrained))  # PATH: the run's folder
    assert all(torch.equal(a, b) for a, b in zip(typed.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("case, names", [
    ("missing", ("model.pretrained={p}", "no such folder")),
    ("no_config", ("model.pretrained={p}", "config.json")),
    ("no_weights", ("model.pretrained={p}", "model.safetensors")),
    ("positions", ("model.block_size=65", "64 positions", "model.pretrained={p}")),
    ("peft_target", ("model.peft=", "'q_proj'", "not found")),
])
def test_a_pretrained_folder_that_cannot_serve_is_refused_naming_the_key(tmp_path, pretrained, case, names):
    from src.models.hf_causal_lm import causal_lm_from_config

    folder = {"missing": tmp_path / "nothing", "no_config": tmp_path, "no_weights": tmp_path}.get(case, pretrained)
    if case == "no_weights":  # config.json alone: the weights were not copied
        (tmp_path / "config.json").write_text((pretrained / "config.json").read_text())
    kwargs = {"positions": {"block_size": 65},
              "peft_target": {"peft": {"peft_type": "LORA", "target_modules": ["q_proj"]}}}.get(case, {})
    if case == "peft_target":
        pytest.importorskip("peft")
    with pytest.raises(UsageError) as error:
        causal_lm_from_config({}, **{"block_size": 48, "pretrained": str(folder), **kwargs})
    named(str(error.value), *(name.format(p=folder) for name in names))


def test_data_with_more_token_ids_than_a_pretrained_model_embeds_is_refused_before_training(pretrained):
    from omegaconf import OmegaConf

    from src.models.hf_causal_lm import causal_lm_from_config
    from src.run import check_vocabulary_fits

    model = causal_lm_from_config({}, block_size=48, pretrained=str(pretrained))
    check_vocabulary_fits(model, {"vocab_size": VOCAB}, OmegaConf.create({"pretrained": str(pretrained)}))
    with pytest.raises(UsageError) as refused:
        check_vocabulary_fits(model, {"vocab_size": 400}, OmegaConf.create({"pretrained": str(pretrained)}))
    named(str(refused.value), "400", f"model.pretrained={pretrained}", "320", "data.tokenizer=PATH")


def test_data_whose_ids_another_tokenizer_made_is_refused_for_a_pretrained_model_even_where_they_fit(
        tmp_path, pretrained):
    """Bytes fit a 320-token embedding, so only the tokenizers' identities tell: shards prepared with another
    tokenizer, and a data.tokenizer given, are refused before anything is written; the model's own tokenizer, and
    shards prepared with it (its file saved beside them), are accepted, as is a folder of weights alone."""
    from omegaconf import OmegaConf

    from src.data.jsonl import JsonlData
    from src.data.shards import ShardData
    from src.run import check_tokenized_for_pretrained

    model_cfg = OmegaConf.create({"pretrained": str(pretrained)})
    speeches = str(ROOT / "data" / "shakespeare_speeches.jsonl")
    for tokenizer in ("byte", str(pretrained)):
        out = tmp_path / ("bytes" if tokenizer == "byte" else "model_tokenizer")
        run([speeches, str(out), "--tokenizer", tokenizer], script="scripts/prepare_data.py")
        shards, jsonl = (ShardData(path=str(out), block_size=32, batch_size=2),
                         JsonlData(path=speeches, tokenizer=tokenizer, block_size=32, batch_size=2))
        for data in (shards, jsonl):
            if tokenizer == "byte":
                with pytest.raises(UsageError) as error:
                    check_tokenized_for_pretrained(data, model_cfg)
                named(str(error.value), f"model.pretrained={pretrained}", "bytes", "data.tokenizer",
                      f"--tokenizer {pretrained}")
            else:
                check_tokenized_for_pretrained(data, model_cfg)
    weights_alone = tmp_path / "weights_alone"
    weights_alone.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_alone / name).write_bytes((pretrained / name).read_bytes())
    check_tokenized_for_pretrained(shards, OmegaConf.create({"pretrained": str(weights_alone)}))
    proc = run(["model=hf_causal_lm", f"model.pretrained={pretrained}", "model.block_size=32", "data=shards",
                f"data.path={tmp_path / 'bytes'}", "objective=causal_lm", "trainer.max_steps=1",
                f"hydra.run.dir={tmp_path / 'run'}"], check=False)
    refused(proc, "bytes", "--tokenizer")
    assert not (tmp_path / "run").exists()


def test_text_data_reads_a_pretrained_folders_tokenizer_and_refuses_a_folder_without_one(tmp_path, pretrained):
    from src.data.text import TextData

    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 40)
    data = TextData(path=str(text), tokenizer=str(pretrained), block_size=16)
    assert data.vocab_size == VOCAB
    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    inputs, _ = data.train[0]
    assert data.codec.decode(inputs.tolist()) == tokenizer.decode(inputs.tolist())
    assert inputs.tolist() == tokenizer(text.read_text())["input_ids"][:16]
    with pytest.raises(UsageError, match=rf"data.tokenizer={tmp_path}: the folder has no tokenizer.json"):
        TextData(path=str(text), tokenizer=str(tmp_path), block_size=16)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft, not ours
def test_lora_trains_only_its_adapter_the_same_however_the_batch_is_split_resumes_bitwise_and_exports_both(
        tmp_path, pretrained):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    # Text in fixed windows (data=text, tokenized by the folder's tokenizer). Across layouts the weights agree to
    # float rounding, 1e-5 as the README says (a transformers GPT-2 differs by about 1e-7 here); a resume on the
    # same layout is bitwise.
    def args(run_dir, *extra):
        return ["model=hf_causal_lm", f"model.pretrained={pretrained}", "model.block_size=48", "data.batch_size=4",
                "model.peft={peft_type: LORA, r: 4, lora_alpha: 8, target_modules: [c_attn]}", "optimizer.lr=3e-3",
                "trainer.max_steps=6", "trainer.checkpoint_every=3", "trainer.monitor=null", *QUIET,
                f"hydra.run.dir={run_dir}", *extra]

    two, one, killed = tmp_path / "two_processes", tmp_path / "one_accumulating", tmp_path / "killed"
    run(args(two), nproc=2)

    def accumulating(run_dir):
        return args(run_dir, "trainer.gradient_accumulation_steps=2")

    log = run(accumulating(one)).stdout  # not a terminal: no progress bars of transformers' loads and saves
    assert not re.search(r"Loading weights|Writing model shards|is_gradient_checkpointing", log), log
    losses = scalars(one, "train/loss")
    assert max(abs(scalars(two, "train/loss")[s] - losses[s]) for s in losses) <= 1e-5
    assert max_abs_diff(exported_weights(two), exported_weights(one)) <= 1e-5
    banner = re.search(r"parameters\s+: ([\d,]+) \(([\d,]+) trainable", (two / "train.log").read_text())
    total, trainable = (int(n.replace(",", "")) for n in banner.groups())
    assert 0 < trainable < total / 10  # the adapter: 2 layers x r 4 x (32 + 96)

    # The merged export differs from the pretrained weights in the adapted matrices only.
    before, after = load_file(pretrained / "model.safetensors"), exported_weights(two)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)}
    # ... and the adapter folder, on the pretrained model, is the same model.
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    adapted = peft.PeftModel.from_pretrained(base, two / "model" / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(two / "model").eval()
    ids = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits)

    kill_when(accumulating(killed), 1, ready=lambda: (killed / "checkpoints" / "step_00000003").is_dir())
    run([*accumulating(killed), "resume=auto"])
    assert scalars(killed, "train/loss") == scalars(one, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0
    # The checkpoints hold the adapter, not the frozen base the resume read from model.pretrained again.
    saved = load_file(killed / "checkpoints" / "step_00000003" / "model.safetensors")
    assert saved and all("lora_" in name for name in saved), sorted(saved)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft, not ours
def test_a_lora_checkpoint_is_refused_once_its_base_weights_have_changed(tmp_path, pretrained):
    """Its checkpoints leave the base weights out (every start reads them from model.pretrained): a resume, or
    eval.py, on another base would silently train or score another model."""
    pytest.importorskip("peft")
    import shutil

    from safetensors.torch import load_file, save_file

    base, run_dir = tmp_path / "base", tmp_path / "run"
    shutil.copytree(pretrained, base)
    args = ["model=hf_causal_lm", f"model.pretrained={base}", "model.block_size=48", "data.batch_size=4",
            "model.peft={peft_type: LORA, r: 4, lora_alpha: 8, target_modules: [c_attn]}", "trainer.monitor=null",
            "trainer.checkpoint_every=2", *QUIET, f"hydra.run.dir={run_dir}"]
    from src.checkpointing.for_eval import load_checkpointed_model, run_config_for

    run([*args, "trainer.max_steps=2"])
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    load_checkpointed_model(checkpoint, run_config_for(checkpoint))  # eval.py's: the folder's base, the adapter saved
    weights = load_file(base / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"] += 1e-3  # a weight the adapter does not touch
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    refused(run([*args, "trainer.max_steps=3", "resume=auto"], check=False), str(base), "file model.safetensors",
            "model.pretrained")
    with pytest.raises(UsageError) as error:
        load_checkpointed_model(checkpoint, run_config_for(checkpoint))
    named(str(error.value), str(base), "file model.safetensors", "model.pretrained")


def test_the_base_weights_fingerprint_covers_every_byte_and_is_hashed_once_per_version_of_a_file(tmp_path,
                                                                                                monkeypatch):
    """A byte changed anywhere in a large base file changes it (a sample of a megabyte would miss most); the hash of
    a file is kept by its size and modification time, so the next start reads nothing."""
    from types import SimpleNamespace

    from src.checkpointing import checksums
    from src.checkpointing.training_state import base_weights

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "base"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * (4 << 12))  # 4 MiB: 16 sampled chunks of 64 KiB cover a quarter
    model = SimpleNamespace(config=SimpleNamespace(name_or_path=str(folder)))
    before, sampled = base_weights(model), base_weights(model, sampled=True)
    data = bytearray(weights.read_bytes())
    data[(1 << 20) + 3 * (1 << 15)] ^= 0xFF  # between two sampled chunks
    weights.write_bytes(bytes(data))
    assert base_weights(model, sampled=True) == sampled  # what checkpoints recorded before: blind to it
    assert base_weights(model) != before
    def read_again(*args):
        raise AssertionError(f"{weights} was hashed again")

    monkeypatch.setattr(checksums.hashlib, "file_digest", read_again)
    assert base_weights(model) != before  # the same size and time: the cached hash, no read


def test_a_hub_id_trains_as_its_folder_does_read_from_the_hugging_face_cache(tmp_path, pretrained):
    """Offline (the suite sets HF_HUB_OFFLINE=1), as on compute nodes after `hf download` on a login node: the
    id's cached snapshot serves as the model's folder and as the data's tokenizer; the run is the folder's run."""
    repo_id = f"tiny-org/{tmp_path.name}"  # in the suite's Hugging Face cache (conftest's HF_HOME), its own
    snapshot = put_in_hub_cache(pretrained, Path(HF_HOME), repo_id)
    by_id, by_folder = tmp_path / "by_id", tmp_path / "by_folder"
    args = ["trainer.max_steps=3", "trainer.monitor=null"]
    proc = run([*finetune_args(repo_id, by_id), *args])
    run([*finetune_args(pretrained, by_folder), *args])
    assert (f"model.pretrained and data.tokenizer={repo_id}: the Hugging Face hub's revision {snapshot.name}, "
            f"in {snapshot}") in proc.stdout
    assert scalars(by_id, "train/loss") == scalars(by_folder, "train/loss")
    assert max_abs_diff(exported_weights(by_id), exported_weights(by_folder)) == 0
    assert (by_id / "model" / "tokenizer.json").read_bytes() == (pretrained / "tokenizer.json").read_bytes()
    # sample.py reads the id as its folder too: the base model's text, before any fine-tuning.
    sampled = [run([name, "--prompt", "To be", "--tokens", "8"], command=[sys.executable, "sample.py"]).stdout
               for name in (repo_id, str(pretrained))]
    assert sampled[0].startswith("To be") and sampled[0] == sampled[1], sampled


@pytest.mark.slow  # 5.5 s; a hub id's training stays in the default suite (the suite's time); CI runs it
def test_a_hub_models_commit_is_recorded_and_a_resume_reads_it_after_the_hub_has_moved_on(tmp_path, pretrained):
    """The run starts from the newest revision, A, and records its commit; then main becomes B, whose tokenizer
    and positions differ. Reading B, the resume would be refused (other data, a block longer than B's 32
    positions) and eval.py would score other ids; both read A."""
    from omegaconf import OmegaConf

    repo_id, a, b = f"tiny-org/{tmp_path.name}", "a" * 40, "b" * 40
    put_in_hub_cache(pretrained, Path(HF_HOME), repo_id, commit=a)
    args = ["trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.monitor=null"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run([*finetune_args(repo_id, whole), *args])
    saved = OmegaConf.load(whole / "config.yaml")
    assert saved.model.revision == a and saved.data.tokenizer_revision == a  # the tokenizer: the same id's
    kill_when([*finetune_args(repo_id, killed), *args], 1,
              ready=lambda: (killed / "checkpoints" / "step_00000002").is_dir())

    newer = tmp_path / "newer"
    newer.mkdir()
    for file in pretrained.iterdir():
        (newer / file.name).write_bytes(file.read_bytes())
    tokenizer = json.loads((newer / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Lowercase"}
    (newer / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((newer / "config.json").read_text())
    (newer / "config.json").write_text(json.dumps({**config, "n_positions": 32}))
    put_in_hub_cache(newer, Path(HF_HOME), repo_id, commit=b)  # main -> B

    run([*finetune_args(repo_id, killed), *args, "resume=auto"])
    assert scalars(killed, "train/loss") == scalars(whole, "train/loss")
    # eval.py rebuilds the data from the run's config: its tokenizer at A too, so the run's last evaluation again.
    run([f"path={whole / 'model'}", "eval_batches=4"], script="eval.py")
    report = json.loads((whole / "model" / "eval_metrics.json").read_text())
    assert abs(report["eval/loss"] - scalars(whole, "eval/loss")[6]) < 1e-5


@pytest.mark.parametrize("key", ["model.pretrained", "data.tokenizer"])
def test_a_hub_id_neither_cached_nor_reachable_is_refused_naming_the_key_and_the_download(offline_hub, key):
    from src.models.hub import local_path

    with pytest.raises(UsageError) as error:
        local_path("nobody/nothing", key)
    named(str(error.value), f"{key}=nobody/nothing", "HF_HUB_OFFLINE", str(offline_hub), "hf download nobody/nothing")


def test_an_existing_path_wins_over_a_hub_id_of_the_same_name(offline_hub, tmp_path, monkeypatch):
    from src.models.hub import is_hub_id, local_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-org" / "tiny-gpt2").mkdir(parents=True)
    assert local_path("tiny-org/tiny-gpt2", "model.pretrained") == Path("tiny-org/tiny-gpt2")
    assert [name for name in ("gpt2", "Qwen/Qwen2.5-0.5B", "tiny-org/tiny-gpt2", "outputs/RUN/model", "/models/gpt2",
                              "./gpt2", "~/gpt2") if is_hub_id(name)] == ["gpt2", "Qwen/Qwen2.5-0.5B"]


# Instruction tuning: a question and its answer per line; only the answer is trained on.
PAIRS = [{"prompt": f"Question {i}: who speaks?\nAnswer:", "text": f" ROMEO, the {i}th time."} for i in range(40)]


def write_pairs(tmp_path, pairs=PAIRS):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return path


def test_a_prompted_sample_trains_on_its_completion_alone_ended_by_the_tokenizers_end_of_text(tmp_path, pretrained):
    from src.data.jsonl import IGNORE_INDEX, JsonlData, pad_right
    from src.objectives.classification import CausalLM

    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    data = JsonlData(block_size=48, path=str(write_pairs(tmp_path)), prompt_key="prompt", tokenizer=str(pretrained),
                     batch_size=4)
    prompt, answer = (tokenizer(PAIRS[0][key])["input_ids"] for key in ("prompt", "text"))
    end = [tokenizer.eos_token_id]
    sample = data.train[0]
    assert sample["input_ids"].tolist() == prompt + answer + end
    assert sample["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + answer + end
    # The loss counts the answer's tokens and the end of text, whatever the prompts' lengths.
    batch = pad_right([data.train[i] for i in range(4)], pad_id=0)
    answers = sum(len(tokenizer(PAIRS[i]["text"])["input_ids"]) + 1 for i in range(4))
    assert CausalLM().count(batch["labels"]) == answers

    by_bytes = JsonlData(block_size=64, path=str(write_pairs(tmp_path)), prompt_key="prompt", batch_size=4)
    assert by_bytes.train[0]["labels"].tolist()[-1] == ord(".")  # no end-of-text token to append


def with_a_bos_token(pretrained, folder):
    """The pretrained folder's tokenizer, made to start every text with a BOS token as Llama's, Mistral's and Gemma's
    tokenizer.json do (a TemplateProcessing post-processor)."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    shutil.copytree(pretrained, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<s>"])
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, bos


@pytest.mark.parametrize("bos", [False, True], ids=["without BOS", "with a BOS token"])
def test_a_prompt_and_its_completion_are_tokenized_together_with_one_bos_as_trl_does(tmp_path, pretrained, bos):
    """TRL's rule: prompt + completion tokenized as one text, as many leading labels -100 as the prompt alone has
    tokens, the end of text appended. A BOS token starts the sample once, the prompt's, never the completion's."""
    from src.data.jsonl import IGNORE_INDEX, JsonlData

    folder, bos_id = with_a_bos_token(pretrained, tmp_path / "bos") if bos else (pretrained, None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    data = JsonlData(block_size=48, path=str(write_pairs(tmp_path)), prompt_key="prompt", tokenizer=str(folder),
                     batch_size=4)
    whole = tokenizer(PAIRS[0]["prompt"] + PAIRS[0]["text"])["input_ids"] + [tokenizer.eos_token_id]
    prompt = len(tokenizer(PAIRS[0]["prompt"])["input_ids"])
    sample = data.train[0]
    assert sample["input_ids"].tolist() == whole
    assert sample["labels"].tolist() == [IGNORE_INDEX] * prompt + whole[prompt:]
    assert sample["input_ids"].tolist().count(bos_id) == (1 if bos else 0) and whole[0] == (bos_id or whole[0])


def test_a_chat_is_tokenized_without_the_tokenizers_bos_since_its_template_writes_its_own(tmp_path, pretrained):
    from src.data.jsonl import IGNORE_INDEX, JsonlData

    folder, bos_id = with_a_bos_token(pretrained, tmp_path / "bos")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "<s>" + CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"prompt": [{"role": "user", "content": f"who speaks {i}?"}],
             "text": [{"role": "assistant", "content": f"ROMEO {i}"}]} for i in range(10)]
    data = JsonlData(block_size=64, path=str(write_pairs(tmp_path, rows)), prompt_key="prompt", tokenizer=str(folder),
                     batch_size=4)
    ids, labels = data.train[0]["input_ids"].tolist(), data.train[0]["labels"].tolist()
    assert ids[0] == bos_id and ids.count(bos_id) == 1  # the template's, and no second one from the tokenizer
    assert labels[0] == IGNORE_INDEX and labels[-1] != IGNORE_INDEX


def test_documents_that_tokenize_to_nothing_are_skipped_by_every_option_and_packing_never_meets_one(tmp_path):
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from src.data.hf_dataset import HFDataset
    from src.data.jsonl import JsonlData

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "speech": 1, "answer": 2, "Q:": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))  # blank text is no token at all
    rows = [{"text": ("  \n" if i % 2 else "") if i % 3 == 0 else f"speech {i}"} for i in range(30)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "docs.parquet"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    # A completion without tokens trains nothing; an empty prompt is a prompt like any other.
    pairs = [{"prompt": "" if i % 2 else "Q:", "text": " " if i % 5 == 0 else f" answer {i}"} for i in range(30)]
    datasets.Dataset.from_list(pairs).to_parquet(str(tmp_path / "pairs.parquet"))
    kept = {"plain": 20, "prompted": 24}
    for options, kind in (({}, "plain"), ({"prompt_column": "prompt"}, "prompted")):
        path = tmp_path / ("docs.parquet" if kind == "plain" else "pairs.parquet")
        for packing in (False, True, "cross_document"):
            data = HFDataset(path=str(path), block_size=16, packing=packing, batch_size=4, val_fraction=0.5,
                             tokenizer=str(tmp_path / "words.json"), **options)
            samples = [data.train[i] for i in range(len(data.train))] + [data.val[i] for i in range(len(data.val))]
            assert all(len(s["input_ids"]) == len(s["labels"]) > 0 for s in samples)
            if packing is True:  # every document of the blocks, counted by where its positions restart
                documents = sum(int((s["position_ids"] == 0).sum()) for s in samples)
                assert documents == kept[kind], (kind, documents)
                data.collate_fn(samples[:4])
            elif packing is False:
                assert len(samples) == kept[kind]
    jsonl = JsonlData(block_size=16, path=str(tmp_path / "docs.jsonl"), batch_size=4,
                      tokenizer=str(tmp_path / "words.json"))
    assert len(jsonl.train) + len(jsonl.val) == kept["plain"]


def test_hugging_face_datasets_prompt_the_same_way_padded_or_packed(tmp_path, pretrained):
    datasets = pytest.importorskip("datasets")
    from src.data.hf_dataset import HFDataset
    from src.data.jsonl import JsonlData

    datasets.Dataset.from_list(PAIRS).to_parquet(str(tmp_path / "pairs.parquet"))
    options = {"block_size": 48, "tokenizer": str(pretrained), "batch_size": 4}
    padded = HFDataset(path=str(tmp_path / "pairs.parquet"), prompt_column="prompt", **options)
    jsonl = JsonlData(path=str(write_pairs(tmp_path)), prompt_key="prompt", **options)
    assert [padded.train[i]["labels"].tolist() for i in range(3)] == [jsonl.train[i]["labels"].tolist()
                                                                       for i in range(3)]
    packed = HFDataset(path=str(tmp_path / "pairs.parquet"), prompt_column="prompt", packing=True, **options)
    documents = []  # each document's labels, as the packed blocks hold them
    for i in range(len(packed.train)):
        block = packed.train[i]
        starts = [t for t, p in enumerate(block["position_ids"].tolist()) if p == 0] + [len(block["labels"])]
        documents += [block["labels"][a:b].tolist() for a, b in zip(starts, starts[1:])]
    assert sorted(documents) == sorted(jsonl.train[i]["labels"].tolist() for i in range(len(jsonl.train)))
    across = HFDataset(path=str(tmp_path / "pairs.parquet"), prompt_column="prompt", packing="cross_document",
                       **options)
    stream = [label for i in range(len(jsonl.train)) for label in jsonl.train[i]["labels"].tolist()]
    assert across.train[1]["labels"].tolist() == stream[48:96]  # the answers' labels, across a block boundary


def test_prompts_that_fill_the_block_are_counted_in_a_warning_and_a_missing_prompt_key_is_refused(
        tmp_path, pretrained, caplog):
    from src.data.jsonl import JsonlData

    path = write_pairs(tmp_path)
    with caplog.at_level("WARNING"):
        JsonlData(block_size=4, path=str(path), prompt_key="prompt", tokenizer=str(pretrained), batch_size=4)
    named(caplog.text, "40 of the first 40 samples", "data.block_size=4")
    with pytest.raises(ValueError) as refused:
        JsonlData(block_size=48, path=str(path), prompt_key="question", batch_size=4)
    named(str(refused.value), "pairs.jsonl:1", "'question'", "data.prompt_key", "['prompt', 'text']")


def test_instruction_tuning_a_pretrained_model_learns_its_answers(tmp_path, pretrained):
    run_dir = tmp_path / "sft"
    run([*finetune_args(pretrained, run_dir), f"data.path={write_pairs(tmp_path)}", "data.prompt_key=prompt",
         "trainer.max_steps=12", "trainer.eval_on_start=true", "trainer.monitor=null"])
    losses = scalars(run_dir, "eval/loss")
    assert sorted(losses) == [0, 12] and losses[12] < losses[0] - 1.0, losses


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHATS = [{"prompt": [{"role": "system", "content": "Answer as Shakespeare."},
                     {"role": "user", "content": f"Who speaks in scene {i}?"}],
          "text": [{"role": "assistant", "content": f"ROMEO, in scene {i}."}]} for i in range(40)]


def test_a_conversation_is_rendered_by_the_chat_template_and_trains_on_the_assistants_turn_alone(
        tmp_path, pretrained):
    from src.data.hf_dataset import HFDataset
    from src.data.jsonl import IGNORE_INDEX, JsonlData

    chat_model = tmp_path / "chat_model"  # the pretrained folder, with a chat template in its tokenizer config
    chat_model.mkdir()
    for file in pretrained.iterdir():
        (chat_model / file.name).write_bytes(file.read_bytes())
    config = json.loads((chat_model / "tokenizer_config.json").read_text())
    (chat_model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    before = tokenizer.apply_chat_template(CHATS[0]["prompt"], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(CHATS[0]["prompt"] + CHATS[0]["text"], tokenize=False)
    assert before.endswith("<|assistant|>") and whole == before + "ROMEO, in scene 0.\n"

    options = {"block_size": 128, "tokenizer": str(chat_model), "batch_size": 4}
    data = JsonlData(path=str(write_pairs(tmp_path, CHATS)), prompt_key="prompt", **options)
    prompt, answer = (tokenizer(text)["input_ids"] for text in (before, whole[len(before):]))
    assert data.train[0]["input_ids"].tolist() == prompt + answer  # the template ends the turn: no end of text
    assert data.train[0]["labels"].tolist() == [IGNORE_INDEX] * len(prompt) + answer
    assert tokenizer.decode(data.train[0]["input_ids"].tolist()) == whole
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(CHATS).to_parquet(str(tmp_path / "chats.parquet"))
    rows = HFDataset(path=str(tmp_path / "chats.parquet"), prompt_column="prompt", **options)
    assert rows.train[0]["labels"].tolist() == data.train[0]["labels"].tolist()

    with pytest.raises(UsageError) as refused:
        JsonlData(path=str(write_pairs(tmp_path, CHATS)), prompt_key="prompt", block_size=48, batch_size=4)
    named(str(refused.value), "chat template", "data.tokenizer")


# The same rendering, its assistant turns marked for transformers' return_assistant_tokens_mask.
MARKED_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
                   "{{ m['content'] }}\n{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DIALOGUES = [{"messages": [{"role": "system", "content": "Answer as Shakespeare."},
                           {"role": "user", "content": f"Who speaks in scene {i}?"},
                           {"role": "assistant", "content": f"ROMEO, in scene {i}."},
                           {"role": "user", "content": "And then?"},
                           {"role": "assistant", "content": f"JULIET, {i} lines later."}]} for i in range(40)]


def with_chat_template(folder: Path, pretrained: Path, template: str) -> Path:
    folder.mkdir()
    for file in pretrained.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def test_a_multi_turn_conversation_trains_on_every_assistant_turn_as_transformers_marks_them(tmp_path, pretrained):
    """A document given as messages trains on each assistant turn and nothing else: with a template that marks
    them, exactly transformers' return_assistant_tokens_mask; without marks, the text each assistant turn adds to
    the conversation before it, which here is the same tokens."""
    from src.data.hf_dataset import HFDataset
    from src.data.jsonl import IGNORE_INDEX, JsonlData

    marked = with_chat_template(tmp_path / "marked", pretrained, MARKED_TEMPLATE)
    plain = with_chat_template(tmp_path / "plain", pretrained, CHAT_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(marked)
    reference = tokenizer.apply_chat_template(DIALOGUES[0]["messages"], tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    expected_ids = list(reference["input_ids"])
    expected_labels = [i if m else IGNORE_INDEX for i, m in zip(expected_ids, reference["assistant_masks"])]
    assert sum(reference["assistant_masks"]) > 0 and not all(reference["assistant_masks"])
    path = write_pairs(tmp_path, DIALOGUES)
    for folder in (marked, plain):
        data = JsonlData(path=str(path), text_key="messages", tokenizer=str(folder), block_size=128, batch_size=4)
        assert data.train[0]["input_ids"].tolist() == expected_ids
        assert data.train[0]["labels"].tolist() == expected_labels, folder.name
    trained = tokenizer.decode([i for i in expected_labels if i != IGNORE_INDEX])
    assert trained == "ROMEO, in scene 0.\nJULIET, 0 lines later.\n"  # both turns, nothing of the user's
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(DIALOGUES).to_parquet(str(tmp_path / "dialogues.parquet"))
    rows = HFDataset(path=str(tmp_path / "dialogues.parquet"), text_column="messages", tokenizer=str(plain),
                     block_size=128, batch_size=4)
    assert rows.train[0]["labels"].tolist() == expected_labels


def test_a_conversation_whose_template_hides_its_turns_is_refused_naming_the_generation_marks(tmp_path, pretrained):
    """A template that renders a past assistant turn otherwise than a new one (here it drops earlier answers)
    gives no way to tell which tokens are the assistant's: refused, naming what would."""
    from src.data.jsonl import JsonlData

    forgetful = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|{{ m['role'] }}|>"
                 "{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    folder = with_chat_template(tmp_path / "forgetful", pretrained, forgetful)
    with pytest.raises(UsageError, match=r"\{% generation %\}"):
        JsonlData(path=str(write_pairs(tmp_path, DIALOGUES)), text_key="messages", tokenizer=str(folder),
                  block_size=128, batch_size=4)
    with pytest.raises(UsageError, match=r"data.tokenizer"):  # no template at all
        JsonlData(path=str(write_pairs(tmp_path, DIALOGUES)), text_key="messages", block_size=128, batch_size=4)


def suggested_overrides(output: str) -> list[str]:
    """The `key=VALUE` overrides a refusal's message suggests after its "give", typed as a user would copy them
    (PATH placeholders aside). The message is the line after Hydra's "Error executing job"."""
    lines = output.splitlines()
    message = next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("Error executing job"))
    return [o for o in re.findall(r"\b([a-z_]+\.[\w.]+=[^\s,;:()]+)", message.rsplit("give ", 1)[-1])
            if "PATH" not in o]


def test_a_refused_tokenizer_suggests_the_keys_that_work_and_they_are_accepted(tmp_path, pretrained):
    """model.pretrained without a tokenizer on data=text: the default data.tokenizer (that folder) is refused,
    and what the message suggests trains; so does the suggestion given for data.tokenizer=char there."""
    import shutil

    folder = tmp_path / "no_tokenizer"
    shutil.copytree(pretrained, folder, ignore=shutil.ignore_patterns("tokenizer*", "vocab.json", "merges.txt",
                                                                        "special_tokens_map.json"))
    args = ["model=hf_causal_lm", f"model.pretrained={folder}", "model.block_size=32", "data.batch_size=2",
            "trainer.max_steps=1", *QUIET]
    for given in ([], ["data.tokenizer=char"]):
        refused = run([*args, *given, f"hydra.run.dir={tmp_path / 'refused'}"], check=False)
        assert refused.returncode == 1 and "Traceback" not in refused.stdout, refused.stdout[-3000:]
        suggested = suggested_overrides(refused.stdout)
        assert "data.tokenizer=null" in suggested, refused.stdout[-3000:]
        run([*args, *given, *suggested, f"hydra.run.dir={tmp_path / ('accepted' + str(len(given)))}"])
