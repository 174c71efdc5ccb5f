"""The one build step: everything train.py decides before its loop, decided in one place.

A run's config is only final once what it depends on is known, in this order: the checkpoint it resumes
(whose saved config wins), the launcher (precision, accumulation), the data (its sizes; epochs counted in
optimizer steps) and the memory (auto micro-batch). `build_run` takes these decisions one after the other,
building the Accelerator, the data, the model and the objective on the way, and returns them as one frozen
`Run` whose config is complete, resolved and read-only: what config.yaml and every checkpoint record.
"""

import copy
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from src.checkpointing.checkpointer import agreed_resume_point, resume_point
from src.checkpointing.load import check_a_new_global_batch_fits, load_initial_weights
from src.checkpointing.resume import check_same_data, schedule_for_resume
from src.checkpointing.training_state import leaves_out_frozen
from src.data.base import DataModule
from src.data.packing import attend_per_document
from src.data.tokenizer import BUILT_IN_TOKENIZERS, check_same_ids
from src.errors import UsageError
from src.faults.run_dir_lock import acquire_run_dir
from src.launch.accelerator import build_accelerator
from src.launch.memory import warn_if_it_cannot_fit
from src.launch.settings import LaunchSettings, Setting, launch_settings
from src.launch.sharded_start import give_storage, holds_values, without_values
from src.launcher import launched_rank
from src.loop.accumulation import fit_run_to_data
from src.loop.auto_batch import find_micro_batch
from src.loop.sync_batchnorm import sync_batchnorm
from src.loop.train_state import TrainState
from src.models.hub import TOKENIZER_FILES, fetch_from_hub, local_path
from src.models.pretrained_slices import PretrainedSlices, load_slices, plan_slices
from src.objectives.base import Objective
from src.schema.build import build
from src.schema.complete import complete_config
from src.schema.data_sizes import resolve_data_sizes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    cfg: DictConfig  # complete, resolved, read-only
    run_dir: Path
    checkpoint: Optional[Path]  # the checkpoint this run continues from; None for a fresh start
    launch: LaunchSettings  # precision and accumulation in effect, each with where it came from (the banner)
    accelerator: Accelerator
    data: DataModule  # its batch_size is the micro-batch in effect
    model: torch.nn.Module  # not yet prepared
    objective: Objective
    epoch_steps: Optional[int]  # optimizer steps per epoch; None for a dataset without a length
    data_fingerprint: dict  # what every checkpoint records of the data (DataModule.fingerprint)
    data_changed: bool  # the checkpoint was trained on other data, and trainer.resume_with_changed_data allows it
    pretrained_slices: Optional[PretrainedSlices]  # FSDP's sharded start of a pretrained folder, read by each rank

    @property
    def trainer(self) -> DictConfig:
        return self.cfg.trainer

    @property
    def epoch_samples(self) -> Optional[int]:
        """Samples per epoch, in whole global batches; None for a dataset without a length."""
        return None if self.epoch_steps is None else self.epoch_steps * self.train_state().global_batch

    def read_pretrained_slices(self, model: torch.nn.Module) -> None:
        """Into the prepared model: where each rank reads its own slices of model.pretrained, it does so now (a
        resume's checkpoint holds every weight instead, unless it left out those that do not train)."""
        resumes_all = self.checkpoint is not None and not leaves_out_frozen(self.checkpoint)
        if self.pretrained_slices is not None and not resumes_all:
            load_slices(self.accelerator, model, self.pretrained_slices)

    def train_state(self) -> TrainState:
        """Where a fresh run starts, on this run's layout (a resume then loads the checkpoint's position)."""
        return TrainState(batch_size=self.cfg.data.batch_size, num_processes=self.accelerator.num_processes,
                          gradient_accumulation_steps=self.trainer.gradient_accumulation_steps)


