"""Any Hugging Face `transformers` causal LM, built from an inline config or loaded from a pretrained model.

    accelerate launch train.py model=hf_causal_lm                        # a small GPT-2 (its yaml)
    accelerate launch train.py model=hf_causal_lm model.config.model_type=llama ...   # any AutoModelForCausalLM type
    accelerate launch train.py model=hf_causal_lm model.pretrained=gpt2  # fine-tune a hub model (or a folder)

A pretrained model (a hub id, fetched into the Hugging Face cache by src/models/hub.py, or a from_pretrained
folder) brings its own architecture (config.json, so model.config is not used), its weights and,
where it has one, its tokenizer, which the text options then use (config/data/text.yaml, jsonl.yaml). The folder
may be another run's export (`outputs/RUN/model`): a run fine-tunes what an earlier one trained.

`transformers` is an optional requirement (requirements-extras.txt); it is imported only when this model is built.
The export of such a model is also a Hugging Face folder: `AutoModelForCausalLM.from_pretrained(run_dir/"model")`.
"""

import contextlib
import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from src.errors import UsageError
from src.launch.sharded_start import is_built_without_values, with_values_again
from src.models.hub import local_path
from src.schema.signature import Arg

# Config fields that bound the sequence length, by the names transformers' architectures use.
POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")

log = logging.getLogger(__name__)


