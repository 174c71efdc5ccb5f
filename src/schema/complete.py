"""How a run's configuration is put together and checked, before anything is built or written.

Each config group (model, data, objective, optimizer, scheduler) is a `_target_` whose signature is its
schema (signature.py): the defaults, types, ranges and help of `model=gpt` live in `GPT.__init__`, not here
and not in YAML. The loop's own settings are `TrainerConfig` (trainer.py). `complete_config` fills every
default in and checks everything at once; `ValidateConfig`, a Hydra callback (src/launch/hydra_hooks.py), runs
it before Hydra creates the run directory, so a mistake never leaves an empty run dir behind.
"""

from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from src.errors import ConfigError
from src.schema.data_sizes import data_size_references
from src.schema.signature import check_values, chosen_option, complete, locate, schema_of
from src.schema.trainer import LRScaling, TrainerConfig

# Group -> the parameters train.py passes when it builds it (so the config must not).
GROUPS = {"model": (), "data": (), "objective": (), "optimizer": ("params", "model"), "scheduler": ("optimizer",)}


def base_config() -> DictConfig:
    """What every composition starts from: one node per group, open so that `model.n_layer=6` needs no `+`
    (unknown keys are caught by complete_config, which knows the target's parameters)."""
    cfg = OmegaConf.create({**{group: {} for group in GROUPS}, "trainer": {}, "resume": None})
    for group in (*GROUPS, "trainer"):
        OmegaConf.set_struct(cfg[group], False)
    return cfg


def complete_config(cfg: DictConfig, warnings: Optional[list[str]] = None) -> DictConfig:
    """The config with every default filled in from the signatures, or a ConfigError listing every problem.

    `${dataset:NAME}` references stay unresolved (the data is not built yet), but each must name a size the
    chosen data provides. Doubtful but legal settings are appended to `warnings` when given.
    """
    problems, completed, schemas = [], {}, {}
    data_cls = _target_class(cfg, "data", problems)
    provided = tuple(data_cls.provides()) if hasattr(data_cls, "provides") else None
    for group, supplied in GROUPS.items():
        target = OmegaConf.select(cfg, f"{group}._target_")
        if not target:
            problems.append(f"{group} has no _target_: choose an option ({group}=NAME) or set {group}._target_")
            continue
        try:
            schemas[group] = schema_of(target, skip=supplied)
        except ConfigError as error:
            problems += [f"{group}.{p}" for p in error.problems]
            continue
        if group == "optimizer":  # keys the template applies to any optimizer (src/optim/optimizers.py)
            schemas[group].params.update(schema_of(LRScaling).params)
        completed[group], found = complete(cfg[group], schemas[group], f"{group}.", supplied,
                                           data_sizes=provided or () if group == "model" else ())
        problems += found
    schemas["trainer"] = schema_of(TrainerConfig)
    completed["trainer"], found = complete(cfg.trainer, schemas["trainer"], "trainer.")
    problems += found or _length_of_run(cfg.trainer, completed["trainer"])
    _objective_monitor(cfg, completed["trainer"])
    if problems:
        raise ConfigError(problems)

    out = OmegaConf.create({**completed, "resume": cfg.get("resume")})
    if "hydra" in cfg:  # kept for the checks' messages (option names); train.py's cfg has none
        with_hydra = OmegaConf.create({"hydra": {"runtime": {"choices": dict(cfg.hydra.runtime.choices)}}})
        out = OmegaConf.merge(out, with_hydra)
    checked = out
    if out.trainer.max_steps is None:  # by epochs: the step count exists once the data is built; until then
        checked = out.copy()  # values that follow it (the schedule's length) are checked with a stand-in
        checked.trainer.max_steps = 1
    for group, schema in schemas.items():
        problems += check_values(checked, group, schema)
    if provided is not None:
        for key, name in data_size_references(out.model, "model"):
            if name not in provided:
                problems.append(f"{key}=${{dataset:{name}}}, but data={chosen_option(out, 'data')} ({out.data._target_}) "
                                f"provides only: {', '.join(provided) or 'no sizes'}")
    if not problems:  # cross-checks assume each value is of its type
        problems += _cross_checks(out, warnings if warnings is not None else [])
    if problems:
        raise ConfigError(problems)
    if "hydra" in out:
        out.pop("hydra")
    return out


def _length_of_run(given: DictConfig, trainer: dict) -> list[str]:
    """Exactly one of max_steps (which has a default) and max_epochs says how long a run is: max_epochs given
    without max_steps replaces the default."""
    steps, epochs = trainer["max_steps"], trainer["max_epochs"]
    if epochs is None:
        return [] if steps is not None else [
            "trainer.max_steps=null needs trainer.max_epochs: give one of them, the run's length"]
    if given.get("max_steps") is not None:
        return [f"trainer.max_steps={steps} and trainer.max_epochs={epochs}: give one of them (to train by "
                "epochs, add trainer.max_steps=null)"]
    trainer["max_steps"] = None  # train.py sets it once the data and the global batch are known
    return []


def _objective_monitor(cfg: DictConfig, trainer: dict) -> None:
    """An objective without eval/loss (objective=grpo) names the metric that picks its best checkpoint, unless
    trainer.monitor was given."""
    objective_cls = _target_class(cfg, "objective", [])
    default = getattr(objective_cls, "default_monitor", None)
    if default is not None and "monitor" not in cfg.trainer and "monitor_mode" not in cfg.trainer:
        trainer["monitor"], trainer["monitor_mode"] = default


