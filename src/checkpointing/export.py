"""The trained model as plain files, loadable without accelerate, Hydra's run or this repo's trainer.

<dir>/model.safetensors  weights (tied weights stored once)
<dir>/config.yaml        the model config with `_target_`, data-derived sizes resolved: load_exported_model
<dir>/config.json        transformers models only (save_pretrained): AutoModelForCausalLM.from_pretrained(<dir>)
<dir>/adapter/           model.peft only: the adapter alone (PeftModel.from_pretrained(base, <dir>/adapter));
                         <dir> itself then holds the model with the adapter merged in
<dir>/tokenizer.json ... a pretrained transformers model's tokenizer files, carried on from its folder
<dir>/vocabulary.json    text data: how text became ids (bytes, the characters, or tokenizer.json): sample.py

Sharded weights (FSDP2) are written tensor by tensor, each gathered and freed in turn, the adapter merged layer by
layer (src/checkpointing/streamed_export.py): no rank holds the whole model; the files are the same.
"""

import copy
import json
import logging
import shutil
from pathlib import Path
from typing import Iterable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_model, save_file

from src.checkpointing.reward_export import as_sequence_classifier, is_reward_model, load_reward_model
from src.checkpointing.streamed_export import (
    converts_weights,
    export_name,
    gathered,
    lora_merged_entries,
    model_entries,
    tied_copies,
    write_safetensors,
)
from src.schema.trusted import check_targets

log = logging.getLogger(__name__)
# What save_pretrained writes for a tokenizer: the export of a fine-tuned model is a whole folder again.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def export_model(accelerator, model: torch.nn.Module, config: DictConfig, directory: Path, codec=None) -> None:
    """Main process only writes; every process must call it (gathering the state dict may be collective).
    `codec`: the data's text codec (src/data/tokenizer.py), saved beside the weights for sample.py.

    Written beside the target and swapped in, so a kill mid-export leaves the previous export intact.
    """
    tmp, old = directory.with_name(f".tmp-{directory.name}"), directory.with_name(f".old-{directory.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    # save_model runs os.makedirs on every rank: it must find the directory there, and be done with it
    # before rank 0 renames it, or another rank re-creates it.
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if sharded(unwrapped) and export_streamed(accelerator, unwrapped, tmp):
        pass  # tensor by tensor: no process held the whole model (src/checkpointing/streamed_export.py)
    else:
        if sharded(unwrapped) and accelerator.is_main_process:
            log.info("export: gathering the whole model on the main process (its weights are converted on save, or "
                     "its adapter is not plain LoRA on linear layers): it holds one whole copy meanwhile")
        export_gathered(accelerator, model, unwrapped, tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        OmegaConf.save(config, tmp / "config.yaml", resolve=True)
        if codec is not None:  # text data: how prompts become ids and back (sample.py)
            codec.save(tmp)
        if is_reward_model(unwrapped):  # model.head=reward: the sequence classifier other tools read
            as_sequence_classifier(tmp, unwrapped)
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def export_streamed(accelerator, unwrapped: torch.nn.Module, tmp: Path) -> bool:
    """The export of sharded weights, each gathered, written and freed in turn; False (nothing written) where
    the model needs a whole state dict (weights transformers converts on save, adapters other than LoRA)."""
    main = accelerator.is_main_process
    if hasattr(unwrapped, "merge_and_unload"):  # peft: the adapter alone, and the model it adapts merged
        base = unwrapped.get_base_model()
        entries = None if converts_weights(base) else lora_merged_entries(unwrapped, tied_copies(base, export_name))
        if entries is None:
            return False
        # The adapter's own weights are small: gathered whole, and written as peft writes them (with the modules it
        # trains whole beside it, modules_to_save: a reward model's head).
        adapter = {name: gathered(tensor)() for name, tensor in unwrapped.state_dict().items()
                   if "lora_" in name or ".modules_to_save." in name}
        if main:
            unwrapped.save_pretrained(tmp / "adapter", state_dict=adapter)
    else:
        if hasattr(unwrapped, "save_pretrained") and converts_weights(unwrapped):
            return False
        base = unwrapped
        entries = model_entries(unwrapped, tied_copies(unwrapped, export_name))
    hugging_face = hasattr(base, "save_pretrained")  # a transformers model: also a Hugging Face folder
    if main and hugging_face:
        base.save_pretrained(tmp, state_dict={})  # config.json, generation_config.json, as its own save writes them
    write_safetensors(tmp / "model.safetensors", entries, main, {"format": "pt"})
    if main and hugging_face:
        for file in tokenizer_files(base):
            shutil.copy2(file, tmp / file.name)
    return True


def export_gathered(accelerator, model: torch.nn.Module, unwrapped: torch.nn.Module, tmp: Path) -> None:
    """The export from the whole state dict on the main process (a whole copy of the model there)."""
    state_dict = whole_state_dict(accelerator, model)
    if accelerator.is_main_process:
        if hasattr(unwrapped, "merge_and_unload"):  # peft: the adapter alone, and the model it adapts merged
            unwrapped.save_pretrained(tmp / "adapter", state_dict=state_dict)
            merged = with_adapter_merged(unwrapped, state_dict)
            merged.save_pretrained(tmp)
            for file in tokenizer_files(merged):
                shutil.copy2(file, tmp / file.name)
        elif hasattr(unwrapped, "save_pretrained"):  # a transformers model: also a Hugging Face folder
            unwrapped.save_pretrained(tmp, state_dict=without_tied_copies(state_dict, unwrapped))  # safetensors
            for file in tokenizer_files(unwrapped):
                shutil.copy2(file, tmp / file.name)
        else:
            weights = without_tied_copies(state_dict, unwrapped)
            save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})