def causal_lm_from_config(
    config: Annotated[dict, Arg("model_type and its fields, as AutoConfig.for_model takes them; sizes the data "
                                "knows as ${dataset:vocab_size}; not used with model.pretrained")],
    block_size: Annotated[int, Arg("longest sequence trained on (data.block_size follows it); must fit the "
                                   "config's position embeddings", ge=1)],
    gradient_checkpointing: Annotated[bool, Arg("recompute activations in the backward pass to save memory")] = False,
    pretrained: Annotated[Optional[str], Arg(
        "a Hugging Face hub id (gpt2, Qwen/Qwen2.5-0.5B: fetched into the Hugging Face cache) or a from_pretrained "
        "folder (config.json, weights, optionally a tokenizer) to start from, e.g. another run's outputs/RUN/model; "
        "null: random weights from model.config")] = None,
    revision: Annotated[Optional[str], Arg(
        "with a hub id: its branch, tag or commit (null: the newest, whose commit the run's config then records, so "
        "that a resume or an evaluation reads the same files)")] = None,
    dtype: Annotated[Optional[Literal["float32", "bfloat16", "float16"]], Arg(
        "dtype of the weights (null: float32; mixed precision is trainer.mixed_precision, which keeps float32 "
        "master weights)")] = None,
    attn_implementation: Annotated[Optional[str], Arg(
        "transformers' attention kernel: eager, sdpa, flash_attention_2, ... (null: transformers' choice)")] = None,
    peft: Annotated[Optional[dict], Arg(
        "a peft config as a mapping, e.g. {peft_type: LORA, r: 8, lora_alpha: 16, target_modules: [c_attn]} "
        "(task_type CAUSAL_LM by default): only the adapter trains (needs peft, requirements-extras.txt)")] = None,
    head: Annotated[Literal["lm", "reward"], Arg(
        "lm: next-token logits; reward: the output layer replaced by one value per position, a reward model's "
        "(objective=reward), exported as a sequence classifier with one label")] = "lm",
) -> Any:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging
    except ImportError as error:
        raise UsageError("model=hf_causal_lm needs transformers: pip install -r requirements-extras.txt") from error
    if not sys.stderr.isatty():  # as our own progress bar: in a log file (SLURM, nohup) a bar is \r-garbage,
        transformers_logging.disable_progress_bar()  # here at every load and at every checkpoint's save
    options = {"dtype": getattr(torch, dtype or "float32")}
    if attn_implementation:
        options["attn_implementation"] = attn_implementation
    if pretrained:
        model = _from_pretrained(AutoModelForCausalLM, pretrained, revision, options)
        hf_config = model.config
    else:
        hf_config = _inline_config(AutoConfig, dict(config))
        model = AutoModelForCausalLM.from_config(hf_config, **options)
    positions = positions_of(hf_config)
    if positions is not None and block_size > positions:
        source = f"model.pretrained={pretrained}" if pretrained else "model.config"
        raise UsageError(f"model.block_size={block_size} exceeds the {positions} positions of {source}")
    if head == "reward":
        from src.checkpointing.reward_export import sequence_classifier_name

        try:
            sequence_classifier_name(hf_config.model_type)
        except KeyError:
            raise UsageError(f"model.head=reward: transformers has no sequence classifier for model_type "
                             f"{hf_config.model_type}, which the export is written as") from None
        with_reward_head(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if peft:  # a reward head is new: it trains whole beside the adapter
        model = _with_adapter(model, {**dict(peft), **({"modules_to_save": [
            *(peft.get("modules_to_save") or []), output_layer_name(model)]} if head == "reward" else {})})
    return model


def with_reward_head(model: Any) -> Any:
    """The model's output layer replaced by one value per position (untied from the input embedding), initialised
    as OpenRLHF and TRL's value heads are (normal, std 1/sqrt(width + 1)). Built without values (FSDP's sharded
    start), it is made so too and its values come from rank 0, as the rest."""
    import math

    import torch

    old = model.get_output_embeddings()
    if not isinstance(old, torch.nn.Linear):
        raise UsageError(f"model.head=reward replaces the output layer, a torch.nn.Linear found by "
                         f"get_output_embeddings(); {type(model).__name__} has {type(old).__name__}")
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False  # transformers would tie it to the input embedding again
    layer = torch.nn.Linear(old.in_features, 1, bias=False, device=old.weight.device, dtype=old.weight.dtype)
    if not layer.weight.is_meta:
        torch.nn.init.normal_(layer.weight, std=1 / math.sqrt(old.in_features + 1))
    model.set_output_embeddings(layer)
    return model


def output_width(model: Any) -> Optional[int]:
    """How many values the model's output layer gives per position (found by get_output_embeddings() or as
    `lm_head`, transformers' and the template's GPT's): the vocabulary, or 1 for a reward model."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is None:
        output = getattr(model, "lm_head", None)
    return getattr(output, "out_features", None) or getattr(getattr(output, "weight", None), "shape", [None])[0]


def output_layer_name(model: Any) -> str:
    layer = model.get_output_embeddings()
    return next(name for name, module in model.named_modules() if module is layer)


def _with_adapter(model: Any, peft_config: dict) -> Any:
    """The model with a peft adapter: its own weights frozen, the adapter's trainable. The export holds both the
    adapter (model/adapter) and the model with the adapter merged in (src/checkpointing/export.py)."""
    try:
        from peft import get_peft_config, get_peft_model
    except ImportError as error:
        raise UsageError("model.peft needs peft: pip install -r requirements-extras.txt") from error
    try:
        config = get_peft_config({"task_type": "CAUSAL_LM", **peft_config})
        # FSDP's sharded start: the base's values arrive later, the adapter's are made now, as a whole copy makes them
        values = with_values_again(model) if is_built_without_values() else contextlib.nullcontext()
        with warnings.catch_warnings(), values:  # peft reads an attribute transformers 5 deprecates: not the user's
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"model.peft={peft_config}: {error}") from error


def positions_of(hf_config: Any) -> Optional[int]:
    """The longest sequence a transformers config's position embeddings allow (None: no such field)."""
    return next((getattr(hf_config, f) for f in POSITION_FIELDS if getattr(hf_config, f, None)), None)


def _inline_config(AutoConfig, config: dict) -> Any:
    if "model_type" not in config:
        raise UsageError("model.config.model_type is mandatory (e.g. gpt2, llama, qwen2): the architecture to build")
    try:
        hf_config = AutoConfig.for_model(**config)
    except ValueError as error:
        raise UsageError(f"model.config.model_type={config['model_type']}: {error}") from error
    unknown = sorted(set(config) - {"model_type"} - set(type(hf_config)().to_dict()) - set(hf_config.attribute_map))
    if unknown:  # transformers would keep them as inert attributes: a typo would change nothing, silently
        raise UsageError(f"model.config.{unknown[0]}: not a field of {type(hf_config).__name__} "
                         f"({', '.join('model.config.' + k for k in unknown)})")
    return hf_config


def _from_pretrained(AutoModelForCausalLM, pretrained: str, revision: Optional[str], options: dict) -> Any:
    folder = local_path(pretrained, "model.pretrained", revision=revision)  # a hub id: its snapshot in the cache
    if not folder.is_dir():
        raise UsageError(f"model.pretrained={pretrained}: no such folder (a from_pretrained folder or a Hugging "
                         f"Face hub id; relative paths are relative to {Path.cwd()})")
    if not (folder / "config.json").is_file():
        raise UsageError(f"model.pretrained={pretrained}: no config.json in it; a from_pretrained folder holds "
                         f"config.json and its weights (model.safetensors), as save_pretrained writes them")
    try:
        if is_built_without_values():  # FSDP's sharded start: the architecture, its weights later or from rank 0
            from transformers import AutoConfig, GenerationConfig

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, local_files_only=True),
                                                     **options)
            if (folder / "generation_config.json").is_file():  # as from_pretrained reads it (sampling uses it)
                model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
            return model
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **options)
    except (OSError, ValueError) as error:
        raise UsageError(f"model.pretrained={pretrained}: {error}") from error
    log.info("model.pretrained=%s: %s, %.1fM parameters (model.config is not used)", pretrained,
             type(model).__name__, sum(p.numel() for p in model.parameters()) / 1e6)
    return model

