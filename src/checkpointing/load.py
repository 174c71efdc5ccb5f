"""Restoring a run from a checkpoint: weights, optimizer, schedule, RNG streams and the data position."""

import contextlib
import json
import logging
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig
from safetensors import safe_open
from safetensors.torch import load_model

from src.checkpointing.checksums import CHECKSUMS, verified
from src.checkpointing.layout import EMA_FILE, STATE_FILE
from src.checkpointing.training_state import checked_base_weights, random_states_file
from src.checkpointing.training_state import load as load_training_state
from src.data.tokenizer import Codec, check_same_ids
from src.errors import UsageError
from src.loop.train_state import TrainState

log = logging.getLogger(__name__)


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, state: TrainState, seed: int, ema=None,
                    restart_epoch: bool = False, new_global_batch: bool = False, stream: bool = False) -> None:
    """Restore model, optimizer, scheduler, scaler, the EMA, RNG states and counters (after accelerator.prepare),
    from a checkpoint integrity.check_readable has passed (resume_point checks it before its config is read).

    `state` holds this launch's layout; the checkpoint may have been written by another one of the same
    global batch (src/loop/accumulation.py: every step then sees the same samples). `restart_epoch`: the data
    changed (trainer.resume_with_changed_data), so a position within the epoch means nothing: the next begins.
    `new_global_batch` (trainer.resume_with_new_global_batch): another global batch continues the epoch's order
    from the first sample not yet trained, at the next of this layout's micro-steps; not for a `stream`, whose
    loaders keep their own places in it.
    """
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    same_layout = _check_layout(saved, state, checkpoint, new_global_batch, stream)
    rng_file = checkpoint / random_states_file(accelerator.process_index)
    if same_layout and not rng_file.is_file():
        raise UsageError(f"{rng_file} is missing: the random state of rank {accelerator.process_index} cannot be "
                         "restored, so resuming would not be exact")
    if ema is not None and not (checkpoint / EMA_FILE).is_file():
        raise UsageError(f"{checkpoint / EMA_FILE} is missing: trainer.ema_decay's average cannot be restored. "
                         f"Resume from another checkpoint, or start a new run from its weights with "
                         f"trainer.init_weights={checkpoint}")
    # Weights left out of the checkpoint were read from model.pretrained: the ones it trained on.
    without_frozen = checked_base_weights(checkpoint, accelerator.unwrap_model(accelerator._models[0]))
    with model_must_fit(f"checkpoint {checkpoint}"):
        load_training_state(accelerator, checkpoint, with_random_states=rng_file.is_file(),
                            without_frozen=without_frozen)
    if ema is not None:  # written by rank 0, read by every rank: each keeps the same average
        with model_must_fit(f"checkpoint {checkpoint}"):
            load_model(ema, verified(checkpoint, checkpoint / EMA_FILE), strict=True, device=str(accelerator.device))
    if not rng_file.is_file():  # a rank the writing run did not have: its own stream, not rank 0's copy
        seed_this_ranks_stream(seed, saved["step"], accelerator.process_index)
    state.load_state_dict({key: value for key, value in saved.items() if key in POSITION_KEYS})
    per_micro_step = state.batch_size * state.num_processes
    if state.samples_into_epoch % per_micro_step:  # another global batch: its micro-steps start further on
        passed_over = per_micro_step - state.samples_into_epoch % per_micro_step
        state.samples_into_epoch += passed_over
        log.warning("resume: %d samples of epoch %d are passed over, to start at this layout's next micro-step "
                    "(%d samples each); the next epoch's shuffle has them", passed_over, state.epoch, per_micro_step)
    if restart_epoch and state.samples_into_epoch:
        state.epoch, state.samples_into_epoch = state.epoch + 1, 0
    if restart_epoch and state.best_metric is not None:  # measured on the old validation data: no bar for the new
        log.warning("resume: the data changed, so the best trainer.monitor value so far (%.6g at step %s, on the old "
                    "validation data) and early stopping's count start afresh", state.best_metric, state.best_step)
        state.best_metric = state.best_step = state.early_stopping_best = None
        state.evals_without_improvement = 0
    log.info("resumed from %s at step %d (epoch %d, %d samples in)", checkpoint, state.step, state.epoch,
             state.samples_into_epoch)


def seed_this_ranks_stream(seed: int, step: int, process_index: int) -> None:
    """Seed the random stream the training steps after `step` draw from (dropout's masks, anything the model
    draws): one per rank, as the same masks on every rank would correlate the samples of a global batch, and
    apart from the stream that initialised the model (alike on every rank: FSDP shards each rank's own copy).
    A fresh run seeds it at step 0; a resume on another layout at its checkpoint's step."""
    set_seed(seed + 1_000_003 * (step + 1) + process_index)


POSITION_KEYS = ("step", "epoch", "samples_into_epoch", "best_metric", "best_step", "early_stopping_best",
                 "evals_without_improvement")


