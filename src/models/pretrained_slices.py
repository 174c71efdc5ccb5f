"""A pretrained folder read in slices: FSDP's sharded start without a whole copy on any rank, rank 0 included.

In a sharded start (src/launch/sharded_start.py) rank 0 alone builds the model with its values and sends each rank
its shard. Where the model is a pretrained folder (`model.pretrained` of model=hf_causal_lm) whose weights are
safetensors files, rank 0 does not read it whole either: every rank builds the architecture without values, FSDP
shards it, and each rank then reads from the files only the bytes of the rows of each weight that its shard holds.
No rank holds more than its shard plus one weight's slice, and the values are bitwise those `from_pretrained`
reads (cast as it casts them). The same for `trainer.init_weights` (another run's model.safetensors, the
template's GPT included), whose file must hold the model's own names.

A LoRA adapter (`model.peft`) is made with its values on every rank, as a whole copy would make it: its
initialisation draws from the seeded generator and reads no base weight, and accelerate's broadcast of rank 0's
state carries it into the shards (the base weights it sends are overwritten here).

It applies where every parameter of the architecture is in the files under its own name (or with the model's
`base_model_prefix` added or removed, as transformers checkpoints come). A folder that needs transformers' renaming
on load, weights in .bin files, or an adapter initialised from the base weights (PiSSA, LoftQ, DoRA, ...) is read
by rank 0 whole instead, and the log says why.
"""

import json
import logging
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import broadcast_object_list
from omegaconf import DictConfig

from src.launch.sharded_start import give_uninitialised_storage, is_sharded_start
from src.models.parameter_names import name_in_files

log = logging.getLogger(__name__)

MODEL_TARGET = "src.models.hf_causal_lm.causal_lm_from_config"
INDEX_FILE = "model.safetensors.index.json"  # a model saved in several files: which file holds each weight
ADAPTER_INITS_WITHOUT_BASE_WEIGHTS = (True, False, "gaussian")  # peft's LoRA initialisations that read no weight
ADAPTER_WEIGHT = re.compile(r"\.lora_[A-Za-z_]+\.")  # lora_A, lora_B, lora_embedding_A, ...


@dataclass(frozen=True)
class PretrainedSlices:
    folder: Path
    # Every name of a base weight in the model (tied ones have several) -> its file, its key there, and the dtype
    # the model is built in (from_pretrained casts to it first; FSDP may then upcast a trainable one to float32).
    # None: trainer.init_weights, whose file holds the model's own names, every one of them (`of_model` once built).
    sources: Optional[dict[str, tuple[str, str, torch.dtype]]]

    def of_model(self, model: torch.nn.Module) -> "PretrainedSlices":
        """trainer.init_weights: the weights matched to the built model's names, shapes and dtypes, before the
        prepare (weights of another shape are refused here, naming them)."""
        return self if self.sources is not None else PretrainedSlices(self.folder, _own_names(model, self.folder))


def plan_slices(accelerator: Accelerator, model_cfg: DictConfig,
                init_weights: Optional[Path] = None) -> Optional[PretrainedSlices]:
    """Whether every rank reads its own slices of `model.pretrained` or of `trainer.init_weights` (another run's
    model.safetensors) once the model is sharded (None: rank 0 reads it whole, or no sharded start). Rank 0's
    answer is every rank's: a rank that answered otherwise would wait in another collective."""
    if not is_sharded_start(accelerator):
        return None
    if init_weights is not None:
        log.info("sharded start: each rank reads its own slices of trainer.init_weights=%s", init_weights)
        return PretrainedSlices(init_weights, None)
    if model_cfg.get("_target_") != MODEL_TARGET or not model_cfg.pretrained:
        return None
    plan, why_not = _plan(model_cfg) if accelerator.is_main_process else (None, "")
    plan = broadcast_object_list([plan])[0]
    if plan is not None and not accelerator.is_main_process:  # this node's copy: a hub id's cache may lie elsewhere
        plan = replace(plan, folder=_folder(model_cfg))
    if plan is None:
        log.info("sharded start: rank 0 reads model.pretrained=%s whole (%s)", model_cfg.pretrained, why_not)
    else:
        log.info("sharded start: each rank reads its own slices of model.pretrained=%s", model_cfg.pretrained)
    return plan


def _folder(model_cfg: DictConfig) -> Path:
    from src.models.hub import local_path

    return local_path(model_cfg.pretrained, "model.pretrained", revision=model_cfg.get("revision"), quiet=True)


def _plan(model_cfg: DictConfig) -> tuple[Optional[PretrainedSlices], str]:
    if model_cfg.get("head", "lm") != "lm":
        return None, f"model.head={model_cfg.head} makes a new output layer, whose values rank 0 sends"
    peft = dict(model_cfg.get("peft") or {})
    if peft and (str(peft.get("peft_type", "")).upper() != "LORA" or peft.get("use_dora")
                 or peft.get("init_lora_weights", True) not in ADAPTER_INITS_WITHOUT_BASE_WEIGHTS):
        return None, "model.peft initialises its adapter from the base weights, which must be whole then"
    folder = _folder(model_cfg)
    if not _weights_in(folder):
        return None, f"no safetensors weights in {folder}"
    return plan_for(architecture_of(folder, getattr(torch, model_cfg.get("dtype") or "float32")), folder)


