"""The template's own settings: the loop's, `trainer.*` (TrainerConfig), and the keys it adds to every
optimizer option (LRScaling, applied by src/optim/optimizers.py). Each a dataclass whose fields are the keys
(with their defaults, types, ranges and help), checked like any component's signature.
"""

from dataclasses import dataclass
from typing import Annotated, Literal, Optional

from src.schema.signature import Arg

CompileMode = Literal["default", "max-autotune-no-cudagraphs"]  # also the GPU benchmark's --compile-mode choices


@dataclass
class TrainerConfig:
    """The loop's settings (`trainer.*`): how long, how often, how precisely."""

    max_steps: Annotated[Optional[int], Arg("optimizer steps to train for (null when max_epochs says)", ge=1)] = 2000
    max_epochs: Annotated[Optional[int], Arg(
        "passes over the training set, instead of max_steps: it then becomes max_epochs x the whole global "
        "batches of an epoch, and the LR schedule follows it (set one of the two)", ge=1)] = None
    gradient_accumulation_steps: Annotated[Optional[int], Arg(
        "micro-batches per optimizer step (null: the launcher's --gradient_accumulation_steps, else 1)", ge=1)] = None
    mixed_precision: Annotated[Optional[Literal["no", "fp16", "bf16", "auto"]], Arg(
        "autocast dtype (auto: bf16 where the device computes it natively, recent GPUs and CPUs with AVX-512-BF16 "
        "or AMX, else no; null: the launcher's --mixed_precision or `accelerate config` answer, else no)")] = None
    seed: Annotated[int, Arg("seed for model init (alike on every rank), data order, dropout (a stream per rank)",
                             ge=0)] = 1337
    init_weights: Annotated[Optional[str], Arg(
        "start from the weights of another run: its exported model (RUN/model) or a checkpoint "
        "(RUN/checkpoints/step_N), every tensor matching the model this config builds; the optimizer, LR schedule "
        "and data start afresh (null: the model's own initialisation; a transformers model: model.pretrained)")] = None
    deterministic: Annotated[bool, Arg(
        "deterministic kernels only (torch.use_deterministic_algorithms, cuDNN without autotuning, "
        "CUBLAS_WORKSPACE_CONFIG): bitwise-repeatable runs on GPUs too, at some speed; an op without a "
        "deterministic kernel then raises, naming itself")] = False
    log_every: Annotated[int, Arg("optimizer steps between train/* scalars", ge=1)] = 10
    nonfinite: Annotated[Literal["error", "skip"], Arg(
        "a NaN/inf loss or gradient norm: stop before applying it (error) or skip that optimizer step (skip)")] = "error"
    max_consecutive_skips: Annotated[int, Arg("with nonfinite=skip, stop after this many skipped steps in a row",
                                              ge=1)] = 10
    spike_factor: Annotated[Optional[float], Arg(
        "a logged train/loss above this many times the median of the last 20 logged is reported as a spike, with "
        "the command that rewinds past its data (trainer.skip_steps; null: not watched)", gt=1)] = 3.0
    skip_steps: Annotated[tuple[tuple[int, int], ...], Arg(
        "optimizer steps whose batches are read and dropped untrained, as [first, last] pairs numbered as the logs "
        "number steps, e.g. [[1041, 1100]]: past the data of a loss spike, resumed from a checkpoint before it; the "
        "LR schedule moves through them as through trained steps")] = ()
    eval_every: Annotated[int, Arg("optimizer steps between evaluations (0: only at the end)", ge=0)] = 500
    eval_on_start: Annotated[bool, Arg("evaluate once before the first step, logged at step 0: where the eval "
                                       "curves start (a pretrained model's own metrics), and an evaluation that "
                                       "fails does so before any training")] = False
    limit_train_batches: Annotated[Optional[int], Arg(
        "train on the first N global batches of the training set only, an epoch being those N (debug=overfit, "
        "debug=limit; null: all)", ge=1)] = None
    eval_batches: Annotated[Optional[int], Arg(
        "evaluate on the first eval_batches x data.eval_batch_size validation samples (null: all); exact on any "
        "number of processes", ge=1)] = None
    checkpoint_every: Annotated[int, Arg("optimizer steps between checkpoints (0: only at the end)", ge=0)] = 500
    keep_last_checkpoints: Annotated[int, Arg("newest complete checkpoints kept on disk", ge=2)] = 3
    async_checkpoint: Annotated[bool, Arg(
        "periodic and best checkpoints hold the loop only while the state is copied to host memory; a thread "
        "writes and commits them while training goes on (under FSDP each rank's shards, through "
        "torch.distributed.checkpoint's async_save; the final and a stop's checkpoint stay blocking)")] = False
    max_grad_norm: Annotated[float, Arg("clip the global gradient norm to this (0: no clipping)", ge=0)] = 1.0
    monitor: Annotated[Optional[str], Arg(
        "metric that picks the best checkpoint (null: none); one the objective reports, e.g. eval/loss")] = "eval/loss"
    monitor_mode: Annotated[Literal["min", "max"], Arg("whether the monitored metric is better low or high")] = "min"
    dist_timeout_s: Annotated[int, Arg("collective timeout: a lost peer ends the run with an error", ge=1)] = 1800
    resume_with_changed_data: Annotated[bool, Arg(
        "resume although the data differs from the checkpoint's fingerprint, or with other data.* keys (a WSD decay "
        "on another mixture): weights, optimizer and schedule go on, the data position restarts at an epoch "
        "boundary; its ids must still mean the checkpoint's tokens")] = False
    resume_with_new_global_batch: Annotated[bool, Arg(
        "resume with another global batch (data.batch_size x processes x gradient_accumulation_steps), e.g. on a "
        "process count that cannot keep the checkpoint's, or to raise the batch as training goes on: the epoch "
        "continues in the same order from the first sample not trained, the schedule by steps")] = False
    run_dir_lease_s: Annotated[float, Arg("a run holds its run dir (.run.lock, touched every lease/4); a holder silent "
                                          "this long is taken over, e.g. after its node was lost", gt=0)] = 60.0
    hang_report_s: Annotated[float, Arg("nothing progressed for this long (no step, evaluation batch, sample or save "
                                        "part): every live rank logs its threads' stacks (before dist_timeout_s "
                                        "ends the run)", gt=0)] = 300.0
    early_stopping_patience: Annotated[Optional[int], Arg(
        "stop after this many evaluations in a row without improving trainer.monitor (null: never)", ge=1)] = None
    early_stopping_min_delta: Annotated[float, Arg(
        "an improvement smaller than this does not count, for early stopping", ge=0)] = 0.0
    eval_tasks: Annotated[tuple[str, ...], Arg(
        "lm-evaluation-harness tasks scored on the live model during training, logged as "
        "eval_tasks/<task>/<metric> (trainer.monitor may name one): a task's YAML file over local data, offline "
        "(data/eval_tasks/shakespeare_cloze.yaml), or a task name the harness knows; needs pip install "
        "lm_eval (requirements-extras.txt)")] = ()
    eval_tasks_every: Annotated[int, Arg("optimizer steps between scorings of eval_tasks (0: only at the end)",
                                         ge=0)] = 0
    eval_tasks_limit: Annotated[Optional[int], Arg("score the first N documents of each task only (null: all)",
                                                   ge=1)] = None
    eval_tasks_batch_size: Annotated[int, Arg("sequences per forward pass when scoring eval_tasks", ge=1)] = 32
    sample_every: Annotated[int, Arg(
        "language models on text: optimizer steps between sampled continuations of sample_prompts, written to "
        "the log and TensorBoard's text tab (0: never)", ge=0)] = 0
    sample_prompts: Annotated[tuple[str, ...], Arg("the prompts sample_every continues")] = ("\n",)
    sample_tokens: Annotated[int, Arg("tokens sampled after each prompt", ge=1)] = 200
    sample_temperature: Annotated[float, Arg("softmax temperature of the sampler", gt=0)] = 0.8
    sample_top_k: Annotated[Optional[int], Arg("sample from the top_k likeliest tokens only (null: all)", ge=1)] = 200
    ema_decay: Annotated[Optional[float], Arg(
        "keep an exponential moving average of the weights with this decay, e.g. 0.999: evaluated as eval_ema/*, "
        "exported to <run_dir>/model_ema, checkpointed (null: off)", gt=0, lt=1)] = None
    sync_batchnorm: Annotated[bool, Arg(
        "BatchNorm statistics over the global batch under DDP (SyncBatchNorm), not each process's share")] = False
    cuda_memory_fraction: Annotated[Optional[float], Arg(
        "cap this process's CUDA memory at this fraction of its GPU, e.g. to share one (null: no cap; ignored "
        "on CPU)", gt=0, le=1)] = None
    trackers: Annotated[tuple[Literal["tensorboard", "mlflow", "wandb"], ...], Arg(
        "where scalars are logged, through accelerate's trackers; MLflow and W&B take their storage from their own "
        "settings (MLFLOW_TRACKING_URI, WANDB_MODE=offline)")] = ("tensorboard",)
    tracker_project: Annotated[str, Arg("the MLflow experiment / W&B project the run belongs to")] = "train"
    compile: Annotated[bool, Arg(
        "torch.compile each micro-step's forward pass and loss as one graph, and evaluation")] = False
    compile_mode: Annotated[CompileMode, Arg(
        "torch.compile's mode for the training step: max-autotune-no-cudagraphs times candidate kernels for the "
        "matrix products (a longer first compile, often a faster GPU step); evaluation keeps the default. The CUDA "
        "graph modes (reduce-overhead, max-autotune) are not offered: their replays reuse the buffers of earlier "
        "outputs, and the loop (accumulation, DDP's hooks) has not been verified under them")] = "default"
    auto_micro_batch: Annotated[bool, Arg(
        "use the largest per-process micro-batch that fits, with accumulation making up the rest, so the global "
        "batch and the loss stay exactly as configured; chosen once, saved, reused on resume; not under FSDP (it "
        "probes a whole copy), nor with dpo, distill or grpo (whose reference, teacher or completions it cannot "
        "probe)")] = False
    tf32: Annotated[bool, Arg("TF32 tensor cores for fp32 matmuls and convolutions on CUDA (ignored on CPU)")] = True
    ddp_find_unused_parameters: Annotated[bool, Arg(
        "DDP: allow parameters without a gradient in a step (costs a graph traversal per step)")] = False
    ddp_static_graph: Annotated[bool, Arg("DDP: the graph is the same every step (enables more overlap)")] = False
    ddp_bucket_cap_mb: Annotated[int, Arg("DDP: gradient bucket size for the all-reduce, in MB", ge=1)] = 25
    ddp_gradient_as_bucket_view: Annotated[bool, Arg(
        "DDP: gradients are views into the all-reduce buckets (saves one gradient-sized copy)")] = False
    progress_interval_s: Annotated[float, Arg(
        "seconds between plain progress lines when stderr is not a terminal (a terminal gets a tqdm bar)", gt=0)] = 30.0
    profile: Annotated[Optional[tuple[int, int, int]], Arg(
        "[wait, warmup, active] optimizer steps of a torch.profiler trace in <run_dir>/profile (null: off)", ge=0)] = None
    peak_tflops: Annotated[Optional[float], Arg(
        "peak TFLOP/s of one device, for train/mfu (null: A100/H100/H200 known, others no MFU)", gt=0)] = None
    cpu_threads: Annotated[Optional[int], Arg(
        "intra-op threads per process on CPU (null: its share of the cores)", ge=1)] = None


@dataclass
class LRScaling:
    scale_lr: Annotated[Literal["none", "linear", "sqrt"], Arg(
        "scale optimizer.lr by the global batch over reference_batch (linear: Goyal et al.'s rule for SGD; "
        "sqrt: the usual one for Adam), so a recipe moves to more GPUs without retuning")] = "none"
    reference_batch: Annotated[Optional[int], Arg(
        "the global batch (samples per optimizer step) optimizer.lr was tuned for; needed by scale_lr", ge=1)] = None
