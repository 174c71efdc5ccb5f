"""Train a model: build -> prepare -> (resume) -> loop -> save.

    accelerate launch train.py                          # defaults: char-level GPT on tiny Shakespeare
    accelerate launch train.py experiment=cifar10_resnet data.root=/data/cifar-10-batches-bin
    accelerate launch train.py model=hf_causal_lm data=jsonl objective=causal_lm   # transformers, padded documents
    accelerate launch --multi_gpu --num_processes 2 train.py trainer.max_steps=100   # CPU DDP
    accelerate launch train.py hydra.run.dir=outputs/my_run resume=auto             # continue a run

Where things are: the model, data and objective are built from the config in src/run.py (your own is a file plus
a `_target_`); one optimizer step is src/loop/step.py; checkpoints, resume and exports are
src/checkpointing/checkpointer.py. Each option's keys are its `_target_`'s signature (src/schema/signature.py);
the loop's are TrainerConfig (src/schema/trainer.py).
"""

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import src.launch.hydra_hooks  # noqa: F401  (registers the base config and the run-dir timestamp with Hydra)
from src.checkpointing.checkpointer import Checkpointer
from src.errors import told_to_the_launcher
from src.faults.distributed_errors import lost_ranks_in_our_words
from src.faults.hang_watch import HangWatch
from src.faults.preemption import PreemptionWatch
from src.launch.banner import describe_launch
from src.launch.checks import check_replicas_in_sync
from src.launch.shutdown import outlive_main, run_then_release, shut_down, stop_preempted
from src.launch.slurm_sweep import in_submitit_slurm_job, launch_this_node
from src.loop.accumulation import accumulation_windows
from src.loop.ema import build_ema
from src.loop.eval_tasks import EvalTasks
from src.loop.evaluation import Evaluation
from src.loop.sampling import Sampler
from src.loop.skip_steps import SkipSteps
from src.loop.spikes import SpikeWatch
from src.loop.step import TrainStep
from src.loop.stopping import FINISHED, PREEMPTED, StopDecision
from src.loop.stream_position import StreamPosition
from src.optim.optimizers import build_optimizer
from src.reporting.progress import Progress
from src.reporting.run_log import start_run_log, stop_run_log
from src.reporting.telemetry import Telemetry
from src.run import build_run
from src.schema.build import build

log = logging.getLogger("train")


