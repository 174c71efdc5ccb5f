"""A sharded start: under FSDP, no rank but rank 0 ever holds the model's values whole.

With `fsdp_cpu_ram_efficient_loading: true` (config/accelerate/fsdp.yaml) accelerate shards the model on the meta
device and broadcasts rank 0's values shard by shard (accelerate.utils.fsdp_utils.fsdp2_load_full_state_dict), so
the other ranks need the model's shapes only. Here they get them without ever holding values: the model is built
with its parameters on the meta device (buffers stay real: FSDP does not broadcast the non-persistent ones, such
as rotary frequencies), then given uninitialised storage, which the kernel backs with memory only once written
and accelerate drops for the shard rank 0 sends. A pretrained folder is read by rank 0 alone; the other ranks build
its architecture from its config.json. Where its weights are safetensors files, rank 0 builds it without values too
and every rank reads its own slices once FSDP has sharded it (src/models/pretrained_slices.py).

The result is bitwise the model a whole copy per rank gives: rank 0 builds it as every rank would, and no rank's
random stream depends on the build (the checkpointer seeds each rank's own stream afterwards).
"""

import contextlib
from typing import Iterator

import torch
from accelerate import Accelerator, init_empty_weights
from accelerate.utils import DistributedType

# Module.register_parameter as torch defines it: accelerate's init_empty_weights replaces it while it lasts.
_REGISTER_PARAMETER = torch.nn.Module.register_parameter


def is_sharded_start(accelerator: Accelerator) -> bool:
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    return bool(plugin is not None and plugin.cpu_ram_efficient_loading and accelerator.num_processes > 1)


def holds_values(accelerator: Accelerator, read_in_slices: bool = False) -> bool:
    """Whether this rank's model has its values before it is prepared: every rank's, except in a sharded start
    (rank 0's there, unless every rank reads its own slices of a pretrained folder after the prepare)."""
    if not is_sharded_start(accelerator):
        return True
    return accelerator.is_main_process and not read_in_slices


@contextlib.contextmanager
def without_values(accelerator: Accelerator, read_in_slices: bool = False) -> Iterator[None]:
    """Around the model's build: on a rank that does not hold values, parameters are made on the meta device."""
    if holds_values(accelerator, read_in_slices):
        yield
        return
    with init_empty_weights(include_buffers=False):
        yield


@contextlib.contextmanager
def with_values_again(model: torch.nn.Module) -> Iterator[None]:
    """Inside `without_values`: `model` gets uninitialised storage, and parameters made here get values, as a whole
    copy makes them (a LoRA adapter over a base whose values arrive later: its initialisation draws from the
    seeded generator, the same draws on every rank)."""
    _materialise_meta_parameters(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    empty, torch.nn.Module.register_parameter = torch.nn.Module.register_parameter, _REGISTER_PARAMETER
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = empty


def is_built_without_values() -> bool:
    """Inside `without_values` on a rank that holds none: a model builder can then skip reading weights (accelerate
    offers no query for its context, so this asks where a new parameter goes)."""
    probe = torch.nn.Module()  # not a layer: its initialisation would draw from the generator the model's build uses
    probe.register_parameter("probe", torch.nn.Parameter(torch.empty(0)))
    return probe.probe.is_meta


def give_storage(accelerator: Accelerator, model: torch.nn.Module, read_in_slices: bool = False) -> None:
    """After the build: the model's parameters in uninitialised host memory (accelerate moves them to the meta device
    itself, but maps optimizer parameters by their storage's address, which meta tensors do not have)."""
    if not holds_values(accelerator, read_in_slices):
        give_uninitialised_storage(model)


def give_uninitialised_storage(model: torch.nn.Module) -> None:
    """A model built with its parameters on the meta device gets them in host memory that is never written (FSDP
    shards it, src/models/pretrained_slices.py fills each rank's shard), tied ones kept tied."""
    _materialise_meta_parameters(model)
    if hasattr(model, "tie_weights"):  # init_empty_weights makes a new parameter for each name a tied one has
        model.tie_weights()


def _materialise_meta_parameters(model: torch.nn.Module) -> None:
    """Only the parameters: the buffers were made with their values (Module.to_empty would drop them). A parameter
    under several names (tied weights) stays one."""
    made: dict[int, torch.nn.Parameter] = {}
    with _uninitialised_memory_left_unwritten():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.is_meta:
                    if id(param) not in made:
                        made[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                             requires_grad=param.requires_grad)
                    module._parameters[name] = made[id(param)]


@contextlib.contextmanager
def _uninitialised_memory_left_unwritten() -> Iterator[None]:
    """Deterministic mode fills new memory with NaN (torch.utils.deterministic), which would make it resident."""
    import torch.utils.deterministic as deterministic

    filled, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = filled
