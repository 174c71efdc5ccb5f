"""The configuration is the user's interface: every option composes, and mistakes stop before any run."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import src.config  # noqa: F401  (registers the schema)
from src.config import config_errors
from tests.conftest import ROOT, run

CONFIG_DIR = ROOT / "config"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


# Models and datasets come in matching pairs (a GPT reads tokens, a ResNet reads images).
PARTNERS = {
    "data=tokens": ["data.path=x.bin", "data.vocab_size=256"],
    "model=resnet": ["data=cifar10"],
    "data=cifar10": ["model=resnet"],
    "experiment=owt_tokens": ["data.path=train.bin"],
}


@pytest.mark.parametrize(
    "override",
    [f"{group}={name}" for group in ("model", "data", "optimizer", "scheduler", "trainer") for name in options(group)]
    + [f"experiment={name}" for name in options("experiment")],
)
def test_every_config_option_composes_and_resolves_within_range(override):
    cfg = compose_train([override] + PARTNERS.get(override, []))
    assert OmegaConf.to_container(cfg, resolve=True)
    assert config_errors(cfg) == []


def test_optimizer_and_scheduler_options_build_from_partial_targets():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    for opt_name in options("optimizer"):
        for sched_name in options("scheduler"):
            cfg = compose_train([f"optimizer={opt_name}", f"scheduler={sched_name}"])
            optimizer = instantiate(cfg.optimizer)(params)
            scheduler = instantiate(cfg.scheduler)(optimizer)
            optimizer.step()
            scheduler.step()


def test_accelerate_launch_configs_cover_cpu_ddp_gpus_multi_node_and_fsdp():
    types = {p.stem: OmegaConf.load(p).distributed_type for p in (CONFIG_DIR / "accelerate").glob("*.yaml")}
    assert types["cpu_ddp"] == "MULTI_GPU"  # what makes the launcher start N workers without CUDA
    assert {"single_gpu", "multi_gpu", "multi_node", "fsdp"} <= types.keys()
    assert types["fsdp"] == "FSDP"


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("trainer.max_stepz=5", "trainer.max_stepz", "not in 'TrainerConfig'"),
        ("trainer.max_steps=many", "trainer.max_steps", "could not be converted to Integer"),
        ("trainer.mixed_precision=fp8", "trainer.mixed_precision", "expected one of [no, fp16, bf16]"),
        ("optimizer.lr=0", "optimizer.lr", "must be > 0"),
        ("optimizer.lr=-1e-3", "optimizer.lr", "must be > 0"),
        ("data.batch_size=0", "data.batch_size", "must be >= 1"),
        ("trainer.gradient_accumulation_steps=0", "trainer.gradient_accumulation_steps", "must be >= 1"),
        ("model.n_layr=3", "model.n_layr", "not in 'GPTConfig'"),
    ],
)
def test_bad_value_names_the_key_exits_nonzero_and_creates_no_run_dir(tmp_path, override, key, message):
    run_dir = tmp_path / "run"
    proc = run([override, f"hydra.run.dir={run_dir}"], check=False, timeout=60)
    assert proc.returncode != 0
    assert key in proc.stdout and message in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout
    assert not run_dir.exists()


def test_fp16_without_cuda_is_refused_before_the_run_starts(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where fp16 is valid")
    proc = run(["trainer.mixed_precision=fp16", f"hydra.run.dir={tmp_path / 'run'}"], check=False, timeout=60)
    assert proc.returncode != 0 and "trainer.mixed_precision=fp16 needs a CUDA GPU" in proc.stdout
    assert not (tmp_path / "run").exists()
