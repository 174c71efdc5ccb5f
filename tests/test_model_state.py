"""What the model's state costs each rank, stated before the first step, and what would fit where it cannot."""

import os
import re

import pytest
import torch

from src.launch.memory import model_state, what_would_fit
from tests.conftest import named


def tied_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Embedding(100, 10), torch.nn.Linear(10, 100, bias=False))
    model[1].weight = model[0].weight  # tied: counted once, as the state holds it once
    return model


def test_weights_gradients_and_adams_two_moments_are_counted_once_per_tied_weight_and_sharded():
    whole = model_state(tied_model(), "src.optim.optimizers.adamw", shards=1)
    assert (whole.parameters, whole.weights, whole.gradients, whole.optimizer) == (1000, 4000, 4000, 8000)
    sharded = model_state(tied_model(), "torch.optim.AdamW", shards=3)
    assert (sharded.weights, sharded.gradients, sharded.optimizer) == (1334, 1334, 2667)  # rounded up
    assert "sharded over 3 ranks" in sharded.describe() and "a whole copy on each rank" in whole.describe()


def test_frozen_weights_have_no_gradients_nor_optimizer_state_and_an_unknown_optimizer_is_said_so():
    model = tied_model()
    model.append(torch.nn.Linear(100, 1))  # 101 trainable parameters
    model[0].requires_grad_(False)
    sgd = model_state(model, "src.optim.optimizers.sgd", shards=1, momentum=0.9)
    assert (sgd.weights, sgd.gradients, sgd.optimizer) == (4404, 404, 404)
    assert model_state(model, "torch.optim.SGD", shards=1).optimizer == 0  # no momentum: no state
    unknown = model_state(model, "my.optim.Lion2", shards=1)
    assert unknown.optimizer is None and "optimizer state unknown" in unknown.describe()


def test_a_state_larger_than_a_ranks_memory_names_the_layouts_that_would_fit():
    state = model_state(tied_model(), "torch.optim.AdamW", shards=1)  # 16,000 bytes per rank
    ddp = what_would_fit(state, available=10_000, world_size=2, precision="no")
    named(ddp, "15.6 KiB", "9.8 KiB", "FSDP2 (config/accelerate/fsdp.yaml)", "7.8 KiB")  # needed, had, a fit
    assert "trainer.mixed_precision=bf16" in ddp and "activation checkpointing" in ddp
    fsdp = what_would_fit(model_state(tied_model(), "torch.optim.AdamW", shards=2), available=3_000, world_size=2,
                          precision="bf16")
    assert re.search(r"more ranks: .*6 or more.* 2\.6 KiB", fsdp), fsdp  # 16,000 / 3,000
    assert "bf16" not in fsdp.split("What would fit")[1]  # already chosen


def test_a_jobs_cgroup_limit_set_above_its_own_group_bounds_a_ranks_memory(tmp_path):
    """SLURM's --mem limits the job's cgroup; its steps' groups below say "no limit" (v1) or "max" (v2)."""
    from pathlib import Path

    from src.launch.memory import cgroup_memory_room

    def tree(lines: str, files: dict) -> tuple[Path, Path]:
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        (tmp_path / "cgroup").write_text(lines)
        return tmp_path / "cgroup", tmp_path / "fs"

    v1 = tree("4:memory:/slurm/job_7/step_0\n1:cpu:/\n", {
        "fs/memory/memory.limit_in_bytes": "9223372036854771712", "fs/memory/memory.usage_in_bytes": "5",
        "fs/memory/slurm/job_7/memory.limit_in_bytes": str(4 << 30),
        "fs/memory/slurm/job_7/memory.usage_in_bytes": str(1 << 30),
        "fs/memory/slurm/job_7/step_0/memory.limit_in_bytes": "9223372036854771712",
        "fs/memory/slurm/job_7/step_0/memory.usage_in_bytes": str(1 << 30)})
    assert cgroup_memory_room(*v1) == 3 << 30
    v2 = tree("0::/job/step\n", {"fs/job/memory.max": str(2 << 30), "fs/job/memory.current": str(1 << 29),
                                   "fs/job/step/memory.max": "max", "fs/job/step/memory.current": "7"})
    assert cgroup_memory_room(*v2) == (2 << 30) - (1 << 29)
    (tmp_path / "fs" / "job" / "memory.max").write_text("max")
    assert cgroup_memory_room(*v2) is None


@pytest.mark.slow  # waits out timeouts or a long run: in CI's slow pass
def test_a_run_in_a_memory_limited_cgroup_states_the_limit_as_its_memory_per_rank(tmp_path):
    """A real cgroup (root on this machine): the banner's memory per rank is what its limit leaves, not the host's."""
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    from tests.conftest import QUIET, ROOT, TINY_GPT, banner_row, user_env

    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    name = f"template-test-{uuid.uuid4().hex[:8]}"
    if (v1 / "memory.limit_in_bytes").is_file() and os.access(v1, os.W_OK):
        group, limit_file = v1 / name, "memory.limit_in_bytes"
    elif "memory" in (v2 / "cgroup.subtree_control").read_text() if (v2 / "cgroup.subtree_control").is_file() \
            else False:
        group, limit_file = v2 / name, "memory.max"
    else:
        pytest.skip("no writable memory cgroup here")
    try:
        group.mkdir()
        (group / limit_file).write_text(str(3 << 30))
    except OSError as error:
        pytest.skip(f"cannot make a memory cgroup: {error}")
    try:
        args = [*TINY_GPT, *QUIET, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
        proc = subprocess.run(["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", sys.executable,
                               "train.py", *args], cwd=ROOT, env=user_env(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        row = banner_row(proc.stdout + proc.stderr, "memory per rank")
        room = re.match(r"([\d.]+) GiB", row)
        assert "cgroup" in row and room and float(room.group(1)) < 3.0, row  # the limit, less what the run uses
    finally:
        group.rmdir()


def test_a_parameter_is_named_in_files_without_what_any_wrapper_adds():
    """DDP, torch.compile, activation checkpointing, FSDP1 and peft each insert segments into the names; checkpoints,
    exports and pretrained folders hold the model's own (a peft model's base: the folder's)."""
    from src.models.parameter_names import name_in_files

    wrapped = "module._orig_mod.transformer.h.0._checkpoint_wrapped_module.attn.c_attn.weight"
    assert name_in_files(wrapped) == "transformer.h.0.attn.c_attn.weight"
    assert name_in_files("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    peft = "base_model.model.transformer.h.0._checkpoint_wrapped_module.attn.c_attn.base_layer.weight"
    assert name_in_files(peft, base=True) == "transformer.h.0.attn.c_attn.weight"
    assert name_in_files("base_model.model.score.modules_to_save.default.weight", base=True) == "score.weight"
    assert name_in_files("encoder.module.weight") == "encoder.module.weight"  # a user's own submodule named so
