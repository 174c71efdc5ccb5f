"""The training's own state in a checkpoint: weights, optimizer, schedule, GradScaler and every rank's random
streams, in files that hold no pickle (src/checkpointing/plain_state.py).

Not accelerate's save_state/load_state, which lay out the same states but pickle the optimizer, schedule, scaler
and random states (optimizer.bin, scheduler.bin, scaler.pt, random_states_N.pkl), as torch.distributed.checkpoint's
default files pickle their metadata: reading a pickle back can run code. The files, one per object given to
accelerator.prepare (a second model, optimizer or schedule is numbered _1, as accelerate numbers them):

    model.safetensors                 the weights, as the model names them (the same on any number of processes)
    optimizer.safetensors             the optimizer's state
    scheduler.json, scaler.json       the schedule's and (fp16) the GradScaler's state
    random_states_<rank>.safetensors  each rank's random streams: Python's, numpy's, torch's (and CUDA's), and
                                      accelerate's micro-step count
    objective_state_<rank>.safetensors  where the objective keeps some (Objective.rank_state): GRPO's completions
                                      that the next steps of objective.num_iterations train on again

Under FSDP2 the weights and the optimizer's state stay sharded: `pytorch_model_fsdp_0/` and `optimizer_0/` hold one
safetensors file per rank, which any number of ranks reads back (resharded); the optimizer's values that are not
tensors (its param_groups: learning rates, betas, parameter names) are `optimizer_0/plain_values.json`.

A run from model.pretrained leaves out the weights that do not train (a LoRA adapter's base model: a few MB of
checkpoint instead of the whole model each time): every start reads them from that folder again, and
`base_weights.json` records the folder's weight files, so that a resume on other base weights is refused.
"""

import contextlib
import copy
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_model, save_file

from src.checkpointing.checksums import verified, whole_file_digest
from src.checkpointing.export import without_tied_copies
from src.checkpointing.plain_state import load_tree, merge, save_tree, sharded_reader, sharded_writer, split_tensors
from src.errors import UsageError
from src.models.parameter_names import name_in_files

MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"
SCHEDULER_FILE, SCALER_FILE = "scheduler.json", "scaler.json"
SHARDED_MODEL, SHARDED_OPTIMIZER = "pytorch_model_fsdp", "optimizer"  # directories <name>_<i>, as accelerate's
PLAIN_VALUES = "plain_values.json"
BASE_FILE = "base_weights.json"


def random_states_file(rank: int) -> str:
    return f"random_states_{rank}.safetensors"


def objective_state_file(rank: int) -> str:
    """Where a rank's objective keeps what a resume needs of it (Objective.rank_state)."""
    return f"objective_state_{rank}.safetensors"


def numbered(name: str, index: int) -> str:
    """The file of the index-th model, optimizer or schedule: model.safetensors, model_1.safetensors, ..."""
    stem, dot, suffix = name.partition(".")
    return name if index == 0 else f"{stem}_{index}{dot}{suffix}"


def sharded(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def check_supported(accelerator: Accelerator) -> None:
    """The layouts whose state this module saves: one process, DDP, and FSDP2 with sharded state dicts."""
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise UsageError(f"distributed_type {kind.value} (your accelerate config) is not supported: its checkpoints "
                         "are its own. Use one process, DDP (MULTI_GPU) or FSDP (config/accelerate/fsdp.yaml).")
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        state_dict_type = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)
        if plugin.fsdp_version != 2 or state_dict_type != "SHARDED_STATE_DICT":
            raise UsageError(
                f"fsdp_config has fsdp_version {plugin.fsdp_version} and fsdp_state_dict_type {state_dict_type}; "
                "checkpoints are written for fsdp_version: 2 with fsdp_state_dict_type: SHARDED_STATE_DICT (as "
                "config/accelerate/fsdp.yaml sets them; the export gathers the whole model either way)")


# ------------------------------------------------------------------------------------------------------- saving

