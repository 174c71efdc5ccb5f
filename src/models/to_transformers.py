"""The template's GPT (src/models/gpt.py) as a Hugging Face GPT-2 folder, which transformers, lm-evaluation-harness,
vLLM and `model=hf_causal_lm model.pretrained=FOLDER` read (scripts/export_hf.py).

The GPT is GPT-2's architecture; what differs is only how it is written down:
- its Linear weights are (out, in), GPT-2's Conv1D weights (in, out): transposed;
- `model.bias=false` (the default) has no biases, GPT-2 always has them: zeros, which add nothing;
- its MLP uses the exact GELU, GPT-2's the tanh approximation: `activation_function="gelu"` says so;
- the output layer is tied to the token embedding, as GPT-2's (`tie_word_embeddings`).
The tokenizer goes along: a tokenizer's tokenizer.json as it is; bytes and characters as a `tokenizers` BPE
without merges whose ids are the template's. The folder is checked before it is kept: transformers' model gives
the export's logits on a batch of ids (float32, within rounding), and transformers' tokenizer the export's ids.
"""

import json
import shutil
import tempfile
from pathlib import Path

import torch

from src.checkpointing.export import load_exported_model
from src.data.tokenizer import Codec
from src.errors import UsageError
from src.models.gpt import GPT

# The logits of both models may differ by rounding only: a matrix product's sum in another order.
TOLERANCE = 1e-4
SAMPLE_TEXT = "Hello, world: 42 \u00e9t\u00e9s!\n\tThe end."


def export_to_transformers(source: Path, target: Path) -> float:
    """Write the export folder `source` (a run's model/, model_best/ or model_ema/) as a GPT-2 folder at `target`,
    which must not exist; returns the largest logit difference found by the check."""
    source, target = Path(source), Path(target)
    if (source / "config.json").is_file():
        raise UsageError(f"{source} is already a transformers folder (config.json): from_pretrained reads it as it is")
    if target.exists():
        raise UsageError(f"{target} exists: name a new folder (nothing is overwritten)")
    model = load_exported_model(source)
    if not isinstance(model, GPT):
        raise UsageError(f"{source} holds a {type(model).__name__}: only the template's GPT (model=gpt) is GPT-2's "
                         "architecture")
    codec = Codec.load(source)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # its progress bars and length warnings: the check speaks for it
    transformers_logging.disable_progress_bar()

    config = GPT2Config(vocab_size=model.tok_emb.num_embeddings, n_positions=model.block_size,
                        n_embd=model.tok_emb.embedding_dim, n_layer=len(model.blocks),
                        n_head=model.blocks[0].attn.n_head, n_inner=4 * model.tok_emb.embedding_dim,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        layer_norm_epsilon=model.ln_f.eps, tie_word_embeddings=True, **special_token_ids(codec))
    hf = GPT2LMHeadModel(config).eval()
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(model), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:  # the output layer is the embedding, tied
        raise RuntimeError(f"GPT-2's names not covered: {missing}, or not GPT-2's: {unexpected}")
    hf.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        hf.save_pretrained(tmp)
        write_tokenizer(codec, source, tmp, model.block_size)
        difference = check_the_folder(model, codec, tmp)
        tmp.rename(target)  # only a checked folder is ever at `target`
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return difference


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The GPT's weights under GPT-2's names and layout."""
    width = model.tok_emb.embedding_dim

    def linear(layer: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        bias = layer.bias if layer.bias is not None else torch.zeros(layer.out_features)
        return layer.weight.detach().t().contiguous(), bias.detach()

    def norm(layer: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.weight.detach(), (layer.bias if layer.bias is not None else torch.zeros(width)).detach()

    state = {"transformer.wte.weight": model.tok_emb.weight.detach(),
             "transformer.wpe.weight": model.pos_emb.weight.detach()}
    for name, (weight, bias) in [("transformer.ln_f", norm(model.ln_f))] + [
            (f"transformer.h.{i}.{part}", convert(layer))
            for i, block in enumerate(model.blocks)
            for part, convert, layer in (("ln_1", norm, block.ln_1), ("attn.c_attn", linear, block.attn.qkv),
                                         ("attn.c_proj", linear, block.attn.proj), ("ln_2", norm, block.ln_2),
                                         ("mlp.c_fc", linear, block.mlp.fc), ("mlp.c_proj", linear, block.mlp.proj))]:
        state[f"{name}.weight"], state[f"{name}.bias"] = weight, bias
    return state


def special_token_ids(codec: Codec) -> dict:
    """GPT-2's <|endoftext|> where the tokenizer has it (begins and ends a text in generation); none otherwise."""
    end = codec.tokenizer.token_to_id("<|endoftext|>") if codec.kind == "tokenizer" else None
    return {"bos_token_id": end, "eos_token_id": end}  # None: GPT-2's own 50256 would name another token


def write_tokenizer(codec: Codec, source: Path, directory: Path, block_size: int) -> None:
    """tokenizer.json and tokenizer_config.json: AutoTokenizer.from_pretrained(directory) encodes as the data did."""
    if codec.kind == "tokenizer":
        tokenizer = codec.tokenizer
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        if codec.kind == "byte":  # each byte its own id, written as GPT-2 writes bytes as characters
            shown = byte_characters()
            tokenizer = Tokenizer(models.BPE(vocab={shown[b]: b for b in range(256)}, merges=[]))
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tokenizer.decoder = decoders.ByteLevel()
        else:  # characters: a BPE without merges leaves every character a token of its own
            tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(codec.chars)}, merges=[]))
            tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    end = special_token_ids(codec)["eos_token_id"]
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                "clean_up_tokenization_spaces": False}
    if end is not None:
        settings.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    for name in ("chat_template.jinja",):  # a fine-tuned model's chat template travels with it
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)


def byte_characters() -> dict[int, str]:
    """GPT-2's printable character for each byte (its bytes_to_unicode), what a byte-level BPE's vocabulary holds."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def check_the_folder(model: GPT, codec: Codec, directory: Path) -> float:
    """Refuses a folder whose model or tokenizer is not the export's; returns the largest logit difference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, use_safetensors=True).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.tok_emb.num_embeddings, (2, min(model.block_size, 64)), generator=generator)
    with torch.no_grad():
        ours, theirs = model(ids).float(), hf(ids).logits.float()
    difference = (ours - theirs).abs().max().item()
    if not difference <= TOLERANCE * (1 + ours.abs().max().item()):
        raise RuntimeError(f"transformers' GPT-2 gives other logits than the export (max difference {difference:.3g})")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    text = codec.chars if codec.kind == "char" else SAMPLE_TEXT
    if tokenizer(text)["input_ids"] != codec.encode(text) or tokenizer.decode(codec.encode(text)) != codec.decode(
            codec.encode(text)):
        raise RuntimeError("transformers' tokenizer does not encode and decode as the export's vocabulary does")
    return difference
