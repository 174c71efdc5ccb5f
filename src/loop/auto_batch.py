"""The largest per-process micro-batch that fits, with the global batch and the loss maths unchanged.

accelerate's `find_executable_batch_size` shrinks a batch by x0.9 per out-of-memory error, which changes the
global batch. Here the micro-batch is a divisor of the samples one process takes per optimizer step
(`data.batch_size x gradient_accumulation_steps`), tried largest first, and the accumulation makes up the
rest, so every optimizer step still sees the same samples and the same loss (src/loop/accumulation.py). Each try
is one forward and backward on real training samples; the model's parameters, buffers (BatchNorm
statistics) and the RNG are restored afterwards, so the run is the one the config describes. All ranks take
the smallest micro-batch any of them can fit. The optimizer's state is allocated later, at the first step:
on a GPU that is nearly full after the probe, lower data.batch_size by hand.
"""

import copy
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import release_memory, send_to_device
from accelerate.utils.memory import should_reduce_batch_size

from src.errors import UsageError
from src.loop.batches import split_batch
from src.objectives.base import Objective

log = logging.getLogger(__name__)


def is_out_of_memory(exception: BaseException) -> bool:
    return isinstance(exception, torch.OutOfMemoryError) or should_reduce_batch_size(exception)


def runs_beside_the_model(objective: Objective) -> bool:
    """Whether the objective computes a step's inputs with more than the batch (with_reference, prepare_window),
    from what only its start() builds once the model is prepared, after the probe."""
    kind = type(objective)
    return kind.with_reference is not Objective.with_reference or kind.prepare_window is not Objective.prepare_window


def find_micro_batch(accelerator: Accelerator, model: torch.nn.Module, objective: Objective, data,
                     per_process_samples: int) -> int:
    """The largest divisor of per_process_samples whose forward + backward fits on every rank."""
    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):  # probed before prepare: a whole copy
        raise UsageError(f"trainer.auto_micro_batch probes a whole copy of the model on each device, while "
                         f"{accelerator.distributed_type} shards it: the probe would measure another layout. Give "
                         "data.batch_size and trainer.gradient_accumulation_steps by hand, with "
                         "trainer.auto_micro_batch=false")
    if runs_beside_the_model(objective):
        raise UsageError(f"trainer.auto_micro_batch probes the model's forward and backward passes alone, before the "
                         f"run starts; the objective ({type(objective).__name__}) also runs a reference model, a "
                         "teacher or the model's own completions each step, whose memory the probe cannot see: give "
                         "data.batch_size and trainer.gradient_accumulation_steps by hand, with "
                         "trainer.auto_micro_batch=false")
    candidates = [b for b in range(per_process_samples, 0, -1) if per_process_samples % b == 0]
    saved_state, saved_rng = copy.deepcopy(model.state_dict()), torch.random.get_rng_state()
    saved_cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    model.to(accelerator.device).train()
    chosen = None
    for size in candidates:
        if size > len(data.train):
            continue
        batch = data.collate_fn([data.train[i] for i in range(size)]) if data.collate_fn else \
            torch.utils.data.default_collate([data.train[i] for i in range(size)])
        batch = send_to_device(batch, accelerator.device)
        try:
            inputs, targets = split_batch(batch, objective.target_key)
            with accelerator.autocast():
                loss = objective.model_loss_sum(model, inputs, targets)
            loss.sum().backward()
            chosen = size
        except Exception as error:  # noqa: BLE001 (only out-of-memory errors are swallowed)
            if not is_out_of_memory(error):
                raise
            log.info("auto micro-batch: %d samples per process do not fit (%s)", size, type(error).__name__)
        finally:
            model.zero_grad(set_to_none=True)
            release_memory()
        if chosen is not None:
            break
    model.load_state_dict(saved_state)
    objective.training_metrics()  # what the probes recorded is not training's
    torch.random.set_rng_state(saved_rng)
    if saved_cuda_rng is not None:
        torch.cuda.set_rng_state_all(saved_cuda_rng)
    local = torch.tensor(chosen or 0, device=accelerator.device)
    agreed = int(accelerator.reduce(local, "min").item()) if accelerator.num_processes > 1 else int(local)
    if agreed == 0:
        raise RuntimeError("auto micro-batch: not even one sample per process fits in memory")
    return agreed