def _target_class(cfg: DictConfig, group: str, problems: list[str]) -> Any:
    target = OmegaConf.select(cfg, f"{group}._target_")
    try:
        return locate(target) if target else None
    except ConfigError as error:
        problems += [f"{group}.{p}" for p in error.problems]
        return None


def _cross_checks(cfg: DictConfig, warnings: list[str]) -> list[str]:
    """Mistakes that only show between groups."""
    problems, trainer = [], cfg.trainer
    objective_cls = locate(cfg.objective._target_)
    metrics = [f"eval/{name}" for name in getattr(objective_cls, "metric_names", ("loss",))]
    scored_by_tasks = bool(trainer.eval_tasks) and str(trainer.monitor).startswith("eval_tasks/")  # checked there
    if trainer.monitor is not None and trainer.monitor not in metrics and not scored_by_tasks:
        problems.append(f"trainer.monitor={trainer.monitor} is not a metric objective={chosen_option(cfg, 'objective')} "
                        f"({cfg.objective._target_}) reports: choose one of {', '.join(metrics)}, or null")
    data_cls = locate(cfg.data._target_)
    if getattr(data_cls, "targets_are_inputs", False) and not getattr(objective_cls, "shifts_targets", False):
        problems.append(f"data={chosen_option(cfg, 'data')} gives targets equal to the inputs (Hugging Face's labels "
                        f"convention), which objective={chosen_option(cfg, 'objective')} does not shift: the model would "
                        "learn to copy its input. Use objective=causal_lm.")
    pairs, on_pairs = bool(cfg.data.get("preference")), getattr(objective_cls, "trains_on_pairs", False)
    if pairs != on_pairs:
        problems.append(f"data.preference={str(pairs).lower()} with objective={chosen_option(cfg, 'objective')}: "
                        + ("preference pairs train objective=dpo, simpo, orpo or reward" if pairs else
                           "this objective trains on preference pairs: data=jsonl, data=hf_dataset or data=shards "
                           "with data.preference=true"))
    prompts, on_prompts = getattr(data_cls, "gives_prompts", False), getattr(objective_cls, "trains_on_prompts", False)
    if prompts != on_prompts:
        problems.append(f"data={chosen_option(cfg, 'data')} with objective={chosen_option(cfg, 'objective')}: "
                        + ("data=prompts gives prompts without answers, which objective=grpo writes itself" if prompts
                           else "objective=grpo writes completions to prompts: use data=prompts"))
    scores = cfg.objective._target_ == "src.objectives.reward.Reward"
    if scores != (cfg.model.get("head", "lm") == "reward"):
        problems.append("objective=reward trains a model whose output layer gives one value per position: "
                        "model.head=reward" if scores else f"model.head=reward gives one value per position, which "
                        f"only objective=reward reads (objective={chosen_option(cfg, 'objective')} reads logits)")
    if scores and (trainer.sample_every or trainer.eval_tasks):
        problems.append(f"trainer.{'sample_every' if trainer.sample_every else 'eval_tasks'} with objective=reward: a "
                        "reward model scores text, it does not write it; set it to "
                        f"{'0' if trainer.sample_every else '[]'}")
    if cfg.optimizer.scale_lr != "none" and cfg.optimizer.reference_batch is None:
        problems.append(f"optimizer.scale_lr={cfg.optimizer.scale_lr} needs optimizer.reference_batch: the global batch "
                        "(samples per optimizer step) optimizer.lr was tuned for")
    if trainer.early_stopping_patience is not None:
        if trainer.monitor is None:
            problems.append("trainer.early_stopping_patience needs trainer.monitor (the metric to watch), not null")
        every = "eval_tasks_every" if scored_by_tasks else "eval_every"
        if trainer[every] == 0:
            problems.append(f"trainer.early_stopping_patience needs trainer.{every} > 0: with 0 the run evaluates "
                            "only at its end, so nothing could stop it early")
    if trainer.compile_mode != "default" and not trainer.compile:
        problems.append(f"trainer.compile_mode={trainer.compile_mode} needs trainer.compile=true: without it nothing "
                        "is compiled")
    for key in ("eval_every", "checkpoint_every"):
        if trainer.max_steps is not None and trainer[key] > trainer.max_steps:
            warnings.append(f"trainer.{key}={trainer[key]} > trainer.max_steps={trainer.max_steps}: only the end of "
                            f"the run will {'evaluate' if key == 'eval_every' else 'save a checkpoint'}")
    for first, last in trainer.skip_steps:
        if not 1 <= first <= last:
            problems.append(f"trainer.skip_steps: [{first}, {last}] is not a range of steps: each pair is [first, "
                            "last], the steps numbered as the logs number them, with 1 <= first <= last")
        elif trainer.max_steps is not None and first > trainer.max_steps:
            warnings.append(f"trainer.skip_steps: [{first}, {last}] starts after trainer.max_steps="
                            f"{trainer.max_steps}: it skips nothing in this run")
    warmup = OmegaConf.select(cfg, "scheduler.warmup_steps")
    if isinstance(warmup, int) and trainer.max_steps is not None and warmup >= trainer.max_steps:
        warnings.append(f"scheduler.warmup_steps={warmup} >= trainer.max_steps={trainer.max_steps}: the learning "
                        "rate never leaves its warm-up")
    return problems
