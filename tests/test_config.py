"""The configuration is the user's interface: every option composes, defaults live in one place, and mistakes
stop before any run directory exists."""

import inspect
import re
from typing import Optional

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import src.launch.hydra_hooks  # noqa: F401  (registers the base config and resolvers)
from src.errors import ConfigError
from src.optim.optimizers import build_optimizer
from src.schema.build import build
from src.schema.complete import complete_config
from src.schema.signature import chosen_option, locate, schema_of
from src.schema.trainer import TrainerConfig
from tests.conftest import QUIET, ROOT, TINY_GPT, named, refused, run

CONFIG_DIR = ROOT / "config"
GROUPS = ("model", "data", "objective", "optimizer", "scheduler")


def options(group: str) -> list[str]:
    found = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
    assert found, f"config/{group}/ has no options: a test looping over them would check nothing"
    return found


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


# Options that need a partner or a value to make a working run.
PARTNERS = {
    "data=tokens": ["data.path=x.bin", "data.vocab_size=256"],
    "data=shards": ["data.path=shards"],
    "data=stream": ["data.path=corpus.jsonl"],
    "model=resnet": ["data=cifar10"],
    "data=cifar10": ["model=resnet"],
    "data=jsonl": ["objective=causal_lm"],
    "data=hf_dataset": ["objective=causal_lm", "data.path=corpus.parquet"],
    "data=mixture": ["objective=causal_lm", "data.sources=[{path: a.parquet, weight: 1}]"],
    "experiment=owt_tokens": ["data.path=train.bin"],
    **{f"objective={name}": ["data=jsonl", "data.preference=true"] for name in ("dpo", "simpo", "orpo")},
    "objective=reward": ["data=jsonl", "data.preference=true", "model.head=reward"],
    "objective=grpo": ["data=prompts"],
    "data=prompts": ["objective=grpo"],
    "objective=distill": ["objective.teacher=outputs/teacher/model"],
    "objective=distill_causal_lm": ["data=jsonl", "objective.teacher=outputs/teacher/model"],
}


@pytest.mark.parametrize(
    "override",
    [f"{group}={name}" for group in GROUPS for name in options(group)]
    + [f"experiment={name}" for name in options("experiment")] + [f"debug={name}" for name in options("debug")],
)
def test_every_config_option_composes_completes_and_passes_its_checks(override):
    cfg = complete_config(compose_train([override] + PARTNERS.get(override, [])))
    assert cfg.trainer.max_steps >= 1 and cfg.model._target_ and cfg.objective._target_


def test_optimizer_and_scheduler_options_build_with_what_train_py_passes():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 2))  # a hidden matrix, for muon
    for opt_name in options("optimizer"):
        for sched_name in options("scheduler"):
            cfg = complete_config(compose_train([f"optimizer={opt_name}", f"scheduler={sched_name}"]))
            optimizer = build_optimizer(cfg.optimizer, model, global_batch=32)
            scheduler = build(cfg.scheduler, optimizer, group="scheduler")
            optimizer.step()
            scheduler.step()


def test_no_option_file_restates_a_default_of_its_target():
    """One home per default: an option YAML states only its _target_, wiring (interpolations) and values its
    target has no default for. A debug preset states only loop settings that differ from TrainerConfig's (an
    experiment is a whole recipe, stated as its source states it: nanoGPT's flags, say)."""
    restated = []
    for group in GROUPS:
        for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
            node = yaml.safe_load(path.read_text())
            params = schema_of(node["_target_"]).params
            for key, value in node.items():
                interpolation = isinstance(value, str) and value.startswith("${")
                if key in params and not params[key].mandatory and not interpolation:
                    restated.append(f"{path.relative_to(ROOT)}: {key}={value} (default {params[key].default!r})")
    defaults = {name: p.default for name, p in schema_of(TrainerConfig).params.items()}
    for name in options("debug"):
        path = CONFIG_DIR / "debug" / f"{name}.yaml"
        for key, value in yaml.safe_load(path.read_text())["trainer"].items():
            if defaults.get(key) == value:
                restated.append(f"{path.relative_to(ROOT)}: {key}={value} equals TrainerConfig's default")
    assert not restated, "\n".join(restated)


