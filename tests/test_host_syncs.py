"""An optimizer step never waits for the device: the host reads results only at steps that log, evaluate or save.

Each test runs the real train.py under tests/host_reads.py, which records every read of a tensor made inside
an optimizer step (forward to schedule), per step. AdamW is fused, as it is by default on CUDA (the CPU's
default single-tensor AdamW reads each parameter's step counter, a host tensor there and on GPUs alike).
"""

import json

import pytest

from tests.conftest import GPU_ENV, TINY_GPT, run

STEPS = ["trainer.max_steps=12", "trainer.log_every=5", "trainer.eval_every=6", "trainer.checkpoint_every=4",
         "trainer.eval_batches=2", "data.batch_size=4", "optimizer.fused=true"]


def reads_per_step(tmp_path, extra: list[str], nproc: int = 1, env: dict | None = None) -> list[dict]:
    run([*TINY_GPT, *STEPS, *extra, f"hydra.run.dir={tmp_path / 'run'}"], script="tests/host_reads.py", nproc=nproc,
        launcher="torchrun", env={"HOST_READS_FILE": str(tmp_path / "reads"), **(env or {})})
    per_rank = [json.loads((tmp_path / f"reads.{rank}").read_text()) for rank in range(nproc)]
    assert all(len(reads) == 11 for reads in per_rank)  # steps 2 to 12 were watched
    return per_rank


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("nonfinite", ["error", "skip"])
def test_optimizer_steps_make_no_host_reads_between_logging_steps(tmp_path, nproc, nonfinite):
    for reads in reads_per_step(tmp_path, ["trainer.gradient_accumulation_steps=2", f"trainer.nonfinite={nonfinite}"],
                                nproc):
        assert not any(reads.values()), {step: r for step, r in reads.items() if r}


def test_muon_steps_make_no_host_reads_between_logging_steps(tmp_path):
    """Muon's Newton-Schulz and its per-matrix rates (shapes, not values) stay on the device; AdamW's half fused."""
    for reads in reads_per_step(tmp_path, ["optimizer=muon", "trainer.gradient_accumulation_steps=2"], nproc=2):
        assert not any(reads.values()), {step: r for step, r in reads.items() if r}


def test_skip_mode_reads_its_verdict_every_step_when_the_optimizer_cannot_skip_on_the_device(tmp_path):
    """The counterpart, which also shows the watch sees reads: without found_inf, skip must know at once."""
    (reads,) = reads_per_step(tmp_path, ["trainer.nonfinite=skip", "optimizer.fused=false"])
    assert all(any("nonfinite.py" in r for r in step_reads) for step_reads in reads.values()), reads


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_steps_make_no_cuda_sync_in_bf16_compiled_training(tmp_path, optimizer):
    (reads,) = reads_per_step(tmp_path, ["trainer.mixed_precision=bf16", "trainer.compile=true",
                                         f"optimizer={optimizer}"],
                              env={**GPU_ENV, "HOST_READS_CUDA_SYNC": "error"})
    assert not any(reads.values()), reads
    assert "device                      : cuda" in (tmp_path / "run" / "train.log").read_text()
