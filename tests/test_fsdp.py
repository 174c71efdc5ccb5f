"""FSDP2: our code on sharded weights. Without GPUs (accelerate runs its FSDP plugin only on them) the model is
sharded with torch's fully_shard on a real 2-process gloo group; with a GPU, train.py runs the plugin itself."""

import json

import pytest

from src.checkpointing.export import load_exported_model
from tests.conftest import GPU_ENV, QUIET, TINY_GPT, exported_weights, max_abs_diff, run, scalars


def test_clipping_the_nonfinite_check_and_the_export_work_on_sharded_tied_weights():
    proc = run([], script="tests/fsdp_paths.py", nproc=2, launcher="torchrun")
    found = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert found["tied"] and found["weights_equal"], found


@pytest.mark.gpu
def test_fsdp_on_one_gpu_trains_resumes_bitwise_and_exports_a_loadable_tied_model(tmp_path):
    args = [*TINY_GPT, *QUIET, "scheduler=constant", "trainer.checkpoint_every=4", "trainer.mixed_precision=bf16"]
    run([*args, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'whole'}"], launcher="fsdp", env=GPU_ENV)
    run([*args, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'resumed'}"], launcher="fsdp", env=GPU_ENV)
    run([*args, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={tmp_path / 'resumed'}"], launcher="fsdp",
        env=GPU_ENV)
    assert scalars(tmp_path / "whole", "train/loss") == scalars(tmp_path / "resumed", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "whole"), exported_weights(tmp_path / "resumed")) == 0
    model = load_exported_model(tmp_path / "whole" / "model")
    assert model.lm_head.weight is model.tok_emb.weight
