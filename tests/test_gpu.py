"""What only a GPU can show: run with `python -m pytest tests -m gpu` on a machine with one (skipped elsewhere).

Also gpu-marked elsewhere: no CUDA sync inside a compiled bf16 step (test_host_syncs.py), FSDP2 train, resume
and export (test_fsdp.py).
"""

import json
import os

import pytest

from tests.conftest import (
    GPU_ENV,
    QUIET,
    ROOT,
    TINY_GPT,
    banner_row,
    exported_weights,
    max_abs_diff,
    named,
    run,
    scalar_events,
    scalars,
)

pytestmark = pytest.mark.gpu
SHORT = [*TINY_GPT, *QUIET, "data.batch_size=8", "trainer.checkpoint_every=4", "trainer.monitor=null"]


def gpu_run(args: list[str], **kwargs):
    return run(args, env=GPU_ENV, **kwargs)


def test_a_resumed_deterministic_cuda_run_with_dropout_gives_the_losses_and_weights_of_the_uninterrupted_one(
        tmp_path):
    """bf16 with accumulation, dropout drawn on the GPU, deterministic kernels (any op without a deterministic
    CUDA kernel would raise here); one set of three launches, as `-m gpu` has 5 minutes in all."""
    args = [*SHORT, "scheduler=constant", "trainer.mixed_precision=bf16", "trainer.gradient_accumulation_steps=2",
            "model.dropout=0.1", "trainer.deterministic=true"]
    gpu_run([*args, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'whole'}"])
    gpu_run([*args, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'resumed'}"])
    proc = gpu_run([*args, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={tmp_path / 'resumed'}"])
    assert "device                      : cuda" in proc.stdout
    assert "deterministic kernels       : True" in proc.stdout
    assert scalars(tmp_path / "whole", "train/loss") == scalars(tmp_path / "resumed", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "whole"), exported_weights(tmp_path / "resumed")) == 0


def test_an_async_checkpoint_copied_off_the_gpu_resumes_bitwise_and_the_banner_states_the_gpus_memory(tmp_path):
    """trainer.async_checkpoint copies the state from the GPU to host memory at the step and writes it on a
    thread: a run forked from such a checkpoint ends as the whole run did."""
    args = [*SHORT, "scheduler=constant", "model.dropout=0.1", "trainer.deterministic=true",
            "trainer.async_checkpoint=true", "trainer.checkpoint_every=4", "trainer.max_steps=8"]
    whole = gpu_run([*args, f"hydra.run.dir={tmp_path / 'whole'}"])
    assert "written in the background" in (tmp_path / "whole" / "train.log").read_text()
    assert "(a whole copy on each rank): weights" in whole.stdout and "cuda:0's memory" in whole.stdout
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_00000004"
    gpu_run([*args, f"resume={checkpoint}", f"hydra.run.dir={tmp_path / 'forked'}"])
    after_the_fork = {step: loss for step, loss in scalars(tmp_path / "whole", "train/loss").items() if step > 4}
    assert scalars(tmp_path / "forked", "train/loss") == after_the_fork
    assert max_abs_diff(exported_weights(tmp_path / "whole"), exported_weights(tmp_path / "forked")) == 0


def test_fp16_steps_the_grad_scaler_skips_do_not_advance_the_schedule(tmp_path):
    """Steps 5 and 6 overflow fp16 in the backward (the loss stays finite), so the scaler must skip them; a
    tiny model's own gradients may overflow its first scale (2**16) too."""
    run_dir = tmp_path / "run"
    gpu_run([*SHORT, "model._target_=tests.components.OverflowOnCalls", "+model.overflow_calls=[5,6]",
             "trainer.mixed_precision=fp16", "trainer.max_steps=12", "scheduler.warmup_steps=12",
             f"hydra.run.dir={run_dir}"])
    scale, lr = scalars(run_dir, "train/loss_scale"), scalars(run_dir, "train/lr")
    skipped = [step for step in range(2, 13) if scale[step] < scale[step - 1]]
    assert {5, 6} <= set(skipped), scale
    assert all(lr[step] == lr[step - 1] for step in skipped)
    assert all(lr[step] > lr[step - 1] for step in range(2, 13) if step not in skipped)


def test_the_autotuned_compiled_step_trains_with_accumulation(tmp_path):
    """trainer.compile_mode=max-autotune-no-cudagraphs: on a GPU the compiler benchmarks Triton matmul templates
    (on CPU it has none to try for fp32, so only here is the autotuning itself exercised; the eager loss and
    gradients of the compiled step are tests/test_compiled_step.py's). One launch: `-m gpu` has 5 minutes."""
    run_dir = tmp_path / "tuned"
    proc = gpu_run([*SHORT, "trainer.max_steps=8", "trainer.mixed_precision=bf16", "scheduler=constant",
                    "trainer.gradient_accumulation_steps=2", "trainer.compile=true",
                    "trainer.compile_mode=max-autotune-no-cudagraphs", f"hydra.run.dir={run_dir}"], timeout=600)
    assert banner_row(proc.stdout, "device").startswith("cuda")
    assert "max-autotune-no-cudagraphs" in banner_row(proc.stdout, "torch.compile")
    losses = scalars(run_dir, "train/loss")
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.1, losses


def test_auto_micro_batch_backs_off_from_a_real_out_of_memory_error(tmp_path):
    # 512 samples of 1024 tokens through this GPT need ~160 GB of fp32 activations; a divisor further down fits.
    proc = gpu_run(["model.n_layer=4", "model.n_head=8", "model.n_embd=1024", "model.block_size=1024",
                    "data.batch_size=512", "trainer.auto_micro_batch=true", "trainer.max_steps=1", *QUIET,
                    "trainer.eval_batches=1", "data.eval_batch_size=8", f"hydra.run.dir={tmp_path / 'run'}"],
                   timeout=600)
    named(proc.stdout, "OutOfMemoryError")
    assert "auto micro-batch: " in proc.stdout


def test_telemetry_reports_cuda_memory_nvml_state_and_mfu_of_the_gpus_the_run_sees(tmp_path):
    """Given the machine's last GPU alone, the run logs that one, as gpu/0 (NVML numbers every GPU of the node)."""
    run_dir = tmp_path / "run"
    run([*SHORT, "trainer.max_steps=4", "trainer.mixed_precision=bf16", "trainer.peak_tflops=100",
         f"hydra.run.dir={run_dir}"], env={"CUDA_VISIBLE_DEVICES": GPU_ENV["CUDA_VISIBLE_DEVICES"].split(",")[-1]})
    for tag in ("memory/cuda_peak_gib", "gpu/0/utilization", "gpu/0/memory_used_gib", "gpu/0/temperature_c",
                "gpu/0/power_w", "train/mfu"):
        assert scalars(run_dir, tag), tag
    tags = scalar_events(run_dir).Tags()["scalars"]
    assert {tag.split("/")[1] for tag in tags if tag.startswith("gpu/")} == {"0"}
    assert json.loads((run_dir / "summary.json").read_text())["peak_memory_gib"]["cuda"] > 0


@pytest.mark.parametrize("objective", ["causal_lm", "dpo"])
def test_the_chunked_loss_lowers_a_cuda_micro_steps_peak_memory_and_keeps_its_loss(tmp_path, objective):
    """objective.chunk_tokens on the GPU, through scripts/benchmark.py loss-memory (CUDA's allocator peaks): the
    whole logits of a 128k vocabulary are never held, and the loss is the plain one within float rounding; for DPO,
    the answers' log-probabilities of the policy and of its reference copy."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "scripts/benchmark.py", "loss-memory", "--device", "cuda", "--objective",
                           objective], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **GPU_ENV},
                          check=True)
    report = json.loads(done.stdout)
    assert report["peak_ratio_plain_over_chunked"] >= 2, report
    assert report["loss_difference"] <= 1e-6 * abs(report["chunk_tokens=null"]["loss"]), report


def test_shards_read_by_loader_workers_through_the_pinning_thread_resume_bitwise_on_cuda(tmp_path):
    """The recipe's loader on a GPU (data=shards, random windows, byte tokens written as a prepared folder): two
    loader workers hand their batches to the DataLoader's pinning thread, copied to the GPU without blocking; a run
    resumed from its step-4 checkpoint ends as the whole run did, weights bitwise."""
    import numpy as np

    from scripts.benchmarks.gpu import write_shards

    folder = tmp_path / "bytes.shards"
    write_shards(np.frombuffer((ROOT / "data" / "tinyshakespeare.txt").read_bytes(), np.uint8).astype(np.uint16),
                 folder)
    args = [*SHORT, "data=shards", f"data.path={folder}", "data.random_windows=true", "data.num_workers=2",
            "scheduler=constant", "trainer.mixed_precision=bf16", "trainer.gradient_accumulation_steps=2"]
    whole = gpu_run([*args, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'whole'}"])
    assert banner_row(whole.stdout, "device").startswith("cuda")
    gpu_run([*args, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'resumed'}"])
    gpu_run([*args, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={tmp_path / 'resumed'}"])
    assert scalars(tmp_path / "whole", "train/loss") == scalars(tmp_path / "resumed", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "whole"), exported_weights(tmp_path / "resumed")) == 0


def test_reading_ahead_in_a_thread_on_cuda_trains_what_the_training_thread_reads_and_resumes_bitwise(tmp_path):
    """data.read_ahead=true on a GPU: the reading thread pins the next step's micro-batches and starts their copy
    on this rank's GPU while a step runs; the weights are those of the run that reads in the training thread,
    also after a resume from the step-4 checkpoint."""
    import numpy as np

    from scripts.benchmarks.gpu import write_shards

    folder = tmp_path / "bytes.shards"
    write_shards(np.frombuffer((ROOT / "data" / "tinyshakespeare.txt").read_bytes(), np.uint8).astype(np.uint16),
                 folder)
    args = [*SHORT, "data=shards", f"data.path={folder}", "data.random_windows=true", "scheduler=constant",
            "trainer.mixed_precision=bf16", "trainer.gradient_accumulation_steps=3"]
    gpu_run([*args, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'in_thread'}"])
    ahead = [*args, "data.read_ahead=true", f"hydra.run.dir={tmp_path / 'ahead'}"]
    first = gpu_run([*ahead, "trainer.max_steps=4"])
    assert "a thread of this process reads the next optimizer step's micro-batches" in first.stdout
    gpu_run([*ahead, "trainer.max_steps=8", "resume=auto"])
    assert scalars(tmp_path / "ahead", "train/loss") == scalars(tmp_path / "in_thread", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "in_thread"), exported_weights(tmp_path / "ahead")) == 0


def test_a_student_distils_from_its_teacher_under_bf16_autocast_and_compile_on_cuda(tmp_path):
    """The teacher runs eager under the student's autocast, outside the compiled step (src/objectives/distillation.py):
    started from the teacher's weights the student diverges by bf16's rounding alone, and a smaller one learns."""
    teacher, same, small = tmp_path / "teacher", tmp_path / "same", tmp_path / "small"
    bf16 = [*SHORT, "trainer.mixed_precision=bf16", "optimizer.lr=1e-2", "scheduler=constant"]
    gpu_run([*bf16, "trainer.max_steps=60", f"hydra.run.dir={teacher}"])
    distil = [*bf16, "objective=distill", f"objective.teacher={teacher / 'model'}", "trainer.compile=true"]
    gpu_run([*distil, f"trainer.init_weights={teacher / 'model'}", "trainer.max_steps=2", f"hydra.run.dir={same}"],
            timeout=600)
    assert abs(scalars(same, "train/kl")[1]) < 1e-2
    gpu_run([*distil, "objective.kd_ratio=1", "model.n_embd=16", "trainer.max_steps=12", "trainer.eval_on_start=true",
             f"hydra.run.dir={small}"], timeout=600)
    kl = scalars(small, "eval/kl")
    assert kl[12] < 0.5 * kl[0]
    # objective.chunk_tokens: both models' logits made chunk by chunk in the student's output layer (the teacher's
    # from its last hidden states), compiled: on the same starting weights, the terms of the whole logits within
    # bf16's rounding (later steps drift apart as any two bf16 runs do).
    chunked = tmp_path / "chunked"
    gpu_run([*distil, "objective.kd_ratio=1", "model.n_embd=16", "trainer.max_steps=12", "trainer.eval_on_start=true",
             "objective.chunk_tokens=64", f"hydra.run.dir={chunked}"], timeout=600)
    for name, step in (("eval/kl", 0), ("train/kl", 1), ("train/ce", 1)):
        whole, in_chunks = scalars(small, name)[step], scalars(chunked, name)[step]
        assert abs(in_chunks - whole) <= 2e-2 * abs(whole) + 1e-3, (name, whole, in_chunks)
    assert scalars(chunked, "eval/kl")[12] < 0.5 * scalars(chunked, "eval/kl")[0]


@pytest.mark.parametrize("options, stop", [((), 2), (("objective.num_iterations=2",), 3)],
                         ids=["on_policy", "two_iterations"])
def test_grpo_on_cuda_draws_its_completions_from_the_seeded_cuda_stream_and_resumes_bitwise(tmp_path, options, stop):
    """bf16 autocast, the completions sampled on the GPU, each prompt's from a CUDA generator seeded by (seed, step,
    prompt), prompts of several lengths written together through the GPT's KV cache: a run stopped after 2 steps
    and resumed logs the rewards and ends at the weights of the run that was not (CPU: tests/test_grpo.py); with
    num_iterations=2 stopped within a cycle, its completions read back onto the GPU from the checkpoint."""
    from tests.test_grpo import grpo_args, letter_prompts

    prompts = letter_prompts(tmp_path / "letters.jsonl", varied=True)
    args = [*QUIET, "trainer.mixed_precision=bf16", "data.batch_size=4", "trainer.checkpoint_every=2",
            "trainer.monitor=null", *options]
    gpu_run(grpo_args(prompts, tmp_path / "whole", *args, "trainer.max_steps=4"))
    gpu_run(grpo_args(prompts, tmp_path / "resumed", *args, f"trainer.max_steps={stop}"))
    proc = gpu_run(grpo_args(prompts, tmp_path / "resumed", *args, "trainer.max_steps=4", "resume=auto"))
    assert "device                      : cuda" in proc.stdout
    assert scalars(tmp_path / "whole", "train/reward") == scalars(tmp_path / "resumed", "train/reward")
    assert max_abs_diff(exported_weights(tmp_path / "whole"), exported_weights(tmp_path / "resumed")) == 0
