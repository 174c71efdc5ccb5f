"""A parameter's name as files hold it, whatever wraps the model: the one mapping between a model's names, its
wrapped forms and the names in checkpoints, exports and pretrained folders.

Wrappers insert segments into `named_parameters()`: DDP's `module.` in front, torch.compile's `_orig_mod.`,
activation checkpointing's `_checkpoint_wrapped_module.` (accelerate's fsdp_activation_checkpointing, torch's
checkpoint_wrapper) and FSDP1's `_fsdp_wrapped_module.` inside; FSDP2 adds none. peft wraps a transformers model as
`base_model.model.<name>` and an adapted layer's own weight as `<layer>.base_layer.<weight>` (`original_module` and
`modules_to_save.<adapter>` for the layers it copies): the pretrained folder holds the name without them.
"""

import re

WRAPPER_SEGMENTS = re.compile(r"(^module\.)|((?<=\.)|^)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
PEFT_SEGMENTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
PEFT_PREFIX = "base_model.model."


def name_in_files(name: str, base: bool = False) -> str:
    """The name a checkpoint or an export of the model stores for `name` (the model's own, unwrapped). With
    `base`, the name in the pretrained folder a peft model adapts (its base model's own)."""
    name = WRAPPER_SEGMENTS.sub("", name)
    return PEFT_SEGMENTS.sub("", name.removeprefix(PEFT_PREFIX)) if base else name