def check_a_new_global_batch_fits(checkpoint: Path, state: TrainState, max_epochs: Optional[int],
                                  repeats: int = 1) -> None:
    """trainer.resume_with_new_global_batch: refused where a new global batch cannot go on. trainer.max_epochs
    counts the run in steps of its global batch: with a new one the steps already taken would be counted again in
    other units, so the length must be given in steps. An epoch whose global batches each come `repeats` times
    (objective.num_iterations) is grouped by the batch's size: a new one cannot take it on mid-way."""
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    written = TrainState(**{key: saved[key] for key in ("batch_size", "num_processes", "gradient_accumulation_steps")})
    if repeats > 1 and written.global_batch != state.global_batch:
        raise UsageError(f"trainer.resume_with_new_global_batch with objective.num_iterations={repeats}: the epoch "
                         f"gives each global batch of {written.global_batch} samples {repeats} times in a row, up to "
                         f"step {saved['step']}; batches of {state.global_batch} would regroup it mid-way. Resume "
                         "with the same global batch, or start a new run from these weights "
                         f"(trainer.init_weights={checkpoint})")
    if max_epochs is not None and written.global_batch != state.global_batch:
        raise UsageError(f"trainer.resume_with_new_global_batch with trainer.max_epochs={max_epochs}: the run's length "
                         f"counts steps of {written.global_batch} samples up to step {saved['step']}, and of "
                         f"{state.global_batch} after it, which no number of epochs says; give the length in steps, "
                         f"trainer.max_steps=N (the schedule then follows it)")


def _check_layout(saved: dict, state: TrainState, checkpoint: Path, new_global_batch: bool = False,
                  stream: bool = False) -> bool:
    """Whether the checkpoint was written on this launch's layout; refuses another global batch unless
    `new_global_batch` (trainer.resume_with_new_global_batch) allows it."""
    written = TrainState(**{key: saved[key] for key in ("batch_size", "num_processes", "gradient_accumulation_steps")})
    if written.global_batch != state.global_batch and new_global_batch and not stream:
        log.warning("resume: the global batch changes from %d samples per optimizer step (%s) to %d (%s) at step %d "
                    "(trainer.resume_with_new_global_batch): the epoch goes on in the same order, each step now "
                    "takes %d samples of it; the learning rate schedule goes on by steps, as it was",
                    written.global_batch, written.layout(), state.global_batch, state.layout(), saved["step"],
                    state.global_batch)
        return False
    if written.global_batch != state.global_batch:
        per_micro_step = state.batch_size * state.num_processes
        keep = (f"trainer.gradient_accumulation_steps={written.global_batch // per_micro_step} keeps it on "
                f"{state.num_processes} process(es)" if written.global_batch % per_micro_step == 0 else
                f"no accumulation keeps it with data.batch_size={state.batch_size} on {state.num_processes} "
                f"process(es): choose data.batch_size x processes x trainer.gradient_accumulation_steps = "
                f"{written.global_batch}")
        raise UsageError(
            f"Cannot resume {checkpoint} with another global batch: it was trained with {written.global_batch} "
            f"samples per optimizer step ({written.layout()}), this launch has {state.global_batch} "
            f"({state.layout()}). {keep}" + ("" if stream else f"; or, to train on with {state.global_batch} "
                                             "samples per step, trainer.resume_with_new_global_batch=true") + "."
        )
    if (written.batch_size, written.num_processes) == (state.batch_size, state.num_processes):
        return True
    log.warning(
        "resume: the checkpoint was written with %s, this launch has %s. The global batch is the same, so every "
        "optimizer step sees the same samples as it would have; randomness drawn per process (dropout, "
        "augmentation from the global RNG) continues statistically, not bitwise, the same.",
        written.layout(), state.layout())
    return False


RESUME_REMEDY = ("The model's code has changed since the checkpoint was written: resume with the code that wrote it "
                 "(its commit), or start a new run.")


@contextlib.contextmanager
def model_must_fit(source: str, remedy: str = RESUME_REMEDY):
    """torch's size-mismatch or missing-key error, as one paragraph naming the source and the tensors."""
    try:
        yield
    except RuntimeError as error:
        if "Error(s) in loading state_dict" not in str(error):
            raise
        details = [line.strip().rstrip(".") for line in str(error).splitlines()[1:] if line.strip()]
        raise UsageError(
            f"{source} does not fit the model its config builds: {'; '.join(details[:3])}"
            + (f" (and {len(details) - 3} more)" if len(details) > 3 else "") + f". {remedy}"
        ) from None


def load_initial_weights(model: torch.nn.Module, source: Path, model_cfg: DictConfig, codec: Optional[Codec],
                         fingerprint: dict, read: bool = True) -> None:
    """trainer.init_weights: another run's weights (its export or a checkpoint) as this run's starting point;
    nothing else of that run comes along. On text, ids must mean the same tokens as when the weights trained.
    `read=False`: the checks only (FSDP's sharded start: the rank's slices are read once the model is sharded)."""
    key = f"trainer.init_weights={source}"
    if model_cfg.get("pretrained") or model_cfg.get("peft"):
        raise UsageError(f"{key} with model.pretrained or model.peft: a transformers model starts from "
                         "model.pretrained=PATH alone (another run's export is such a folder)")
    file = source / "model.safetensors"
    if not file.is_file():
        raise UsageError(f"{key}: {file} is missing; give another run's exported model (RUN/model) or one of its "
                         "checkpoints (RUN/checkpoints/step_N; an FSDP run's export, its checkpoints are sharded)")
    try:
        with safe_open(file, framework="pt"):  # its header against the file's size, as for a resume
            pass
    except Exception as error:  # safetensors raises its own error types
        raise UsageError(f"{key}: {file} is corrupt or truncated ({error})") from None
    check_same_ids(key, source, codec, "those weights read", "Tokenize this data as that run did (data.tokenizer, "
                   "data.level)", fingerprint)
    if read:
        if (source / CHECKSUMS).is_file():  # a checkpoint: its bytes as written (an export records no CRC)
            verified(source, file)
        with model_must_fit(key, "Give this run the model settings (model.*) of the run that trained them."):
            load_model(model, file, strict=True)
