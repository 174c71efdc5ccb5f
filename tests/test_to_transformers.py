"""The template's GPT leaves as a Hugging Face GPT-2 folder (scripts/export_hf.py): transformers' model gives its
logits, transformers' tokenizer its ids, and the template fine-tunes the folder as any pretrained model."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_model

from src.data.tokenizer import Codec, load_tokenizer
from src.errors import UsageError
from src.models.gpt import GPT
from src.models.to_transformers import export_to_transformers
from tests.conftest import QUIET, ROOT, TINY_GPT, refused, run, scalars, snapshot

SHAKESPEARE = (ROOT / "data" / "tinyshakespeare.txt").read_text()[:5000]


def exported_gpt(directory: Path, codec: Codec, bias: bool) -> GPT:
    """An export folder as train.py writes one for model=gpt (config.yaml, model.safetensors, the vocabulary), of a
    GPT with every weight drawn at random, biases and norms included, so that no weight goes unchecked."""
    config = {"_target_": "src.models.gpt.GPT", "vocab_size": codec.vocab_size, "block_size": 24, "n_layer": 2,
              "n_head": 2, "n_embd": 16, "bias": bias}
    torch.manual_seed(0)
    model = GPT(**{k: v for k, v in config.items() if k != "_target_"}).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    directory.mkdir(parents=True)
    OmegaConf.save(config, directory / "config.yaml")
    save_model(model, str(directory / "model.safetensors"))
    codec.save(directory)
    return model


def codec_of(kind: str, pretrained: Path) -> Codec:
    if kind == "tokenizer":
        return Codec("tokenizer", tokenizer=load_tokenizer(str(pretrained), "the test's tokenizer"))
    return Codec(kind, chars="".join(sorted(set(SHAKESPEARE))) if kind == "char" else "")


@pytest.mark.parametrize("kind, bias", [("char", False), ("byte", True), ("tokenizer", True)])
def test_transformers_reads_the_gpt2_folder_with_the_exports_logits_greedy_text_and_token_ids(
        tmp_path, pretrained, kind, bias):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    codec = codec_of(kind, pretrained)
    ours = exported_gpt(tmp_path / "model", codec, bias)
    export_to_transformers(tmp_path / "model", tmp_path / "model_hf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "model_hf", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model_hf", local_files_only=True)

    text = SHAKESPEARE[:60]
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == codec.encode(text) and tokenizer.decode(ids[0]) == codec.decode(codec.encode(text))
    ids = ids[:, :12]
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids), atol=1e-5, rtol=0)
        generated = theirs.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        greedy = ids
        for _ in range(8):
            greedy = torch.cat([greedy, ours(greedy)[:, -1:].argmax(-1)], dim=1)
    assert generated.tolist() == greedy.tolist()


def test_the_export_refuses_an_existing_target_a_transformers_folder_and_a_model_that_is_not_the_gpt(
        tmp_path, pretrained):
    exported_gpt(tmp_path / "model", codec_of("byte", pretrained), bias=False)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path / "taken")
    with pytest.raises(UsageError, match="exists"):
        export_to_transformers(tmp_path / "model", tmp_path / "taken")
    assert snapshot(tmp_path / "taken") == before
    with pytest.raises(UsageError, match="already a transformers folder"):
        export_to_transformers(pretrained, tmp_path / "again")
    resnet = tmp_path / "resnet"
    resnet.mkdir()
    OmegaConf.save({"_target_": "src.models.resnet.ResNet", "num_classes": 10}, resnet / "config.yaml")
    from src.models.resnet import ResNet

    save_model(ResNet(num_classes=10), str(resnet / "model.safetensors"))
    with pytest.raises(UsageError, match="ResNet: only the template's GPT"):
        export_to_transformers(resnet, tmp_path / "resnet_hf")
    assert not (tmp_path / "again").exists() and not (tmp_path / "resnet_hf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_trained_gpt_exported_by_the_script_continues_training_as_model_hf_causal_lm(tmp_path):
    """The template's own round trip: pretrain model=gpt, export, fine-tune the folder as a pretrained model; its
    first evaluation is the GPT's last (the same weights, read by transformers)."""
    run([*TINY_GPT, *QUIET, "trainer.max_steps=8", "trainer.eval_batches=2", f"hydra.run.dir={tmp_path / 'gpt'}"])
    def export() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "scripts/export_hf.py", str(tmp_path / "gpt" / "model"),
                               str(tmp_path / "gpt2")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)

    proc = export()
    assert proc.returncode == 0 and "gives the export's logits" in proc.stdout, proc.stdout
    refused(export(), str(tmp_path / "gpt2"), "exists")
    run(["model=hf_causal_lm", f"model.pretrained={tmp_path / 'gpt2'}", "model.block_size=32",
         *QUIET, "trainer.eval_batches=2", "trainer.eval_on_start=true", "trainer.max_steps=2",
         f"hydra.run.dir={tmp_path / 'fine_tuned'}"])
    pretrained_loss = scalars(tmp_path / "gpt", "eval/loss")[8]
    assert scalars(tmp_path / "fine_tuned", "eval/loss")[0] == pytest.approx(pretrained_loss, rel=1e-5)