def plan_for(architecture: torch.nn.Module, folder: Path, renamed: Optional[dict[str, str]] = None
             ) -> tuple[Optional[PretrainedSlices], str]:
    """Every weight of a model built without values (its names, shapes and the dtypes a whole load reads them in)
    matched to the folder's safetensors files, under its own name or with the model's base_model_prefix added or
    removed (or under the name `renamed` gives it); (None, why) where a parameter is not there."""
    files = _weights_in(folder)
    if not files:
        return None, f"no safetensors weights in {folder}"
    prefix, renamed = getattr(architecture, "base_model_prefix", ""), renamed or {}
    sources: dict[str, tuple[str, str, torch.dtype]] = {}
    for names, tensor, required in _weights_of(architecture):
        found = next(((files[key][0], key) for name in names
                      for key in ([renamed[name]] if name in renamed else _keys_for(name, prefix))
                      if key in files and files[key][1] == list(tensor.shape)), None)
        if found is None and required:
            return None, f"its files hold no weight of shape {list(tensor.shape)} named {names[0]}"
        if found is not None:
            sources.update({name: (*found, tensor.dtype) for name in names})
    return PretrainedSlices(folder, sources), ""


def export_without_values(folder: Path, trusted: set[str], accept: str
                          ) -> tuple[Optional[torch.nn.Module], Optional[PretrainedSlices], str]:
    """A frozen model that FSDP shards (a distillation teacher, GRPO's reward model) from an export or a
    transformers folder: built with its parameters on the meta device, in the dtypes a whole load
    (load_exported_model) reads them in, with where in the safetensors files each weight is, so that each rank
    reads only its shard's part (shard_frozen). (None, None, why not) for a checkpoint (rebuilt from its run's
    config), and for weights that are not under the model's names. `trusted` and `accept`: as load_exported_model's,
    for an export's config.yaml."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from src.checkpointing.export import is_exported_reward_model
    from src.schema.trusted import check_targets

    renamed = {}
    if is_exported_reward_model(folder):  # model.head=reward's export: read as load_reward_model reads it
        from src.checkpointing.reward_export import SCORE
        from src.models.hf_causal_lm import output_layer_name, with_reward_head

        model = with_reward_head(architecture_of(folder, None))
        renamed = {f"{output_layer_name(model)}.weight": SCORE}
    elif (folder / "config.json").is_file():  # a transformers model: what load_exported_model reads, too
        config = json.loads((folder / "config.json").read_text())
        if not (config.get("dtype") or config.get("torch_dtype")):
            return None, None, "its config.json names no dtype, which a whole load takes from its weights"
        model = architecture_of(folder, None)
    elif (folder / "config.yaml").is_file() and (folder / "model.safetensors").is_file():
        config = OmegaConf.load(folder / "config.yaml")
        check_targets(config, str(folder / "config.yaml"), trusted, accept)
        with init_empty_weights(include_buffers=False):  # buffers keep the values the model computes
            model = instantiate(config, _convert_="all")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    else:
        return None, None, "a checkpoint, rebuilt from its run's config"
    plan, why = plan_for(model, folder, renamed)
    return (model, plan, "") if plan is not None else (None, None, why)


def shard_frozen(accelerator: Accelerator, model: torch.nn.Module, slices: Optional[PretrainedSlices]
                 ) -> torch.nn.Module:
    """A frozen model sharded as the trained one is (accelerate's FSDP2 wrapping). With `slices` it was built
    without values (export_without_values): each rank shards memory never written, then reads its own part of the
    files, and rank 0 sends nothing (accelerate's broadcast of its state is off for this prepare)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = accelerator.state.fsdp_plugin
    broadcasts = plugin.cpu_ram_efficient_loading
    if slices is not None:
        give_uninitialised_storage(model)
        plugin.cpu_ram_efficient_loading = False
    try:
        model = fsdp2_prepare_model(accelerator, model)
    finally:
        plugin.cpu_ram_efficient_loading = broadcasts
    if slices is not None:
        load_slices(accelerator, model, slices)
    return model


def load_slices(accelerator: Accelerator, model: torch.nn.Module, plan: PretrainedSlices) -> None:
    """Into the prepared (sharded) model: each rank's part of every base weight, from the files."""
    model = accelerator.unwrap_model(model)  # FSDP2 keeps the names; a compiled model is reached through it
    left = {key for _, key, _ in plan.sources.values()}
    with ExitStack() as files, torch.no_grad():
        opened: dict[str, _WeightsFile] = {}
        for names, tensor, required in _weights_of(model):
            base_names = [name_in_files(name, base=True) for name in names]  # the folder's, whatever wraps it
            planned = next((name for name in base_names if name in plan.sources), None)
            if planned is None:
                if not required or ADAPTER_WEIGHT.search(names[0]):  # an adapter's: broadcast from rank 0's
                    continue
                raise RuntimeError(f"{names[0]}: no weight of {plan.folder} was planned for it")
            file, key, dtype = plan.sources[planned]
            if file not in opened:
                opened[file] = files.enter_context(_WeightsFile(plan.folder / file))
            local, part = _this_ranks_part(tensor)
            local.copy_(opened[file].read(key, part).to(dtype).to(local.dtype))
            left.discard(key)
    if left:
        raise RuntimeError(f"weights of {plan.folder} not read into the model: {sorted(left)[:5]}")


class _WeightsFile:
    """A safetensors file read by plain reads of the bytes a part needs. Not safetensors' own reader: it maps the
    file, and every page a rank touched would count as that rank's memory until the file is closed (a whole copy
    over the load, at the end)."""

    DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

    def __init__(self, path: Path):
        self.path, self.file = path, open(path, "rb")
        size = int.from_bytes(self.file.read(8), "little")
        self.header, self.data_start = json.loads(self.file.read(size)), 8 + size

    def __enter__(self) -> "_WeightsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def read(self, key: str, part: tuple[slice, ...]) -> torch.Tensor:
        entry = self.header[key]
        shape = entry["shape"]
        whole_rows = all(cut == slice(0, size) for cut, size in zip(part[1:], shape[1:]))
        if not shape or not whole_rows or entry["dtype"] not in self.DTYPES:  # a scalar, columns, another dtype
            from safetensors import safe_open

            with safe_open(self.path, framework="pt", device="cpu") as file:
                return file.get_slice(key)[part] if shape else file.get_tensor(key)
        dtype = self.DTYPES[entry["dtype"]]
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        rows = part[0].stop - part[0].start
        if rows == 0:  # a rank past the end of an unevenly sharded weight
            return torch.empty(0, *shape[1:], dtype=dtype)
        self.file.seek(self.data_start + entry["data_offsets"][0] + part[0].start * row_bytes)
        data = bytearray(rows * row_bytes)
        if self.file.readinto(data) != len(data):
            raise RuntimeError(f"{self.path}: {key} is cut short (a truncated file)")
        return torch.frombuffer(data, dtype=dtype).view(rows, *shape[1:])


def _own_names(model: torch.nn.Module, folder: Path) -> dict[str, tuple[str, str, torch.dtype]]:
    """trainer.init_weights: every weight of the model under its own name (a tied one under one of its names, as
    safetensors stores it), and nothing else, as load_model(strict=True) reads a whole copy."""
    from src.checkpointing.load import model_must_fit

    files = _weights_in(folder)
    sources, problems = {}, []
    for names, tensor, required in _weights_of(model):
        key = next((name for name in names if name in files), None)
        if key is None:
            problems += [f'Missing key(s) in state_dict: "{names[0]}"'] if required else []
        elif files[key][1] != list(tensor.shape):
            problems.append(f"size mismatch for {key}: copying a param with shape {files[key][1]} from checkpoint, "
                            f"the shape in current model is {list(tensor.shape)}")
        else:
            sources.update({name: (files[key][0], key, tensor.dtype) for name in names})
    used = {key for _, key, _ in sources.values()}
    problems += [f'Unexpected key(s) in state_dict: "{key}"' for key in sorted(set(files) - used)]
    if problems:
        with model_must_fit(f"trainer.init_weights={folder}",
                            "Give this run the model settings (model.*) of the run that trained them."):
            raise RuntimeError("Error(s) in loading state_dict:\n" + "\n".join(problems))
    return sources


def _this_ranks_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank holds and where it lies in the whole one (DTensor's own arithmetic for any placement)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, size) for size in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _weights_of(model: torch.nn.Module) -> Iterator[tuple[list[str], torch.Tensor, bool]]:
    """(every name, the tensor, whether the files must hold it): parameters must, persistent buffers may (a buffer
    the files lack keeps the value the model computes, as from_pretrained leaves it)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    for key, names_of_it in names.items():
        yield names_of_it, tensors[key], True
    persistent = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers():
        if name in persistent:
            yield [name], buffer, False


def _keys_for(name: str, prefix: str) -> list[str]:
    """Where a transformers checkpoint may keep a weight: under its name, or with the base model's prefix added or
    removed (a checkpoint of the base model alone, such as the hub's gpt2)."""
    if not prefix:
        return [name]
    return [name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}"]


def _weights_in(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """Every weight the folder's safetensors files hold: its file and its shape (read from the headers only)."""
    index = folder / INDEX_FILE
    if index.is_file():
        file_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        file_names = ["model.safetensors"]
    else:
        return {}
    weights = {}
    for file_name in file_names:
        with _WeightsFile(folder / file_name) as file:
            weights.update({key: (file_name, entry["shape"]) for key, entry in file.header.items()
                            if key != "__metadata__"})
    return weights


def architecture_of(folder: Path, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """The model the folder's config.json describes, without values (its names, shapes and dtypes). dtype None: as
    from_pretrained's "auto" reads it, the config's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or config.dtype or torch.float32)
    model.tie_weights()  # init_empty_weights makes a parameter for each name of a tied one
    return model