def test_the_composed_defaults_are_the_signatures_defaults():
    cfg = complete_config(compose_train([]))
    gpt = inspect.signature(locate(cfg.model._target_)).parameters
    for key in ("n_layer", "n_embd", "dropout"):
        assert cfg.model[key] == gpt[key].default
    assert cfg.trainer.eval_every == TrainerConfig.eval_every and cfg.trainer.monitor == TrainerConfig.monitor


def test_a_model_that_accepts_a_data_size_gets_it_and_one_that_does_not_is_not_given_it():
    cfg = compose_train(["model=resnet", "data=cifar10"])
    del cfg.model["num_classes"]  # as a user's YAML that names only its _target_
    wired = complete_config(cfg)
    assert OmegaConf.to_container(wired.model)["num_classes"] == "${dataset:num_classes}"
    cfg = compose_train(["model._target_=torch.nn.ReLU", "data.block_size=8"])
    del cfg.model["vocab_size"]
    plain = complete_config(cfg)
    assert OmegaConf.to_container(plain.model) == {"_target_": "torch.nn.ReLU", "inplace": False}


def test_a_data_size_is_resolved_in_nested_model_config_and_saved_resolved():
    from src.schema.data_sizes import resolve_data_sizes

    cfg = complete_config(compose_train(["model=hf_causal_lm"]))
    resolved = resolve_data_sizes(cfg, {"vocab_size": 65})
    assert resolved.model.config.vocab_size == 65 and resolved.model.config.n_positions == 64
    assert "${" not in OmegaConf.to_yaml(resolved)
    with pytest.raises(ConfigError) as error:
        resolve_data_sizes(cfg, {"num_classes": 10})
    named(str(error.value), "model.config.vocab_size=${dataset:vocab_size}", "num_classes")


def test_accelerate_launch_configs_cover_cpu_ddp_gpus_multi_node_and_fsdp_and_leave_precision_to_the_run():
    configs = {p.stem: OmegaConf.load(p) for p in (CONFIG_DIR / "accelerate").glob("*.yaml")}
    assert configs["cpu_ddp"].distributed_type == "MULTI_GPU"  # what makes the launcher start N workers without CUDA
    assert {"single_gpu", "multi_gpu", "multi_node", "fsdp"} <= configs.keys()
    assert configs["fsdp"].distributed_type == "FSDP"
    assert not any("mixed_precision" in c for c in configs.values())  # else it would contradict trainer.*


REFUSALS = [  # the overrides, and what the refusal names: the key, the value, what is allowed or suggested
        (["trainer.max_stepz=5"], ("trainer.max_stepz", "src.schema.trainer.TrainerConfig", "trainer.max_steps?")),
        (["trainer.max_steps=many"], ("trainer.max_steps=many", "integer")),
        (["data.level=word"], ("data.level=word", "[char, byte]")),
        (["trainer.mixed_precision=fp8"], ("trainer.mixed_precision=fp8", "[no, fp16, bf16, auto]")),
        (["optimizer.lr=0"], ("optimizer.lr=0", "> 0")),
        (["optimizer.lr=-1e-3"], ("optimizer.lr=-0.001", "> 0")),
        (["data.batch_size=0"], ("data.batch_size=0", ">= 1")),
        (["trainer.gradient_accumulation_steps=0"], ("trainer.gradient_accumulation_steps=0", ">= 1")),
        (["model.n_layr=3"], ("model.n_layr", "src.models.gpt.GPT", "model.n_layer?")),
        (["+objective.foo=1"], ("objective.foo", "src.objectives.classification.CrossEntropy")),
        (["optimizer.betas=[0.9]"], ("optimizer.betas=[0.9]", "2 values")),
        (["trainer.skip_steps=[1]"], ("trainer.skip_steps=[1]", "expected a list, got 1", "[[1041, 1100]]")),
        (["model._target_=src.models.nope.Model"], ("model._target_=src.models.nope.Model", "no such module")),
        # item 9's sharp edges
        (["data=tokens", "data.path=x.bin"], ("data.vocab_size", "data.vocab_size=VALUE")),
        (["model=hf_causal_lm", "~model.block_size", "model.config.n_positions=64"], ("model.block_size",)),
        (["model._target_=torch.nn.Identity"], ("data.block_size=${model.block_size}", "torch.nn.Identity",
                                                "data.block_size=VALUE")),
        (["model=resnet"], ("model.num_classes=${dataset:num_classes}", "data=text", "vocab_size")),
        (["objective=mse", "trainer.monitor=eval/accuracy"], ("trainer.monitor=eval/accuracy", "objective=mse",
                                                              "eval/loss")),
        (["data=jsonl"], ("data=jsonl", "objective=cross_entropy", "objective=causal_lm")),
        (["trainer.compile_mode=reduce-overhead"], ("trainer.compile_mode=reduce-overhead",
                                                    "[default, max-autotune-no-cudagraphs]")),
        (["trainer.compile_mode=max-autotune-no-cudagraphs"], ("trainer.compile_mode=max-autotune-no-cudagraphs",
                                                              "trainer.compile=true")),
]


