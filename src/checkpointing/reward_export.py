"""A transformers reward model's export: the sequence classifier with one label that other tools read a reward
model as (`AutoModelForSequenceClassification.from_pretrained(RUN/model)`: TRL's and OpenRLHF's online trainers,
vLLM's reward serving).

Training holds it as its causal LM with the output layer one value wide (model.head=reward,
src/models/hf_causal_lm.py), so that packing, FSDP and LoRA work as for any language model. The export is written
as for any transformers model, then rewritten in place: the output layer's weight is renamed `score.weight` in the
safetensors header (the tensors' bytes are copied as they are: no process holds the model for it), and config.json
names the architecture's sequence classifier, num_labels=1, and a pad_token_id (the tokenizer's pad token, else its
end-of-text token, else 0, the data's padding), which that classifier needs to find each row's last token.
load_exported_model reads such a folder back into the training form (eval.py).
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

SCORE = "score.weight"  # the sequence classifiers' own name for their output layer (GPT-2, Llama, Qwen2, Mistral, ...)
INDEX = "model.safetensors.index.json"


def sequence_classifier_name(model_type: str) -> str:
    """The architecture's sequence classifier (KeyError: it has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[model_type]


def is_reward_model(model: Any) -> bool:
    """A transformers model (or peft's around one) whose output layer gives one value per position."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = getattr(base, "get_output_embeddings", lambda: None)() if hasattr(base, "save_pretrained") else None
    return getattr(layer, "out_features", None) == 1


def as_sequence_classifier(folder: Path, model: Any) -> None:
    """Main process: the export in `folder` of a reward model `model`, rewritten as its sequence classifier."""
    from transformers import AutoConfig

    from src.models.hf_causal_lm import output_layer_name

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    key = output_layer_name(base) + ".weight"
    index = folder / INDEX
    if index.is_file():
        record = json.loads(index.read_text())
        file = folder / record["weight_map"].pop(key)
        record["weight_map"][SCORE] = file.name
        _rename_tensor(file, key, SCORE)
        index.write_text(json.dumps(record, indent=2))
    else:
        _rename_tensor(folder / "model.safetensors", key, SCORE)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    config.architectures = [sequence_classifier_name(config.model_type)]
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = _pad_id(folder, config)
    config.save_pretrained(folder)


def load_reward_model(folder: Path) -> Any:
    """An exported sequence classifier with one label, in the training form (the causal LM with its output layer
    one value wide), its weights read from the folder as written."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from src.models.hf_causal_lm import output_layer_name, with_reward_head

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = with_reward_head(AutoModelForCausalLM.from_config(config, dtype=config.dtype))
    key = output_layer_name(model) + ".weight"
    index = folder / INDEX
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    weights = {}
    for name in files:
        weights.update(load_file(folder / name))
    weights[key] = weights.pop(SCORE)
    expected = set(model.state_dict())
    missing = expected - set(weights) - {name for name, _ in model.named_buffers()}  # buffers: computed, or saved
    unexpected = set(weights) - expected
    if missing or unexpected:
        raise FileNotFoundError(f"{folder}: its weights do not fit {type(model).__name__} with a reward head "
                                f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.load_state_dict(weights, strict=False)
    return model


def _rename_tensor(file: Path, old: str, new: str) -> None:
    """One tensor of a safetensors file renamed: a new header, then the data section copied byte for byte."""
    with open(file, "rb") as source:
        size = int.from_bytes(source.read(8), "little")
        header = json.loads(source.read(size))
        header = {new if name == old else name: entry for name, entry in header.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section stays 8-byte aligned, as safetensors writes it
        renamed = file.with_name(file.name + ".renaming")
        with open(renamed, "wb") as target:
            target.write(len(raw).to_bytes(8, "little") + raw)
            shutil.copyfileobj(source, target, 64 << 20)
    os.replace(renamed, file)


def _pad_id(folder: Path, config: Any) -> int:
    tokenizer_config, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if tokenizer_config.is_file() and tokenizer_file.is_file():
        from tokenizers import Tokenizer

        pad = json.loads(tokenizer_config.read_text()).get("pad_token")
        found = Tokenizer.from_file(str(tokenizer_file)).token_to_id(pad) if isinstance(pad, str) else None
        if found is not None:
            return found
    return config.eos_token_id if isinstance(config.eos_token_id, int) else 0
