"""Train a model: build -> prepare -> (resume) -> loop -> save.

    accelerate launch train.py                          # defaults: char-level GPT on tiny Shakespeare
    accelerate launch train.py experiment=cifar10_resnet data.root=/data/cifar-10-batches-bin
    accelerate launch train.py model=hf_causal_lm data=jsonl objective=causal_lm   # transformers, padded documents
    accelerate launch --multi_gpu --num_processes 2 train.py trainer.max_steps=100   # CPU DDP
    accelerate launch train.py hydra.run.dir=outputs/my_run resume=auto             # continue a run

Each option's keys are its `_target_`'s signature (src/schema/signature.py); the loop's are TrainerConfig
(src/schema/trainer.py).
"""

import logging
import math
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import src.schema.hydra_hooks  # noqa: F401  (registers the base config and the run-dir timestamp with Hydra)
from src.checkpointing.export import export_model
from src.checkpointing.load import load_checkpoint, seed_this_ranks_stream
from src.checkpointing.save import Checkpointer
from src.faults.distributed_errors import lost_ranks_in_our_words
from src.faults.hang_watch import HangWatch
from src.faults.nonfinite import NonFiniteGuard, plain
from src.faults.preemption import PreemptionWatch, requeue_slurm_job
from src.launch.banner import describe_launch
from src.launch.checks import check_replicas_in_sync
from src.launch.shutdown import outlive_main, run_then_release, shut_down
from src.launch.slurm_sweep import in_submitit_slurm_job, launch_this_node
from src.loop.accumulation import accumulation_windows, global_target_count, loss_for_backward
from src.loop.batches import split_batch
from src.loop.early_stopping import EarlyStopping
from src.loop.ema import build_ema
from src.loop.evaluation import evaluate_run
from src.loop.forward import Forward
from src.loop.sampling import Sampler
from src.optim.optimizers import build_optimizer
from src.reporting.progress import Progress
from src.reporting.run_log import start_run_log, stop_run_log
from src.reporting.telemetry import Telemetry, process_start_time
from src.run import build_run
from src.schema.build import build
from src.schema.errors import told_to_the_launcher

log = logging.getLogger("train")


