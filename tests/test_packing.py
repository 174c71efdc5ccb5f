"""data.packing=true: whole documents packed best fit into blocks, each token attending to its own document only.
A packed batch's per-token losses are the same documents' losses run one by one (the template's GPT, transformers
models on sdpa and eager, with LoRA too); a model that cannot read documents from position_ids is refused."""

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from src.data.packing import (
    IGNORE_INDEX,
    attend_per_document,
    cross_document_blocks,
    packed_documents,
    pad_packed,
)
from src.errors import UsageError
from src.models.gpt import GPT
from tests.conftest import GPU_ENV, ROOT, named
from tests.test_chunked_loss import VOCAB, tiny_llama

BLOCK = 32


def some_documents(n: int = 9, longest: int = BLOCK, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, longest))] for _ in range(n)]


def test_documents_are_packed_whole_best_fit_with_positions_restarting_and_no_first_token_a_target():
    documents = some_documents(40)
    blocks = packed_documents(documents, documents, BLOCK, split_long=False)
    unpacked, order = [], []  # the documents found, and per block the numbers of its documents
    for ids, labels, positions in zip(blocks["input_ids"], blocks["labels"], blocks["position_ids"]):
        assert len(ids) == len(labels) == len(positions) <= BLOCK
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(ids)]
        order.append([])
        for begin, end in zip(starts, starts[1:]):
            assert positions[begin:end] == list(range(end - begin))
            assert labels[begin:end] == [IGNORE_INDEX, *ids[begin + 1 : end]]
            unpacked.append(ids[begin:end])
            order[-1].append(documents.index(ids[begin:end]))
    assert sorted(unpacked) == sorted(documents)  # every document once, whole
    # Within a block the documents keep their order, and blocks follow their first documents.
    assert all(numbers == sorted(numbers) for numbers in order) and order == sorted(order)
    # Best fit: no two blocks could have been one.
    sizes = sorted(blocks["tokens"])
    assert sizes[0] + sizes[1] > BLOCK and len(blocks["tokens"]) < len(documents)
    assert sum(blocks["documents"]) == len(documents) and sum(blocks["cut"]) == 0


def test_a_document_longer_than_the_block_is_truncated_or_split_as_asked():
    long, short = list(range(2 * BLOCK + 5)), [7, 8, 9]
    truncated = packed_documents([long, short], [long, short], BLOCK, split_long=False)
    assert truncated["input_ids"] == [long[:BLOCK], short] and truncated["cut"] == [1, 0]
    split = packed_documents([long, short], [long, short], BLOCK, split_long=True)
    assert split["input_ids"] == [long[:BLOCK], long[BLOCK : 2 * BLOCK], long[2 * BLOCK :] + short]
    assert split["position_ids"][2] == [0, 1, 2, 3, 4, 0, 1, 2] and sum(split["cut"]) == 1


def test_cross_document_blocks_cut_the_stream_and_mask_boundaries_only_when_asked():
    documents = some_documents(12)
    stream = sum(documents, [])
    blocks = cross_document_blocks(documents, documents, BLOCK, mask_boundaries=False)
    assert blocks["input_ids"] == [stream[i : i + BLOCK] for i in range(0, len(stream) - BLOCK + 1, BLOCK)]
    assert blocks["labels"] == blocks["input_ids"]
    masked = cross_document_blocks(documents, documents, BLOCK, mask_boundaries=True)
    assert masked["labels"] != masked["input_ids"] and masked["input_ids"] == blocks["input_ids"]


def token_losses(model, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of next-token prediction, (B, T-1), 0 where the label is ignored."""
    output = model(**inputs)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="none",
                           ignore_index=IGNORE_INDEX).view(labels.shape[0], -1)


def assert_packed_losses_are_each_documents_own(model, documents, tolerance: float = 1e-5):
    """The losses of a packed batch (two rows, padded) equal each document's alone, token by token."""
    model.eval()
    device = next(model.parameters()).device
    blocks = packed_documents(documents, documents, BLOCK, split_long=False)
    samples = [{k: torch.tensor(blocks[k][b]) for k in ("input_ids", "labels", "position_ids")}
               for b in range(len(blocks["input_ids"]))]
    assert len(samples) >= 2 and any(len(s["input_ids"]) < BLOCK for s in samples)  # padding in the batch too
    batch = {k: v.to(device) for k, v in pad_packed(samples).items()}  # a collate function's batch, moved
    with torch.no_grad():
        packed = token_losses(model, {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]},
                              batch["labels"])
        compared = 0
        for row in range(len(samples)):
            positions = samples[row]["position_ids"].tolist()
            starts = [t for t, p in enumerate(positions) if p == 0] + [len(samples[row]["input_ids"])]
            for begin, end in zip(starts, starts[1:]):
                ids = batch["input_ids"][row, begin:end][None]
                alone = token_losses(model, {"input_ids": ids}, ids)
                torch.testing.assert_close(packed[row, begin : end - 1], alone[0], rtol=tolerance, atol=tolerance)
                compared += 1
    assert compared == len(documents)


def test_a_packed_batch_has_each_documents_own_losses_in_the_template_gpt():
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)
    assert_packed_losses_are_each_documents_own(model, some_documents(7, longest=20))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_packed_batch_has_each_documents_own_losses_in_a_transformers_llama(attention, lora):
    torch.manual_seed(0)
    model = tiny_llama(attention)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))  # an adapter that changes things
    attend_per_document(model)
    assert_packed_losses_are_each_documents_own(model, some_documents(7, longest=20))


def test_a_transformers_gpt2_takes_packed_documents_too():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32,
                                                                 n_layer=2, n_head=2))
    attend_per_document(model)
    assert_packed_losses_are_each_documents_own(model, some_documents(7, longest=20))


class NoPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)

    def forward(self, input_ids):
        return self.emb(input_ids)


def test_a_model_that_cannot_read_documents_from_positions_is_refused_naming_the_other_packings():
    with pytest.raises(UsageError) as refused:
        attend_per_document(NoPositions())
    named(str(refused.value), "data.packing=true", "NoPositions", "position_ids", "data.packing=cross_document",
          "data.packing=false")


ON_A_GPU = """
import os, sys, torch
gpus = os.environ["CUDA_VISIBLE_DEVICES"]
from src.data.packing import attend_per_document
from tests.test_chunked_loss import tiny_llama
from tests.test_packing import assert_packed_losses_are_each_documents_own, some_documents
os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # tests.conftest, imported above, hid them; CUDA starts only below
torch.manual_seed(0)
model = tiny_llama(sys.argv[1]).to("cuda", torch.float16)  # flash-attention computes in 16 bits only
attend_per_document(model)
assert_packed_losses_are_each_documents_own(model, some_documents(7, longest=20), tolerance=1e-2)
print("each document's own losses")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_on_a_gpu_packed_documents_keep_their_own_losses_through_sdpa_and_flash_attentions_varlen_path(attention):
    """transformers hands packed documents to flash-attention's variable-length kernels from position_ids; sdpa
    gets a block-diagonal mask. Tokens attending across documents moved losses by 0.07-0.1 on CPU (fp32)."""
    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    proc = subprocess.run([sys.executable, "-c", ON_A_GPU, attention], cwd=ROOT, env={**os.environ, **GPU_ENV},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "each document's own losses" in proc.stdout, proc.stderr[-3000:]