@pytest.mark.parametrize("overrides, names", REFUSALS)
def test_bad_value_is_refused_naming_the_key_and_what_is_allowed(overrides, names):
    """The checks train.py's start-up callback runs (in-process here: each real launch costs seconds)."""
    with pytest.raises(ConfigError) as error:
        complete_config(compose_train(overrides))
    named(str(error.value), *names)


def suggestion_typed(overrides: list[str], message: str) -> Optional[list[str]]:
    """The overrides a user types after reading the refusal of `overrides`: the key it suggests ("did you mean
    KEY?"), the first of the values it allows ("expected one of [A, B]", "choose one of A, B"), or the setting it
    names ("Use KEY=VALUE", "needs KEY=VALUE"), replacing the last override where the key is the same; None where
    the message suggests nothing."""
    key, value = overrides[-1].lstrip("+~").split("=", 1)
    meant = re.search(r"did you mean ([\w.]+)\?", message)
    allowed = re.search(rf"{re.escape(key)}=\S+ (?:expected|.*choose) one of \[?([^,\]\s]+)", message)
    setting = re.search(r"(?:[Uu]se|needs) ([\w.]+)=([\w\-]+)", message)
    if meant:
        return [*overrides[:-1], f"{meant.group(1)}={value}"]
    if allowed:
        return [*overrides[:-1], f"{key}={allowed.group(1)}"]
    if setting:
        kept = overrides[:-1] if setting.group(1) == key else overrides
        return [*kept, f"{setting.group(1)}={setting.group(2)}"]
    return None


SUGGESTING = ["trainer.max_stepz=5", "data.level=word", "trainer.mixed_precision=fp8", "model.n_layr=3",
              "trainer.monitor=eval/accuracy", "data=jsonl", "trainer.compile_mode=reduce-overhead",
              "trainer.compile_mode=max-autotune-no-cudagraphs"]


@pytest.mark.parametrize("overrides", [case[0] for case in REFUSALS if case[0][-1] in SUGGESTING])
def test_a_refusal_that_suggests_a_key_or_a_value_is_accepted_when_it_is_typed(overrides):
    with pytest.raises(ConfigError) as error:
        complete_config(compose_train(overrides))
    typed = suggestion_typed(overrides, str(error.value))
    assert typed is not None, str(error.value)
    composed = compose_train(typed)
    cfg = complete_config(composed.copy())  # accepted
    key, value = typed[-1].split("=", 1)
    chosen = OmegaConf.select(cfg, key) if "." in key else chosen_option(composed, key)
    assert str(chosen).lower() == value  # as typed (true is True)