def main_states(accelerator: Accelerator, on_host: bool = False, without_frozen: bool = False) -> dict[str, Any]:
    """What rank 0 writes of a checkpoint without FSDP: file name -> state. `on_host`: copies in host memory, for a
    thread to write while training goes on (tensors that share storage, tied weights, still share it).
    `without_frozen`: the parameters that do not train left out (they are read from model.pretrained again)."""
    taken = _on_host if on_host else (lambda tree: tree)
    states = {}
    for i, model in enumerate(accelerator._models):  # the prepared objects, as save_state reads them
        unwrapped = _unwrapped(accelerator, model)  # tied weights once, under the name the export keeps
        left_out = frozen_parameters(unwrapped) if without_frozen else set()
        states[numbered(MODEL_FILE, i)] = taken(_without(without_tied_copies(unwrapped.state_dict(), unwrapped),
                                                         left_out))
    states.update({numbered(OPTIMIZER_FILE, i): taken(optimizer.state_dict())
                   for i, optimizer in enumerate(accelerator._optimizers)})
    return {**states, **_small_states(accelerator)}


def _small_states(accelerator: Accelerator) -> dict[str, Any]:
    """The schedules' and the GradScaler's states (copies: a few numbers)."""
    states = {numbered(SCHEDULER_FILE, i): copy.deepcopy(scheduler.state_dict())
              for i, scheduler in enumerate(accelerator._schedulers)}
    if accelerator.scaler is not None:
        states[SCALER_FILE] = accelerator.scaler.state_dict()
    return states


def write_main_states(states: dict[str, Any], directory: Path) -> None:
    for name, state in states.items():
        if name.startswith("model"):  # load_model ties them again
            save_file(state, str(directory / name), metadata={"format": "pt"})
        else:
            save_tree(state, directory / name)


def save_sharded(accelerator: Accelerator, directory: Path, save: Optional[Callable] = None,
                 without_frozen: bool = False) -> None:
    """Every rank: its shards of the weights and the optimizer's state (FSDP2), through `save`
    (torch.distributed.checkpoint.save, or the checkpointer's saving in the background), and rank 0 the rest."""
    from torch.distributed.checkpoint import save as blocking_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    save = save or blocking_save
    for i, model in enumerate(accelerator._models):
        target = directory / f"{SHARDED_MODEL}_{i}"
        target.mkdir(parents=True, exist_ok=True)
        weights = _without(get_model_state_dict(model), frozen_parameters(model) if without_frozen else set())
        save({"model": weights}, storage_writer=sharded_writer(target))
    for i, optimizer in enumerate(accelerator._optimizers):
        target = directory / f"{SHARDED_OPTIMIZER}_{i}"
        target.mkdir(parents=True, exist_ok=True)
        tensors, plain = split_tensors(get_optimizer_state_dict(accelerator._models[i], optimizer.optimizer))
        save({"optimizer": tensors}, storage_writer=sharded_writer(target))
        if accelerator.is_main_process:
            save_tree(plain, target / PLAIN_VALUES)
    if accelerator.is_main_process:
        write_main_states(_small_states(accelerator), directory)