def tokenizer_files(model: torch.nn.Module) -> list[Path]:
    """The tokenizer files beside the weights a transformers model was loaded from (model.pretrained)."""
    source = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    folder = Path(source).expanduser()
    return [folder / name for name in TOKENIZER_FILES if source and (folder / name).is_file()]


def with_adapter_merged(peft_model, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of a peft model with its adapter merged in: training goes on with the adapter. Sharded weights
    (FSDP) cannot be deep-copied, so their copy is built anew from the config and the gathered weights."""
    if not sharded(peft_model):
        return copy.deepcopy(peft_model).merge_and_unload()
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM  # model.peft adapts hf_causal_lm's models

    base = peft_model.get_base_model()
    with torch.random.fork_rng(devices=[]):  # the copy's initial weights must not move rank 0's training RNG
        fresh = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
        if is_reward_model(peft_model):  # model.head=reward: its one-wide output layer, as trained
            from src.models.hf_causal_lm import with_reward_head

            with_reward_head(fresh)
    fresh = get_peft_model(fresh, copy.deepcopy(peft_model.peft_config[peft_model.active_adapter]))
    fresh.load_state_dict(state_dict)
    return fresh.merge_and_unload()


def sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (torch's fully_shard) holds the weights as DTensor shards."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def whole_state_dict(accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, on the main process (a collective when they are sharded).

    FSDP2 (torch's fully_shard) holds DTensor shards: they are gathered the way accelerate gathers them under
    its FSDP plugin, also when the model was sharded by hand; anything else is accelerate's own state dict."""
    if sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return accelerator.get_state_dict(model)


def without_tied_copies(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One entry per tied parameter: the name that model.state_dict() lists first (streamed_export.tied_copies)."""
    drop = tied_copies(model)
    return {name: tensor.contiguous() for name, tensor in state_dict.items() if name not in drop}


def load_exported_model(directory: str | Path, device: str | torch.device = "cpu", trusted: Iterable[str] = (),
                        accept: str = "load_exported_model(..., trusted=[{value!r}])") -> torch.nn.Module:
    """The model of an export folder. Its config.yaml is data: a `_target_` that config/ does not offer is refused
    unless `trusted` names it (`accept`: how the caller's user names it, for the message)."""
    directory = Path(directory)
    if is_exported_reward_model(directory):
        return load_reward_model(directory).to(device).eval()  # model.head=reward's export, in its training form
    if (directory / "config.json").is_file():  # a transformers model: its config.yaml may name a pretrained
        from transformers import AutoModelForCausalLM  # folder that is gone, config.json has the architecture

        # safetensors only: a pytorch_model.bin planted beside the export is never unpickled
        return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                    use_safetensors=True).to(device).eval()
    for name in ("config.yaml", "model.safetensors"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is missing: not an exported model directory")
    config = OmegaConf.load(directory / "config.yaml")
    check_targets(config, str(directory / "config.yaml"), trusted, accept)
    model = instantiate(config, _convert_="all")
    load_model(model, directory / "model.safetensors", strict=True, device=str(device))
    return model.to(device).eval()


def is_exported_reward_model(directory: Path) -> bool:
    """model.head=reward's export: a transformers sequence classifier (src/checkpointing/reward_export.py)."""
    config = directory / "config.json"
    architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    return any(name.endswith("ForSequenceClassification") for name in architectures)
