"""Evaluation whose metrics are exact across processes: every validation sample counted exactly once."""

import logging
from collections import defaultdict
from typing import Callable

import torch
from accelerate import Accelerator

from src.loop.batches import split_batch
from src.loop.forward import Forward

log = logging.getLogger("train")  # its lines are the training log's


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, accelerator: Accelerator, forward: Forward,
             progress: Callable[[str], None] = lambda doing: None) -> dict[str, float]:
    """Each metric the objective reports, averaged over the whole validation set with its own weights (samples
    or tokens), and how many samples that was. `progress` hears of every batch (the hang watch).

    Per-sample sums and weights go through `gather_for_metrics`, which drops the samples accelerate duplicated
    to even out the last batch across ranks (a per-batch mean would silently keep one rank's value there).
    """
    was_training = model.training
    model.eval()
    # Summed in float64 on the CPU: exact enough that 1 and N processes agree to ~1e-12, and MPS has no float64.
    sums, weights, samples = defaultdict(float), defaultdict(float), 0
    for i, batch in enumerate(loader):
        progress(f"evaluation batch {i + 1}")
        inputs, targets = split_batch(batch, forward.objective.target_key)
        per_sample = accelerator.gather_for_metrics(forward.metrics(model, inputs, targets))
        for name, (values, weight) in per_sample.items():
            sums[name] += values.cpu().double().sum().item()
            weights[name] += weight.cpu().double().sum().item()
        samples += len(next(iter(per_sample.values()))[0])
    model.train(was_training)
    # A metric with nothing to average over (e.g. every target ignored) is NaN, not a flattering 0.
    averages = {name: sums[name] / weights[name] if weights[name] else float("nan") for name in sums}
    return {**forward.objective.completed_metrics(averages), "samples": samples}


def evaluate_run(model: torch.nn.Module, ema, loader, accelerator: Accelerator, forward: Forward,
                 step: int, progress: Callable[[str], None] = lambda doing: None) -> dict[str, float]:
    """The run's evaluation at optimizer step `step`: the model's metrics as eval/*, with trainer.ema_decay its
    average's as eval_ema/*, logged to the trackers and the log."""
    metrics = {f"eval/{k}": v for k, v in evaluate(model, loader, accelerator, forward, progress).items()}
    texts = forward.objective.evaluation_texts()  # the model's, before the EMA's evaluation replaces them
    if texts and accelerator.is_main_process:  # TensorBoard only: the other trackers take numbers
        for tracker in accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.log(texts, step=step)
    if ema is not None:
        with accelerator.autocast():  # the prepared model's precision; the copy was not prepared
            ema_metrics = evaluate(ema.module, loader, accelerator, forward,
                                   lambda doing: progress(f"the EMA's {doing}"))
        metrics.update({f"eval_ema/{k}": v for k, v in ema_metrics.items() if k != "samples"})
        forward.objective.evaluation_texts()  # the average's: not shown
    accelerator.log(metrics, step=step)
    log.info("step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    return metrics


class Evaluation:
    """The run's evaluations: at every trainer.eval_every-th step and the last, and with trainer.eval_on_start
    one before the first step (logged at step 0: where the curves start, a pretrained model's baseline); with
    trainer.eval_tasks, the downstream tasks' scores at their own steps (src/loop/eval_tasks.py) join the
    metrics of the step. Their time is not step time (telemetry's "evaluation" phase)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, ema, loader, forward: Forward, trainer,
                 telemetry, tasks, progress: Callable[[str], None] = lambda doing: None):
        self.accelerator, self.model, self.ema, self.loader, self.forward = accelerator, model, ema, loader, forward
        self.every, self.max_steps, self.on_start_too = trainer.eval_every, trainer.max_steps, trainer.eval_on_start
        self.tasks = tasks  # EvalTasks: due at their own steps
        self.telemetry, self.progress = telemetry, progress  # progress: the hang watch hears of every batch
        self.last: dict[str, float] = {}  # the newest value of each metric (the run's summary)

    def due(self, step: int) -> bool:
        return self._validation_due(step) or self.tasks.due(step)

    def _validation_due(self, step: int) -> bool:
        return step >= self.max_steps or bool(self.every and step % self.every == 0)

    def before_training(self, step: int) -> None:
        """trainer.eval_on_start's evaluation, on a fresh run only."""
        if self.on_start_too and step == 0:
            self(0, on_start=True)

    def __call__(self, step: int, on_start: bool = False) -> dict[str, float]:
        metrics = {}
        with self.telemetry.phase("evaluation"):
            if on_start or self._validation_due(step):
                metrics.update(evaluate_run(self.model, self.ema, self.loader, self.accelerator, self.forward, step,
                                            self.progress))
            if self.tasks.due(step) or on_start and self.tasks.tasks:
                metrics.update(self.tasks(step))
        self.last.update(metrics)
        return metrics
