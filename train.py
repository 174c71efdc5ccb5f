"""Train a model: build -> prepare -> (resume) -> loop -> save.

    accelerate launch train.py                          # defaults: char-level GPT on tiny Shakespeare
    accelerate launch train.py experiment=cifar10_resnet data.root=/data/cifar-10-batches-bin
    accelerate launch --multi_gpu --num_processes 2 train.py trainer.max_steps=100   # CPU DDP
    accelerate launch train.py hydra.run.dir=outputs/my_run resume=auto             # continue a run

Every key is documented in src/config.py; the defaults live in config/.
"""

import logging
import math
import sys
from pathlib import Path

import hydra
from accelerate.utils import set_seed
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

import src.config  # noqa: F401  (registers the config schema and the run-dir resolver with Hydra)
from src.checkpoint import Checkpointer, config_for_resume, load_checkpoint, resume_source
from src.evaluation import evaluate
from src.export import export_model, model_config
from src.launch import build_accelerator, check_replicas_in_sync, describe_launch, run_then_release, shut_down
from src.objective import training_loss
from src.optim import param_groups
from src.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch, requeue_slurm_job
from src.run_log import start_run_log
from src.train_state import TrainState, is_improvement, micro_batches

log = logging.getLogger("train")


@hydra.main(config_path="config", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    checkpoint = resume_source(cfg.resume, run_dir)  # refuses to write into another run's directory
    if checkpoint:
        cfg = config_for_resume(cfg, checkpoint, HydraConfig.get().overrides.task)
    trainer = cfg.trainer
    # Its collectives hold every rank here until all have checked the run dir above, before rank 0 writes.
    accelerator = build_accelerator(trainer, run_dir)
    set_seed(trainer.seed)

    # Build.
    data = instantiate(cfg.data)
    model = instantiate(cfg.model, **data.model_kwargs)
    if trainer.compile:
        model.compile()  # in place, so state_dict keys stay free of torch.compile's "_orig_mod." prefix
    optimizer = instantiate(cfg.optimizer)(param_groups(model))
    scheduler = instantiate(cfg.scheduler)(optimizer)
    train_loader, val_loader = data.train_dataloader(), data.val_dataloader()

    # Prepare: device placement, DDP wrapping, autocast, data sharding.
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )
    state = TrainState()
    if checkpoint:
        load_checkpoint(accelerator, checkpoint, state)
    checkpointer = Checkpointer(accelerator, run_dir, cfg)
    start_run_log(accelerator, cfg, run_dir, describe_launch(accelerator, cfg, run_dir), state.step)
    export_config = model_config(cfg.model, data.model_kwargs)
    preemption = PreemptionWatch()

    # Loop: one iteration per micro-batch; everything below `sync_gradients` happens once per optimizer step.
    max_grad_norm = trainer.max_grad_norm or math.inf  # inf: measure the norm for logging, clip nothing
    progress = tqdm(total=trainer.max_steps, initial=state.step, disable=not accelerator.is_main_process)
    window_loss = 0.0
    model.train()
    for batch in micro_batches(accelerator, train_loader, state, trainer.max_steps):
        with accelerator.accumulate(model):
            loss = training_loss(model, batch)
            accelerator.backward(loss)  # divides by gradient_accumulation_steps itself
            window_loss += loss.detach()
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()  # a no-op until the accumulation window is complete
            optimizer.zero_grad(set_to_none=True)
        if not accelerator.sync_gradients:
            continue

        scheduler.step()
        state.step += 1
        progress.update()
        if state.step % trainer.log_every == 0:
            step_loss = accelerator.reduce(window_loss / trainer.gradient_accumulation_steps, "mean").item()
            scalars = {"train/loss": step_loss, "train/lr": scheduler.get_last_lr()[0], "train/grad_norm": grad_norm.item()}
            accelerator.log(scalars, step=state.step)
            progress.set_postfix(loss=f"{step_loss:.4f}")
        window_loss = 0.0

        done = state.step >= trainer.max_steps
        if done or (trainer.eval_every and state.step % trainer.eval_every == 0):
            metrics = {f"eval/{k}": v for k, v in evaluate(model, val_loader, accelerator).items()}
            accelerator.log(metrics, step=state.step)
            log.info("step %d: %s", state.step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if is_improvement(metrics, state, trainer.monitor, trainer.monitor_mode.value):
                checkpointer.save(state)  # the best checkpoint, kept apart from rotation
                export_model(accelerator, model, export_config, run_dir / "model_best")
        if done or (trainer.checkpoint_every and state.step % trainer.checkpoint_every == 0):
            checkpointer.save(state)
        if not done and preemption.stop_agreed(accelerator):
            log.warning("stopping at step %d on %s: saving a checkpoint", state.step, preemption.describe())
            checkpointer.save(state)
            break
    progress.close()
    if state.step < trainer.max_steps:  # stopped early: resume later from the checkpoint just saved
        requeue_slurm_job(accelerator)
        shut_down(accelerator)
        sys.exit(PREEMPTED_EXIT_CODE)

    # Save.
    export_model(accelerator, model, export_config, run_dir / "model")
    log.info("exported the final model to %s", run_dir / "model")
    check_replicas_in_sync(accelerator, model)
    shut_down(accelerator)


if __name__ == "__main__":
    run_then_release(main)