def random_states(step: int) -> dict:
    """This process's random streams, and accelerate's micro-step count (accumulation windows count from it)."""
    states = {"step": step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def save_random_states(accelerator: Accelerator, directory: Path) -> None:
    save_tree(random_states(accelerator.step), directory / random_states_file(accelerator.process_index))


# ------------------------------------------------------------------------------------------------------ loading

def load(accelerator: Accelerator, directory: Path, with_random_states: bool, without_frozen: bool = False) -> None:
    """Every rank: the states save wrote, into the prepared objects. `with_random_states`: this rank's streams too
    (a checkpoint of another layout has none for it, or another rank's). `without_frozen`: the parameters that do
    not train may be missing from it (the model holds them, read from model.pretrained)."""
    def read(name: str) -> Path:  # each file this rank reads, its bytes checked first (checksums.verified)
        return verified(directory, directory / name)

    if accelerator.scaler is not None:  # before an FSDP2 optimizer, whose state is set up by a step
        accelerator.scaler.load_state_dict(load_tree(read(SCALER_FILE)))
    if sharded(accelerator):
        _load_sharded(accelerator, directory, without_frozen)
    else:
        on_gpus = accelerator.num_processes > 1 and accelerator.device.type != "cpu"  # as accelerate's load_state
        device = str(accelerator.device) if on_gpus else "cpu"
        for i, model in enumerate(accelerator._models):
            load_weights(_unwrapped(accelerator, model), read(numbered(MODEL_FILE, i)), without_frozen, device)
        for i, optimizer in enumerate(accelerator._optimizers):
            with fits_the_optimizer(directory / numbered(OPTIMIZER_FILE, i)):
                saved = load_tree(read(numbered(OPTIMIZER_FILE, i)), device)
                check_hyperparameters(saved["param_groups"], optimizer.param_groups)
                optimizer.load_state_dict(saved)
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(load_tree(read(numbered(SCHEDULER_FILE, i))))
    if with_random_states:
        states = load_tree(read(random_states_file(accelerator.process_index)))
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
        accelerator.step = states["step"]


def load_weights(model: torch.nn.Module, file: Path, without_frozen: bool, device: str = "cpu") -> None:
    """safetensors' load_model, strict but for the parameters that do not train where they were left out: torch's
    own error for any other missing or unexpected name, or a size that does not fit."""
    missing, unexpected = load_model(model, str(file), strict=False, device=device)
    _all_there(model, missing, unexpected, without_frozen)


def load_whole_weights(model: torch.nn.Module, checkpoint: Path, without_frozen: bool) -> None:
    """A checkpoint's weights into a whole (unsharded) model on this process alone: model.safetensors, or an FSDP
    checkpoint's shards of every rank read into it (for eval.py, on any number of processes)."""
    if (checkpoint / MODEL_FILE).is_file() or not (checkpoint / f"{SHARDED_MODEL}_0").is_dir():
        load_weights(model, verified(checkpoint, checkpoint / MODEL_FILE), without_frozen)
        return
    import torch.distributed.checkpoint as dcp

    state = {"model": _without(model.state_dict(), frozen_parameters(model) if without_frozen else set())}
    try:  # in place, into the model's own tensors; no collective, so each process reads what it needs
        dcp.load(state, storage_reader=sharded_reader(checkpoint / f"{SHARDED_MODEL}_0"), no_dist=True)
    except Exception as error:  # DCP's CheckpointException names the missing keys; said as torch's own words
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t{error}") from None


def _all_there(model: torch.nn.Module, missing, unexpected, without_frozen: bool) -> None:
    missing = sorted(set(missing) - (frozen_parameters(model) if without_frozen else set()))
    if missing or unexpected:  # as torch words it: src/checkpointing/load.py's model_must_fit rewords it
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n"
                           + "".join(f"\tMissing key: {name}\n" for name in missing)
                           + "".join(f"\tUnexpected key: {name}\n" for name in unexpected))


def frozen_parameters(model: torch.nn.Module) -> set[str]:
    """The names of the parameters that do not train (a LoRA adapter's base model), tied names included (torch's
    StateDictOptions(ignore_frozen_params) misses those: it keeps a frozen lm_head tied to its embedding), as state
    dicts name them: without the wrappers' segments (src/models/parameter_names.py)."""
    return {name_in_files(name) for name, parameter in model.named_parameters(remove_duplicate=False)
            if not parameter.requires_grad}


def _without(state_dict: dict, names: set[str]) -> dict:
    return {name: value for name, value in state_dict.items() if name not in names}


def base_weights(model: torch.nn.Module, sampled: bool = False) -> dict[str, str]:
    """The weight files of the folder a model.pretrained model was read from, each as its size and a hash of every
    byte (checksums.whole_file_digest, cached per machine): the base weights a checkpoint without them needs again.
    `sampled`: a megabyte of each instead (src/data/base.py's file_digest), as checkpoints before 2026-11-27
    recorded them."""
    from src.data.base import file_digest

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the model it adapts
    folder = Path(getattr(getattr(base, "config", None), "name_or_path", "") or "")
    files = [f for f in sorted(folder.iterdir()) if f.suffix in (".safetensors", ".bin")] if folder.is_dir() else []
    digest = file_digest if sampled else whole_file_digest
    return {"folder": str(folder), **{f"file {f.name}": digest(f) for f in files}}


def leaves_out_frozen(checkpoint: Path) -> bool:
    """Whether a checkpoint left out the weights that do not train (it then records their folder: BASE_FILE)."""
    return (checkpoint / BASE_FILE).is_file()


def checked_base_weights(checkpoint: Path, model: torch.nn.Module) -> bool:
    """leaves_out_frozen(checkpoint), after refusing a model whose base weights are not those the checkpoint
    trained on (see base_weights)."""
    if not leaves_out_frozen(checkpoint):
        return False
    saved = json.loads((checkpoint / BASE_FILE).read_text())
    sampled = not any("blake2b" in value for key, value in saved.items() if key.startswith("file "))
    now = base_weights(model, sampled)
    changed = [key for key in sorted(set(saved) | set(now)) if key != "folder" and saved.get(key) != now.get(key)]
    if changed:
        raise UsageError(f"checkpoint {checkpoint} left out the weights that do not train, to be read from "
                         f"model.pretrained again, but {now['folder']} now holds other ones ({', '.join(changed)} "
                         f"differ from {saved.get('folder')} when it was written). Give model.pretrained the base it "
                         "trained on.")
    return True


def _load_sharded(accelerator: Accelerator, directory: Path, without_frozen: bool) -> None:
    """Each rank reads its slices of every rank's files: the checkpoint may come from another number of ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(strict=not without_frozen)
    for i, model in enumerate(accelerator._models):
        state = {"model": _without(get_model_state_dict(model), frozen_parameters(model) if without_frozen else set())}
        dcp.load(state, storage_reader=sharded_reader(directory / f"{SHARDED_MODEL}_{i}"))
        missing, unexpected = set_model_state_dict(model, state["model"], options=options)
        _all_there(model, missing, unexpected, without_frozen)
    for i, optimizer in enumerate(accelerator._optimizers):
        source, model = directory / f"{SHARDED_OPTIMIZER}_{i}", accelerator._models[i]
        tensors, _ = split_tensors(get_optimizer_state_dict(model, optimizer.optimizer))
        state = {"optimizer": tensors}
        dcp.load(state, storage_reader=sharded_reader(source))
        plain = load_tree(source / PLAIN_VALUES)
        with fits_the_optimizer(source):
            saved = merge(state["optimizer"], plain)
            check_hyperparameters(saved["param_groups"], optimizer.optimizer.param_groups)
            set_optimizer_state_dict(model, optimizer.optimizer, saved)


# ------------------------------------------------------------------------------------------------------ helpers

@contextlib.contextmanager
def fits_the_optimizer(source: Path) -> Iterator[None]:
    """An optimizer state that does not fit this run's optimizer (torch's checks of its groups, optimizer=muon's
    split) refused as the bad input it is, naming the file."""
    try:
        yield
    except ValueError as error:
        raise UsageError(f"{source}: {error}") from None


# Group keys that are not the optimizer's mathematics: the parameters, the rate the schedule sets each step (its
# base, initial_lr, is compared), and how the kernels run (a run resumed on other hardware may choose others).
NOT_HYPERPARAMETERS = {"params", "lr", "foreach", "fused", "capturable", "differentiable"}


def check_hyperparameters(saved_groups: list[dict], groups: list[dict]) -> None:
    """torch's load_state_dict takes every hyperparameter (betas, weight decay, Muon's scaling, ...) from the saved
    groups over those the config built: a state edited, or written by another run than its config.yaml says, would
    change the run silently. A resume builds the optimizer from the checkpoint's own config, so they must agree."""
    if len(saved_groups) != len(groups):
        return  # torch's own check names it
    for i, (saved, built) in enumerate(zip(saved_groups, groups)):
        # Keys both have: one a newer torch added to its groups takes its default on load, as torch intends.
        for key in sorted((saved.keys() & built.keys()) - NOT_HYPERPARAMETERS):
            if _plain(saved[key]) != _plain(built[key]):
                raise ValueError(f"its parameter group {i} has {key}={saved[key]!r} where the optimizer its config "
                                 f"builds has {built[key]!r}: a state edited or written by another run, refused")


def _plain(value):
    """A hyperparameter as saved: tuples are lists in the checkpoint, tensors (a tensor lr or beta) numbers."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _unwrapped(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The user's module: its parameter names do not depend on DDP or torch.compile."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def _on_host(tree):
    """Every tensor of a (nested) state dict copied to host memory, tensors that share storage (tied weights)
    still shared, so that the copy is saved as the original would be."""
    copies = {}

    def copy_of(value):
        if isinstance(value, torch.Tensor):
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.dtype)
            if key not in copies:
                copies[key] = value.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(value, dict):
            return type(value)((k, copy_of(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(copy_of(v) for v in value)
        return value

    return copy_of(tree)
