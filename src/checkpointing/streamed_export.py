"""The export of a sharded (FSDP2) model, one tensor at a time: no process ever holds the whole model.

Gathering the full state dict puts a whole copy of the model on rank 0 (and merging a LoRA adapter into a rebuilt
model a second one): 5.94 GiB on rank 0 where training peaked at 2.83 GiB per rank, for a 578M model on 2 processes
(BENCHMARKS.md); hundreds of GB at 70B. Here every rank walks the state dict in the same order, each sharded tensor
is gathered (a collective), rank 0 appends its bytes to the safetensors file, and it is freed before the next: a
process holds its shard and one tensor beyond. A LoRA adapter is merged layer by layer the same way: the base
weight, A and B gathered, W + scaling * B @ A written under the base weight's name. The files are what the
gathered export writes: safetensors (the header first, its offsets known from the shapes), read by
safetensors.torch.load_file, load_exported_model and from_pretrained alike.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

# safetensors' names for torch's dtypes (the format's spec).
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing's and compile's, not the model's


@dataclass
class Entry:
    """One tensor of the file: its name, shape and dtype (known without gathering), and how to make it whole
    (collective: every rank calls it, in the same order)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    whole: Callable[[], torch.Tensor]


def gathered(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return (lambda: tensor.full_tensor()) if hasattr(tensor, "full_tensor") else (lambda: tensor)


def clean(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def model_entries(model: torch.nn.Module, drop: set[str] = frozenset()) -> list[Entry]:
    """The model's state dict as entries, tied copies (`drop`) left out."""
    out = []
    for name, tensor in model.state_dict().items():
        name = clean(name)
        if name not in drop:
            out.append(Entry(name, tuple(tensor.shape), tensor.dtype, gathered(tensor)))
    return out


def lora_merged_entries(peft_model: torch.nn.Module, drop: set[str]) -> Optional[list[Entry]]:
    """The merged model's state dict as entries, each LoRA layer's weight merged as it is written, a module peft
    trains whole beside the adapter (modules_to_save: a reward model's new head) as its trained copy; None where
    the adapter is not plain LoRA on linear layers (DoRA, other peft methods: the gathered path merges those)."""
    from peft.tuners.lora import Linear, LoraLayer
    from peft.utils import ModulesToSaveWrapper

    adapter = peft_model.active_adapter
    config = peft_model.peft_config[adapter]
    if (str(getattr(config, "peft_type", "")).removeprefix("PeftType.") != "LORA" or getattr(config, "use_dora", False)
            or getattr(config, "lora_bias", False)):
        return None
    base = peft_model.get_base_model()
    layers, saved_whole = {}, []
    for name, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            saved_whole.append(clean(name))
            continue
        if isinstance(module, LoraLayer):
            if not isinstance(module, Linear) or adapter not in module.lora_A:
                return None
            layers[clean(name)] = module
    out, states = [], {clean(name): tensor for name, tensor in base.state_dict().items()}
    for name, tensor in states.items():
        wrapper = next((w for w in saved_whole if name.startswith(f"{w}.")), None)
        if wrapper is not None:  # the trained copy under the module's own name; the original and others are not
            trained = f"{wrapper}.modules_to_save.{adapter}."
            if not name.startswith(trained):
                continue
            name = f"{wrapper}.{name.removeprefix(trained)}"
        owner, _, leaf = name.rpartition(".")
        if ".lora_" in f".{name}" or "lora_magnitude_vector" in name:
            continue  # folded into their base weight below
        if owner.endswith(".base_layer") or owner == "base_layer":
            layer_name = owner.removesuffix("base_layer").removesuffix(".")
            merged_name = f"{layer_name}.{leaf}" if layer_name else leaf
            layer = layers.get(layer_name)
            if leaf == "weight" and layer is not None:
                out.append(Entry(merged_name, tuple(tensor.shape), tensor.dtype, _merged(layer, adapter, tensor,
                                                                                         states, layer_name)))
                continue
            name = merged_name
        if name not in drop:
            out.append(Entry(name, tuple(tensor.shape), tensor.dtype, gathered(tensor)))
    return out


def _merged(layer, adapter: str, weight: torch.Tensor, states: dict, name: str) -> Callable[[], torch.Tensor]:
    def whole() -> torch.Tensor:
        a = gathered(states[f"{name}.lora_A.{adapter}.weight"])()
        b = gathered(states[f"{name}.lora_B.{adapter}.weight"])()
        w = gathered(weight)()
        delta = (b.float() @ a.float()) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):  # GPT-2's Conv1D stores its weight transposed
            delta = delta.T
        return (w.float() + delta).to(w.dtype)

    return whole


def tied_copies(model: torch.nn.Module, rename: Callable[[str], str] = lambda name: name) -> set[str]:
    """The names of tied parameters after the first (the GPT's lm_head is its token embedding): the copies a file
    leaves out, by `rename` of the model's own names. Sharded or gathered, the tie is read off the model, not the
    storage; load_model and from_pretrained tie them again on load."""
    first_name, drop = {}, set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        name = rename(name)
        if first_name.setdefault(id(parameter), name) != name:
            drop.add(name)
    return drop


def export_name(name: str) -> str:
    """A parameter's name in the streamed export: wrappers' and LoRA's base_layer folded away."""
    return clean(name).replace(".base_layer.", ".")


def converts_weights(model: torch.nn.Module) -> bool:
    """Whether transformers renames or reshapes this model's weights between its modules and its files (some
    architectures in transformers 5): save_pretrained reverts that on a whole state dict, so such a model is
    exported from one (export.py's gathered path)."""
    if getattr(model, "_weight_conversions", None):
        return True
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return False
    return any(not isinstance(c, PrefixChange) for c in get_model_conversion_mapping(model, add_legacy=False) or [])


def write_safetensors(path: Path, entries: list[Entry], write: bool, metadata: Optional[dict] = None) -> None:
    """Every rank calls it (the gathers are collective); the rank with `write` writes `path`."""
    header, offset = {}, 0
    for entry in entries:
        if entry.dtype not in DTYPES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} has no safetensors name")
        size = entry.dtype.itemsize * int(torch.Size(entry.shape).numel())
        header[entry.name] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    file = open(path, "wb") if write else None
    try:
        if file:
            file.write(struct.pack("<Q", len(encoded)) + encoded)
        for entry in entries:
            tensor = entry.whole()
            if file:
                data = tensor.detach().to("cpu").contiguous()
                if tuple(data.shape) != entry.shape or data.dtype != entry.dtype:
                    raise RuntimeError(f"{entry.name}: gathered {tuple(data.shape)} {data.dtype}, expected "
                                       f"{entry.shape} {entry.dtype}")
                if data.numel():
                    file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
            del tensor
    finally:
        if file:
            file.close()