@hydra.main(config_path="config", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    # Which rank stopped, not gloo's traceback; and the launcher's closing table names our message, not a URL.
    with told_to_the_launcher(), lost_ranks_in_our_words(cfg.trainer.get("dist_timeout_s")):
        return train(cfg)


def train(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if in_submitit_slurm_job():  # hydra/launcher=submitit_slurm: this node starts its training processes
        return launch_this_node(run_dir)
    # Build: the config completed, resumed and resolved, then the Accelerator, data, model and objective it
    # names (src/run.py). Every decision is taken there; from here on the config is read-only.
    run = build_run(cfg, run_dir, HydraConfig.get().overrides.task)
    cfg, trainer, checkpoint = run.cfg, run.trainer, run.checkpoint
    accelerator, data, model, objective = run.accelerator, run.data, run.model, run.objective
    state = run.train_state()
    forward = Forward(objective, trainer.compile, trainer.compile_mode)  # with trainer.compile, one graph
    train_loader, val_loader = data.train_dataloader(), data.val_dataloader(trainer.eval_batches)
    optimizer = build_optimizer(cfg.optimizer, model, state.global_batch)
    scheduler = build(cfg.scheduler, optimizer, group="scheduler")

    # Prepare: device placement, DDP wrapping, autocast, data sharding.
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )
    outlive_main(accelerator, model)  # multi-process: no gloo teardown in a destructor (src/launch/shutdown.py)
    ema = build_ema(accelerator, model, trainer.ema_decay)  # registered for checkpointing: load_state restores it
    if checkpoint:
        load_checkpoint(accelerator, checkpoint, state, trainer.seed, restart_epoch=run.data_changed)
    else:  # the model was initialised alike on every rank; from here each rank draws its own dropout masks
        seed_this_ranks_stream(trainer.seed, state.step, accelerator.process_index)
    start_run_log(accelerator, cfg, run_dir, describe_launch(accelerator, cfg, run.launch, run_dir, model), state.step)
    export = lambda directory, module=model: export_model(accelerator, module, cfg.model, directory,  # noqa: E731
                                                          data.codec)
    checkpointer = Checkpointer(accelerator, run_dir, cfg, export, run.data_fingerprint)
    preemption = PreemptionWatch(accelerator.num_processes)  # SIGTERM, SIGUSR1/2, Ctrl-C: save, then stop
    guard = NonFiniteGuard(accelerator, optimizer, scheduler, ema, trainer.nonfinite, trainer.max_consecutive_skips,
                           run_dir)
    hang_watch = HangWatch(accelerator.process_index, trainer.hang_report_s, accelerator.num_processes)
    sampler = Sampler(accelerator, trainer, data.codec, model, cfg.model.get("block_size") or 0)
    early_stopping = EarlyStopping(trainer.monitor, trainer.monitor_mode, trainer.early_stopping_patience,
                                   trainer.early_stopping_min_delta)

    # Loop: one iteration per optimizer step, over a window of `accumulation` micro-batches whose loss is
    # normalised by the targets of the whole global batch (src/loop/accumulation.py).
    max_grad_norm = trainer.max_grad_norm or math.inf  # inf: measure the norm for logging, clip nothing
    telemetry = Telemetry(accelerator, model, state.global_batch, trainer.mixed_precision, trainer.peak_tflops,
                          process_start_time(), trainer.profile, run_dir)
    progress = Progress(trainer.max_steps, state.step, accelerator.is_main_process, trainer.progress_interval_s)
    step_loss, metrics, stop_reason = None, {}, None
    model.train()
    windows = accumulation_windows(accelerator, train_loader, state, trainer.max_steps,
                                   trainer.gradient_accumulation_steps, run.epoch_steps)
    if early_stopping.already_stopped(state):  # resumed from the checkpoint of an early stop
        log.info("%s at step %d: nothing left to train", early_stopping.reason(state), state.step)
        windows = []
    elif trainer.eval_on_start and state.step == 0:  # where the eval curves start (a pretrained model's metrics)
        with telemetry.phase("evaluation"):
            metrics = evaluate_run(model, ema, val_loader, accelerator, forward, step=0)
    for window in telemetry.timed_windows(windows):
        hang_watch.beat(state.step)
        window = [split_batch(batch, objective.target_key) for batch in window]  # (inputs, targets) pairs
        step_targets = global_target_count(accelerator, objective, [targets for _, targets in window])
        step_loss_sum = 0.0
        for inputs, targets in window:
            if state.step == 0:
                objective.check_batch(inputs, targets)
            with accelerator.accumulate(model):
                loss_sum = forward.loss_sum(model, inputs, targets)
                accelerator.backward(loss_for_backward(accelerator, loss_sum, step_targets))
                step_loss_sum += loss_sum.detach()
                apply_step = True
                if accelerator.sync_gradients:
                    grad_norm = plain(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm))
                    # A bad step is skipped on the device (src/faults/nonfinite.py); the host reads the verdict later.
                    apply_step = guard.step_is_finite(state.step + 1, step_loss_sum, grad_norm)
                if apply_step:
                    optimizer.step()  # a no-op until the accumulation window is complete
                optimizer.zero_grad(set_to_none=True)
        if apply_step and not accelerator.optimizer_step_was_skipped:  # nor by fp16's GradScaler
            scheduler.step()
            if ema is not None:
                ema.update_parameters(accelerator.unwrap_model(model))
        state.step += 1
        telemetry.step_finished(step_targets)

        # Steps that log, evaluate or save read what the device decided: until then the host never waits for it.
        logging_step = state.step % trainer.log_every == 0
        done = state.step >= trainer.max_steps
        evaluating = done or (trainer.eval_every and state.step % trainer.eval_every == 0)
        signalled = preemption.step_finished()  # the same on every rank
        if logging_step or evaluating or signalled or checkpointer.saves_at(state.step):
            guard.settle()  # stops at a non-finite step before anything of it is logged or saved; counts skips
        logged = {}
        if logging_step:
            step_loss = (accelerator.reduce(step_loss_sum, "sum") / step_targets.clamp(min=1)).item()
            logged = {"train/loss": step_loss, "train/lr": scheduler.get_last_lr()[0],
                      "train/grad_norm": grad_norm.item(), "train/skipped_steps": guard.skipped, **telemetry.scalars()}
            if accelerator.scaler is not None:  # fp16: a falling scale marks the steps the GradScaler skipped
                logged["train/loss_scale"] = accelerator.scaler.get_scale()
            accelerator.log(logged, step=state.step)
        progress.update(state.step, logged.get("train/loss"), logged.get("train/tokens_per_second"))
        step_metrics = None
        if evaluating:
            with telemetry.phase("evaluation"):
                metrics = step_metrics = evaluate_run(model, ema, val_loader, accelerator, forward, state.step)
        sampler.step_finished(state.step, model)  # trainer.sample_every: text from rank 0
        stop_reason = None
        if not done and early_stopping.should_stop(step_metrics, state):
            stop_reason = early_stopping.reason(state)
        elif not done and signalled:
            stop_reason = "preempted"
            log.warning("stopping at step %d on %s: saving a checkpoint", state.step, preemption.describe())
        stopping = stop_reason is not None
        hang_watch.beat(state.step)
        with telemetry.phase("checkpointing"):
            checkpointer.step_finished(state, step_metrics, stopping)  # it decides: periodic, best, preemption, final
        if stopping:
            break
    progress.close()
    preemption.close()
    if early_stopping.already_stopped(state):
        stop_reason = early_stopping.reason(state)
        log.info("%s: stopped at step %d of %d", stop_reason, state.step, trainer.max_steps)
    preempted = stop_reason == "preempted"
    best = {"metric": trainer.monitor, "value": state.best_metric, "step": state.best_step}
    telemetry.summary(run_dir, stop_reason or "finished", state.step, accelerator.num_processes,
                      trainer.mixed_precision, metrics, best, step_loss)
    if preempted:  # resume later from the checkpoint just saved
        if not requeue_slurm_job(accelerator, preemption) and accelerator.is_main_process:
            log.warning("to continue: the same command with resume=auto hydra.run.dir=%s", run_dir)
        shut_down(accelerator)
        sys.exit(preemption.exit_code())

    # Save.
    export(run_dir / "model")
    log.info("exported the final model to %s", run_dir / "model")
    if ema is not None:
        export(run_dir / "model_ema", ema.module)
        log.info("exported the EMA of the weights to %s", run_dir / "model_ema")
    check_replicas_in_sync(accelerator, model)
    hang_watch.stop()
    stop_run_log()
    shut_down(accelerator)
    # What a Hydra sweeper optimises (train.py -m hparams_search=...): the best trainer.monitor value.
    return state.best_metric


if __name__ == "__main__":
    run_then_release(main)
