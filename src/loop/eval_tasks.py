"""Downstream evaluation during training (trainer.eval_tasks): lm-evaluation-harness tasks scored on the live
model every trainer.eval_tasks_every steps and at the last, each score logged as eval_tasks/<task>/<metric> to
TensorBoard and the trackers; trainer.monitor may name one (the best checkpoint, early stopping).

Offline by design: a task given as the path of its YAML file over a local data file needs no network
(data/eval_tasks/shakespeare_cloze.yaml); a task name the harness knows reads its data from the hub.

Every rank scores its share of the documents (the harness's own sharding, src/loop/harness_model.py); rank 0
aggregates, and every rank receives the scores, so all take the same monitor decisions. The harness seeds the
global random generators: the training's random state is put back exactly as it was, so a run with tasks trains
the weights of a run without them.
"""

import contextlib
import importlib.util
import logging
import random
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from src.data.tokenizer import Codec
from src.errors import UsageError

log = logging.getLogger("train")
HARNESS = "lm_eval==0.4.13"  # requirements-extras.txt
PREFIX = "eval_tasks/"


class EvalTasks:
    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, codec: Optional[Codec], trainer,
                 block_size: Optional[int], progress: Callable[[str], None] = lambda doing: None):
        self.accelerator, self.model, self.tasks = accelerator, model, list(trainer.eval_tasks)
        self.every, self.max_steps, self.limit = trainer.eval_tasks_every, trainer.max_steps, trainer.eval_tasks_limit
        if not self.tasks:
            return
        if importlib.util.find_spec("lm_eval") is None:
            raise UsageError(f"trainer.eval_tasks needs lm-evaluation-harness: pip install {HARNESS} (it is in "
                             "requirements-extras.txt), or trainer.eval_tasks=[]")
        if codec is None:
            raise UsageError("trainer.eval_tasks needs text data whose tokenizer can encode the tasks' text "
                             "(data=text, jsonl, hf_dataset); this data option has no text")
        sharded = accelerator.distributed_type.value == "FSDP"
        if accelerator.distributed_type.value == "DEEPSPEED":
            raise UsageError("trainer.eval_tasks does not run under DeepSpeed: score the export instead, "
                             "lm_eval --model hf --model_args pretrained=RUN_DIR/model")
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        max_length = block_size or getattr(getattr(unwrapped, "config", None), "max_position_embeddings", None)
        if not max_length:
            raise UsageError("trainer.eval_tasks: the model's length is unknown (no model.block_size, no "
                             "config.max_position_embeddings)")
        from lm_eval.tasks import TaskManager

        from src.loop.harness_model import LiveModel

        logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task chatter, at every evaluation
        # Indexing the harness's own few thousand tasks takes seconds: only where a task is named, not a file.
        self.manager = TaskManager(include_defaults=not all(_is_file(task) for task in self.tasks))
        loaded = self._load()
        if sharded:
            generating = [name for name, task in loaded.items() if task.OUTPUT_TYPE == "generate_until"]
            if generating:
                raise UsageError(f"trainer.eval_tasks: {', '.join(generating)} generate text, which needs whole "
                                 "weights; under FSDP only scoring tasks (multiple_choice, loglikelihood) run "
                                 "during training: score the export afterwards instead, lm_eval --model hf "
                                 "--model_args pretrained=RUN_DIR/model")
        self._check_monitor(trainer.monitor, loaded)
        # DDP: the module itself (no collective in a forward); FSDP: the sharded model, every rank in step.
        self.lm = LiveModel(accelerator, model if sharded else unwrapped, sharded, codec, int(max_length),
                            trainer.eval_tasks_batch_size, progress)

    def due(self, step: int) -> bool:
        return bool(self.tasks) and (step >= self.max_steps or bool(self.every and step % self.every == 0))

    def __call__(self, step: int) -> dict[str, float]:
        """Every rank: the tasks' scores at optimizer step `step`, logged."""
        from lm_eval import simple_evaluate

        was_training = self.model.training
        self.model.eval()
        try:
            with _random_state_kept(self.accelerator.device), _without_the_harness_bar():
                results = simple_evaluate(model=self.lm, tasks=self.tasks, task_manager=self.manager,
                                          limit=self.limit, bootstrap_iters=0, log_samples=False)
        finally:
            self.model.train(was_training)
        scores = _scores(results) if self.accelerator.is_main_process else None
        scores = broadcast_object_list([scores])[0] if self.accelerator.num_processes > 1 else scores
        self.accelerator.log(scores, step=step)
        log.info("step %d: %s", step, ", ".join(f"{k}={v:.4f}" for k, v in scores.items()))
        return scores

    def _load(self) -> dict:
        """The tasks as the harness builds them: a missing file or an unknown name is refused now."""
        for task in self.tasks:
            if _is_file(task) and not Path(task).is_file():
                raise UsageError(f"trainer.eval_tasks: {task}: no such file (a task's YAML, relative to the "
                                 "directory train.py is launched from)")
        try:
            return self.manager.load(self.tasks)["tasks"]
        except (KeyError, ValueError, FileNotFoundError) as error:
            raise UsageError(f"trainer.eval_tasks={self.tasks}: the harness cannot build them: {error}. Give a "
                             "task's YAML file (data/eval_tasks/shakespeare_cloze.yaml is one) or a task name "
                             "lm_eval --tasks list shows") from None

    def _check_monitor(self, monitor: Optional[str], loaded: dict) -> None:
        if not monitor or not monitor.startswith(PREFIX):
            return
        named = {f"{PREFIX}{name}/{metric}" for name, task in loaded.items() for metric in _metric_names(task)}
        if monitor not in named:
            raise UsageError(f"trainer.monitor={monitor} is not a score trainer.eval_tasks reports: choose one of "
                             f"{', '.join(sorted(named))}, or a metric of the objective (eval/loss)")


def _is_file(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


def _metric_names(task) -> list[str]:
    """How a task's metrics are logged: `acc` for the unfiltered one, `exact_match_strict-match` for a filter's."""
    metrics = [entry["metric"] for entry in task.config.metric_list or []]
    filters = [entry["name"] for entry in task.config.filter_list or []] or ["none"]
    return [metric if name == "none" else f"{metric}_{name}" for metric in metrics for name in filters]


def _scores(results: dict) -> dict[str, float]:
    """The harness's results ('acc,none': 0.31, 'acc_stderr,none': ...) as eval_tasks/<task>/<metric>."""
    scores = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, name = key.split(",", 1)
            scores[f"{PREFIX}{task}/{metric if name == 'none' else f'{metric}_{name}'}"] = float(value)
    return scores


@contextlib.contextmanager
def _without_the_harness_bar():
    """The harness draws a progress bar into the training's output as it builds each task's requests, at every
    scoring, and has no switch for it (Task.build_all_requests): its module's tqdm is a disabled one meanwhile."""
    import functools

    import lm_eval.api.task as harness_task

    drawn = harness_task.tqdm
    harness_task.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        harness_task.tqdm = drawn


@contextlib.contextmanager
def _random_state_kept(device: torch.device):
    """Python's, NumPy's and torch's global generators as they were (the harness seeds them all)."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
