"""Write a tiny pretrained language model as a `from_pretrained` folder, to try fine-tuning without a download.

    python scripts/make_tiny_pretrained.py outputs/tiny_gpt2            # GPT-2 shape, 2 layers, BPE of 512 tokens

It trains a byte-level BPE tokenizer on a text file (tiny Shakespeare by default), builds a small GPT-2, trains it
briefly on that text (--steps) and saves both with save_pretrained: config.json, model.safetensors and
tokenizer.json, as a folder downloaded from the hub would hold them (`hf download gpt2 --local-dir PATH`). Its
tokenizer has a chat template, as an instruct model's has, whose assistant turns are marked (`{% generation %}`),
so that it can also be tuned on conversations.
Needs `pip install -r requirements-extras.txt` (transformers, tokenizers).
"""

import argparse
from pathlib import Path

import torch

# Each turn as "<|role|>content", an assistant's ended by the end-of-text token so that the model learns to stop.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
                 "{{ m['content'] + eos_token }}\n{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(text_file: Path, vocab_size: int, chat_template: bool = True):
    """A byte-level BPE (GPT-2's kind) learnt from `text_file`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(text_file)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE if chat_template else None)


def make_model(vocab_size: int, positions: int, n_layer: int, n_embd: int, n_head: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def pretrain(model, ids: torch.Tensor, steps: int, block: int, batch: int = 16, lr: float = 1e-2) -> float:
    """A few AdamW steps on random windows of `ids`; the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - block - 1, (batch,))
        windows = torch.stack([ids[s : s + block] for s in starts])
        loss = model(input_ids=windows, labels=windows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def make_tiny_pretrained(folder: Path, text_file: Path, steps: int = 200, vocab_size: int = 512, positions: int = 256,
                         n_layer: int = 2, n_embd: int = 64, n_head: int = 2, seed: int = 0,
                         chat_template: bool = True) -> float:
    """Write the folder; returns the last pretraining loss."""
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(text_file, vocab_size, chat_template)
    model = make_model(len(tokenizer), positions, n_layer, n_embd, n_head)
    ids = torch.tensor(tokenizer(text_file.read_text(encoding="utf-8"))["input_ids"])
    loss = pretrain(model, ids, steps, block=min(64, positions)) if steps else float("nan")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where to write the model folder")
    parser.add_argument("--text", type=Path, default=Path("data/tinyshakespeare.txt"), help="pretraining text")
    parser.add_argument("--steps", type=int, default=200, help="pretraining steps (0: random weights)")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    loss = make_tiny_pretrained(args.folder, args.text, args.steps, args.vocab_size)
    print(f"wrote {args.folder} (a GPT-2 of 2 layers, vocabulary {args.vocab_size}; pretraining loss {loss:.3f})")


if __name__ == "__main__":
    main()