@hydra.main(config_path="config", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    # Which rank stopped, not gloo's traceback; and the launcher's closing table names our message, not a URL.
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if in_submitit_slurm_job():  # hydra/launcher=submitit_slurm: this node starts its training processes
        return launch_this_node(run_dir)
    with told_to_the_launcher(), lost_ranks_in_our_words(cfg.trainer.get("dist_timeout_s"),
                                                         cfg.trainer.get("hang_report_s")):
        return train(cfg, run_dir)


def train(cfg: DictConfig, run_dir: Path) -> float | None:
    # Build: the config completed, resumed and resolved, then the Accelerator, data, model and objective it
    # names (src/run.py). Every decision is taken there; from here on the config is read-only.
    run = build_run(cfg, run_dir, HydraConfig.get().overrides.task)
    cfg, trainer, accelerator = run.cfg, run.trainer, run.accelerator
    state = run.train_state()
    train_loader, val_loader = run.data.train_dataloader(), run.data.val_dataloader(trainer.eval_batches)
    optimizer = build_optimizer(cfg.optimizer, run.model, state.global_batch)
    scheduler = build(cfg.scheduler, optimizer, group="scheduler")

    # Prepare: device placement, DDP/FSDP wrapping, autocast, data sharding; then the resume, if this is one.
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        run.model, optimizer, train_loader, val_loader, scheduler
    )
    run.read_pretrained_slices(model)  # FSDP's sharded start of a pretrained folder: each rank reads its shard's part
    run.objective.start(accelerator, model, run.data, run_dir, run.checkpoint)  # DPO: its reference model
    outlive_main(accelerator, model)  # multi-process: no gloo teardown in a destructor (src/launch/shutdown.py)
    ema = build_ema(accelerator, model, trainer.ema_decay)
    # Reports a rank where nothing progressed for trainer.hang_report_s; long work between steps reports progress.
    hang_watch = HangWatch(accelerator.process_index, trainer.hang_report_s, accelerator.num_processes)
    position = StreamPosition(accelerator, train_loader)  # a stream's place in it, kept by its loader
    checkpointer = Checkpointer.for_run(run, model, ema, hang_watch.alive, position)
    checkpointer.load(state)  # weights, optimizer, schedule, EMA, every rank's random streams, data position
    start_run_log(accelerator, cfg, run_dir, describe_launch(accelerator, cfg, run.launch, run_dir, model), state.step)

    # Loop: one optimizer step per window of micro-batches, then what follows it: log, evaluate, sample, decide
    # whether to stop, let the checkpointer save.
    train_step = TrainStep(accelerator, model, optimizer, scheduler, ema, run.objective, trainer, run_dir)
    telemetry = Telemetry(accelerator, model, state.global_batch, trainer, run_dir)
    tasks = EvalTasks(accelerator, model, run.data.codec, trainer, cfg.model.get("block_size"), hang_watch.alive)
    evaluate = Evaluation(accelerator, model, ema, val_loader, train_step.forward, trainer, telemetry, tasks,
                          hang_watch.alive)
    sampler = Sampler(accelerator, trainer, run.data.codec, model, cfg.model.get("block_size") or 0, hang_watch.alive)
    preemption = PreemptionWatch(accelerator.num_processes)  # SIGTERM, SIGUSR1/2, Ctrl-C: save, then stop
    stop = StopDecision(trainer, preemption)
    skip = SkipSteps(trainer.skip_steps, accelerator.is_main_process)
    spikes = SpikeWatch(trainer.spike_factor if run.objective.loss_spikes_matter else None, run_dir,
                        trainer.log_every, accelerator.is_main_process)
    progress = Progress(accelerator, trainer.max_steps, state.step, trainer.progress_interval_s)
    model.train()
    evaluate.before_training(state.step)  # trainer.eval_on_start: a fresh run's metrics at step 0
    stop_reason = stop.before_training(state)  # resumed from an early stop: nothing left to train
    windows = accumulation_windows(accelerator, train_loader, state, trainer.max_steps,
                                   trainer.gradient_accumulation_steps, run.epoch_steps, position, run.data.read_ahead)
    for window in telemetry.timed_windows([] if stop_reason else windows):
        hang_watch.beat(state.step)  # armed by the first: a first step that never ends is reported too
        dropped = skip.covers(state.step + 1)  # trainer.skip_steps: past a loss spike's data
        if dropped:
            train_step.pass_over()  # the window read, nothing trained, the LR schedule moves on
            telemetry.step_dropped()
        else:
            result = train_step(window, state.step)
            telemetry.step_finished(result.tokens)
        state.step += 1
        hang_watch.beat(state.step)
        # Steps that log, evaluate or save read what the device decided: until then the host never waits for it.
        logging_step, evaluating = not dropped and state.step % trainer.log_every == 0, evaluate.due(state.step)
        signalled = preemption.step_finished()  # the same on every rank
        if logging_step or evaluating or signalled or checkpointer.saves_at(state.step):
            train_step.settle()  # stops at a non-finite step before anything of it is logged or saved
        scalars = {**train_step.scalars(result), **telemetry.scalars()} if logging_step else {}
        progress.report(state.step, scalars)
        spikes.logged(state.step, scalars)  # trainer.spike_factor: a loss spike, and the rewind that skips its data
        step_metrics = evaluate(state.step) if evaluating else None
        sampler.step_finished(state.step, model)  # trainer.sample_every: text from rank 0
        stop_reason = stop.after_step(state, step_metrics, signalled)
        hang_watch.beat(state.step)
        with telemetry.phase("checkpointing"):  # it decides: periodic, best, the stop's, final
            checkpointer.step_finished(state, step_metrics, stopping=stop_reason is not None)
        if stop_reason:
            break
    windows.close()  # data.read_ahead: its reading thread stops here, not during the export
    progress.close()
    preemption.close()
    telemetry.summary(run_dir, stop_reason or FINISHED, state, {**train_step.reported, **evaluate.last},
                      progress.loss, run.data.consumed(train_loader, state, run.epoch_samples))
    if stop_reason == PREEMPTED:  # resumed later from the checkpoint just saved
        stop_preempted(accelerator, preemption, run_dir)

    # Save: the final model (and its EMA) as plain files.
    checkpointer.export_final()
    check_replicas_in_sync(accelerator, model)
    hang_watch.stop()
    stop_run_log()
    shut_down(accelerator)
    # What a Hydra sweeper optimises (train.py -m hparams_search=...): the best trainer.monitor value.
    return state.best_metric


if __name__ == "__main__":
    run_then_release(main)