def build_run(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> Run:
    """`overrides`: the command line's (Hydra's task overrides), which a resume compares with its checkpoint."""
    cfg = complete_config(cfg)  # every default filled in from the signatures, every value checked
    if launched_rank() == 0:  # one live run per run dir: before anything of it is read or written
        requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0  # may wait for its previous instance
        acquire_run_dir(run_dir, cfg.trainer.run_dir_lease_s, requeued)
    checkpoint, cfg = resume_point(cfg, run_dir, overrides)  # the checkpoint's config, with the safe overrides
    launch = launch_settings(cfg.trainer)  # precision and accumulation: from the config or the launcher
    cfg = with_values(cfg, {"trainer.mixed_precision": launch.mixed_precision.value,  # recorded as in effect
                            "trainer.gradient_accumulation_steps": launch.gradient_accumulation_steps.value})
    # Its collectives hold every rank here until all have checked the run dir above, before rank 0 writes.
    accelerator = build_accelerator(cfg.trainer, launch, run_dir,
                                    stateful_loaders=getattr(get_class(cfg.data._target_), "loader_state", False))
    checkpoint = agreed_resume_point(accelerator, checkpoint, cfg)  # rank 0's view of the run dir, on every rank
    set_seed(cfg.trainer.seed)

    # A pretrained model or tokenizer named by a hub id: downloaded once per machine before anyone reads it.
    # The newest commit, where no revision was asked for, is recorded: a resume or an evaluation reads the same files.
    commits = fetch_from_hub(accelerator, cfg.model, cfg.data, BUILT_IN_TOKENIZERS, cfg.objective)
    pins = (("model.pretrained", "model.revision"), ("data.tokenizer", "data.tokenizer_revision"),
            ("objective.teacher", "objective.teacher_revision"))
    cfg = with_values(cfg, {revision: commits[key] for key, revision in pins
                            if key in commits and OmegaConf.select(cfg, revision, default="absent") is None})
    # The data first: the model config may use sizes only the data knows (${dataset:vocab_size}).
    data = build(cfg.data, group="data")
    check_tokenized_for_pretrained(data, cfg.model)
    fingerprint = data.fingerprint()
    data_changed = bool(checkpoint) and check_same_data(checkpoint, fingerprint, cfg.trainer.resume_with_changed_data)
    layout = TrainState(batch_size=data.batch_size, num_processes=accelerator.num_processes,
                        gradient_accumulation_steps=cfg.trainer.gradient_accumulation_steps)
    # Each global batch as many steps in a row as the objective trains on it (GRPO's num_iterations).
    repeats = OmegaConf.select(cfg, "objective.num_iterations", default=1)
    if checkpoint and cfg.trainer.resume_with_new_global_batch:
        check_a_new_global_batch_fits(checkpoint, layout, cfg.trainer.max_epochs, repeats)
    epoch_steps, max_steps = fit_run_to_data(data, cfg.trainer, layout, repeats)  # whole batches; epochs -> steps
    cfg = resolve_data_sizes(with_values(cfg, {"trainer.max_steps": max_steps}), data.sizes())
    if checkpoint:  # a new length or schedule: taken where the steps already taken keep their learning rates
        cfg = schedule_for_resume(cfg, checkpoint, overrides)
    # FSDP's sharded start: rank 0 alone holds the model whole, or no rank does where each reads its own slices of
    # a pretrained folder or of trainer.init_weights once the model is sharded (`Run.read_pretrained_slices`).
    init_weights = Path(cfg.trainer.init_weights) if cfg.trainer.init_weights and not checkpoint else None
    slices = plan_slices(accelerator, cfg.model, init_weights)
    with without_values(accelerator, read_in_slices=slices is not None):
        model = build(cfg.model, group="model")
    give_storage(accelerator, model, read_in_slices=slices is not None)
    check_vocabulary_fits(model, data.sizes(), cfg.model)
    if data.attends_per_document:  # data.packing=true
        attend_per_document(model)
    warn_if_it_cannot_fit(accelerator, model, cfg)  # weights, gradients and optimizer state against the memory
    # A resumed run continues from its checkpoint's weights. Every rank checks them; a rank without values reads none.
    if init_weights:
        load_initial_weights(model, init_weights, cfg.model, data.codec, fingerprint,
                             read=holds_values(accelerator, read_in_slices=slices is not None))
        slices = slices.of_model(model) if slices is not None else None
    if cfg.trainer.sync_batchnorm:
        model = sync_batchnorm(model, accelerator)
    objective = build(cfg.objective, group="objective")

    if cfg.trainer.auto_micro_batch and not checkpoint:  # a resumed run keeps the micro-batch its config records
        per_process = data.batch_size * cfg.trainer.gradient_accumulation_steps
        micro_batch = find_micro_batch(accelerator, model, objective, data, per_process)
        accumulation = per_process // micro_batch  # the global batch is unchanged
        cfg = with_values(cfg, {"data.batch_size": micro_batch, "trainer.gradient_accumulation_steps": accumulation})
        fits = Setting(accumulation, "auto micro-batch: largest that fits")
        launch = replace(launch, gradient_accumulation_steps=fits)
        data.batch_size = micro_batch  # the loaders are built from it
        accelerator.gradient_accumulation_steps = accumulation
        log.info("auto micro-batch: %d samples per process x %d micro-steps", micro_batch, accumulation)
    OmegaConf.set_readonly(cfg, True)
    return Run(cfg, run_dir, checkpoint, launch, accelerator, data, model, objective, epoch_steps, fingerprint,
               data_changed, slices)


def check_vocabulary_fits(model: torch.nn.Module, sizes: dict[str, int], model_cfg: DictConfig) -> None:
    """Token ids past the embedding fail deep inside the model (a CUDA assert on GPU); say it before. A model
    built from ${dataset:vocab_size} fits by construction; a pretrained one must come with its tokenizer."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    vocab_size = sizes.get("vocab_size")
    if vocab_size is None or not isinstance(embeddings, torch.nn.Embedding):
        return
    if vocab_size > embeddings.num_embeddings:
        source = f"model.pretrained={model_cfg.pretrained}" if model_cfg.get("pretrained") else "the model"
        raise UsageError(f"the data has {vocab_size} token ids but {source} embeds {embeddings.num_embeddings}: "
                         "tokenize with the model's own tokenizer (data.tokenizer=PATH; the default with "
                         "model.pretrained when its folder has tokenizer.json)")


def check_tokenized_for_pretrained(data: DataModule, model_cfg: DictConfig) -> None:
    """model.pretrained reads ids as its own tokenizer made them. Data whose ids another made (shards prepared with
    another --tokenizer, a data.tokenizer given) would train on ids that mean other text, silently wherever they fit
    the embedding: refused, where the folder says how its text became ids (a tokenizer, or an export's
    vocabulary.json; trainer.init_weights has its own check, src/checkpointing/load.py)."""
    codec, pretrained = getattr(data, "codec", None), model_cfg.get("pretrained")
    if codec is None or not pretrained:
        return
    folder = local_path(str(pretrained), "model.pretrained", TOKENIZER_FILES, revision=model_cfg.get("revision"),
                        quiet=True)
    check_same_ids(f"model.pretrained={pretrained}", folder, codec, "the model reads",
                   "Tokenize the data with the model's tokenizer: data.tokenizer (by default the model's), or, for "
                   f"data=shards, scripts/prepare_data.py --tokenizer {pretrained}")


def with_values(cfg: DictConfig, values: dict[str, Any]) -> DictConfig:
    """A copy of the config with these full keys set: the config given is left as it was."""
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg
