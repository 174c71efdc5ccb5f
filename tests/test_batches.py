"""Batches and model outputs in the ecosystem's forms; anything else is refused naming what arrived."""

from collections import OrderedDict

import pytest
import torch

from src.data.jsonl import IGNORE_INDEX, JsonlData
from src.errors import UsageError
from src.loop.batches import call_model, logits_of, split_batch
from src.objectives.classification import CausalLM, CrossEntropy
from src.objectives.regression import MeanSquaredError
from tests.conftest import ROOT, named


def test_a_tuple_batch_is_inputs_then_targets_and_a_mapping_passes_all_but_the_target_key_as_keywords():
    x, y, mask = torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3)
    assert split_batch((x, y), "labels") == (x, y)
    inputs, targets = split_batch({"input_ids": x, "attention_mask": mask, "labels": y}, "labels")
    assert set(inputs) == {"input_ids", "attention_mask"} and targets is y

    seen = {}

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            seen.update(input_ids=input_ids, attention_mask=attention_mask)
            return OrderedDict(logits=input_ids * 2)  # a mapping with logits, as transformers' ModelOutput

    assert torch.equal(call_model(Model(), inputs), x * 2) and seen["attention_mask"] is mask


@pytest.mark.parametrize("batch, message", [
    ({"input_ids": torch.zeros(2)}, "keys ['input_ids'], none of them objective.target_key='labels'"),
    ((torch.zeros(2), torch.zeros(2), torch.zeros(2)), "a tuple of 3"),
    (torch.zeros(2, 3), "a tensor of shape (2, 3)"),
])
def test_a_batch_in_no_accepted_form_is_refused_naming_what_arrived(batch, message):
    with pytest.raises(UsageError) as refused:
        split_batch(batch, "labels")
    named(str(refused.value), message, "(inputs, targets)")  # what arrived, and the forms accepted


def test_a_model_output_without_logits_is_refused_naming_what_arrived():
    with pytest.raises(UsageError) as refused:
        logits_of((torch.zeros(1), torch.zeros(1)))
    named(str(refused.value), "a tuple of 2", "shape (1,)")


def test_causal_lm_shifts_labels_and_ignores_minus_100_while_cross_entropy_does_not_shift():
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX]])
    causal, plain = CausalLM(), CrossEntropy()
    assert causal.count(labels) == 1  # only position 0 predicts a counted label (label 2 at position 1)
    expected = torch.nn.functional.cross_entropy(logits[0, :1], labels[0, 1:2], reduction="sum")
    assert torch.allclose(causal.loss_sum(logits, labels), expected)
    assert plain.count(labels) == 2
    sums, weights = causal.metrics(logits, labels)["loss"]
    assert weights.tolist() == [1.0] and torch.allclose(sums, expected)


def test_mse_counts_samples_and_reports_mae():
    outputs, targets = torch.tensor([1.0, 3.0]), torch.tensor([[0.0], [1.0]])  # (B,) against (B, 1)
    objective = MeanSquaredError()
    assert objective.count(targets) == 2 and objective.loss_sum(outputs, targets).item() == 5.0
    assert objective.metrics(outputs, targets)["mae"][0].tolist() == [1.0, 2.0]


def test_jsonl_documents_tokenize_by_bytes_characters_or_a_local_tokenizers_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    sample = ROOT / "data" / "shakespeare_speeches.jsonl"
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(sample)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    sizes = {}
    for name in ("byte", "char", str(tmp_path / "tokenizer.json")):
        data = JsonlData(block_size=32, path=str(sample), tokenizer=name, batch_size=4)
        batch = next(iter(data.train_dataloader()))
        assert batch["input_ids"].shape == batch["labels"].shape and batch["input_ids"].shape[1] <= 32
        padding = batch["attention_mask"] == 0
        assert (batch["labels"][padding] == IGNORE_INDEX).all() and (batch["labels"][~padding] >= 0).all()
        assert int(batch["input_ids"].max()) < data.vocab_size
        sizes[name] = data.vocab_size
    assert sizes["byte"] == 256 and sizes["char"] < 100 and sizes[str(tmp_path / "tokenizer.json")] == 300


def test_a_tokenizer_files_saved_truncation_and_padding_do_not_cut_or_pad_documents(tmp_path):
    """A tokenizer.json saved with truncation (a 512-token encoder's export, say) would cut every document the
    data options and the preparation tokenize; documents are cut to data.block_size by the template instead."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from src.data.tokenizer import codec_for

    sample = ROOT / "data" / "shakespeare_speeches.jsonl"
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(sample)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]"]))
    texts = ["to be or not to be " * 20, "that is the question"]
    plain = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    tokenizer.enable_truncation(8)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert codec_for(str(tmp_path / "tokenizer.json")).encode_batch(texts) == plain and len(plain[0]) > 8
