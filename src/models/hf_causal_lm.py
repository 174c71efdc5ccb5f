"""Any Hugging Face `transformers` causal LM, built from an inline config: no download, no hub.

    accelerate launch train.py model=hf_causal_lm                        # a small GPT-2 (config/model/hf_causal_lm.yaml)
    accelerate launch train.py model=hf_causal_lm model.config.model_type=llama ...   # any AutoModelForCausalLM type

`transformers` is an optional requirement (requirements-extras.txt); it is imported only when this model is built.
The export of such a model is also a Hugging Face folder: `AutoModelForCausalLM.from_pretrained(run_dir/"model")`.
"""

from typing import Annotated, Any

from src.schema.errors import UsageError
from src.schema.signature import Arg

# Config fields that bound the sequence length, by the names transformers' architectures use.
POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")


def causal_lm_from_config(
    config: Annotated[dict, Arg("model_type and its fields, as AutoConfig.for_model takes them; sizes the data "
                                "knows as ${dataset:vocab_size}")],
    block_size: Annotated[int, Arg("longest sequence trained on (data.block_size follows it); must fit the "
                                   "config's position embeddings", ge=1)],
    gradient_checkpointing: Annotated[bool, Arg("recompute activations in the backward pass to save memory")] = False,
) -> Any:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as error:
        raise UsageError("model=hf_causal_lm needs transformers: pip install -r requirements-extras.txt") from error
    config = dict(config)
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
    positions = next((getattr(hf_config, f) for f in POSITION_FIELDS if getattr(hf_config, f, None)), None)
    if positions is not None and block_size > positions:
        raise UsageError(f"model.block_size={block_size} exceeds the {positions} positions of model.config")
    model = AutoModelForCausalLM.from_config(hf_config)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model