@pytest.mark.parametrize("overrides, names", [  # one check within a group, one across groups
    (["trainer.max_stepz=5"], ["trainer.max_stepz", "trainer.max_steps?"]),
    (["model=resnet"], ["model.num_classes", "data=text", "vocab_size"]),
])
def test_a_bad_value_stops_a_real_launch_before_its_run_dir_exists(tmp_path, overrides, names):
    run_dir = tmp_path / "run"
    refused(run([*overrides, f"hydra.run.dir={run_dir}"], check=False, timeout=60), *names)
    assert not run_dir.exists()


def test_warmup_longer_than_the_run_warns_naming_both_keys():
    warnings = []
    complete_config(compose_train(["trainer.max_steps=2", "scheduler.warmup_steps=5"]), warnings)
    (warning,) = [w for w in warnings if "scheduler.warmup_steps" in w]
    named(warning, "scheduler.warmup_steps=5", "trainer.max_steps=2")


def test_a_config_warning_is_printed_once_however_many_processes_check_the_config(tmp_path):
    proc = run([*TINY_GPT, *QUIET, "trainer.max_steps=2", "data.batch_size=4", "scheduler.warmup_steps=5",
                f"hydra.run.dir={tmp_path / 'run'}"], nproc=2)
    assert proc.stdout.count("scheduler.warmup_steps=5 >=") == 1, proc.stdout  # not in the command row


def test_a_mistake_found_while_building_names_it_and_leaves_no_run_dir(tmp_path):
    proc = run(["data.path=no/such/file.txt", f"hydra.run.dir={tmp_path / 'run'}"], check=False, timeout=60)
    refused(proc, "data.path='no/such/file.txt'")
    assert not (tmp_path / "run").exists()


def test_fp16_without_cuda_is_refused_before_the_run_starts(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where fp16 is valid")
    proc = run(["trainer.mixed_precision=fp16", f"hydra.run.dir={tmp_path / 'run'}"], check=False, timeout=60)
    refused(proc, "trainer.mixed_precision", "fp16", "bf16")  # the key, the value, what to use instead (bf16 trains
    # on CPU: tests/test_training.py)
    assert not (tmp_path / "run").exists()


def test_the_readme_trainer_reference_is_the_schema():
    """docs/configuration.md's table of trainer.* keys is generated from TrainerConfig; regenerate it with
    `python -m src.schema --markdown src.schema.trainer.TrainerConfig trainer.` when a key changes."""
    from src.schema.reference import markdown_reference

    readme = (ROOT / "docs" / "configuration.md").read_text()
    start, end = "<!-- trainer-reference: start -->\n", "\n<!-- trainer-reference: end -->"
    assert start in readme and end in readme
    table = readme[readme.index(start) + len(start) : readme.index(end)]
    assert table == markdown_reference("src.schema.trainer.TrainerConfig", "trainer.")


def test_the_schema_command_lists_the_groups_a_group_or_a_components_keys_and_says_what_it_takes_otherwise(capsys):
    from src.schema.__main__ import main

    assert main([]) == 0 and "model=gpt" in capsys.readouterr().out  # was an IndexError traceback
    assert main(["data"]) == 0 and "src.data.jsonl.JsonlData" in capsys.readouterr().out
    assert main(["src.models.gpt.GPT"]) == 0
    out = capsys.readouterr().out  # key, type, default, then its help (the README's slow test runs the command)
    assert re.search(r"block_size\s+int\s+64\s+\w", out) and re.search(r"vocab_size\s+int\s+\(mandatory\)", out)
    assert main(["model=gpt"]) == 2  # neither a group nor a target: said, no traceback
    named(capsys.readouterr().err, "model=gpt", "src.models.gpt.GPT")


def test_the_keys_a_resume_may_change_are_all_named_in_the_checkpoints_page():
    from src.checkpointing.resume import LAYOUT_ON_RESUME, SAFE_ON_RESUME

    page = (ROOT / "docs" / "checkpoints.md").read_text()
    unnamed = [key for key in sorted((SAFE_ON_RESUME | LAYOUT_ON_RESUME) - {"resume"})
               if f"`{key}`" not in page and f"`{key.split('.', 1)[1]}`" not in page]
    assert unnamed == [], "docs/checkpoints.md does not list these keys a resume may change"
