"""Every command of the README and of docs/ runs: each line of their ```bash blocks, each command in a table cell
or inline in the prose, and each ```python block is either run here, shortened (a tiny model, 2 steps, test data
in place of /data paths), or listed with the reason it is not. A command added to or changed in them fails the
first test until it is listed below, so the documentation cannot drift from the code unseen."""

import re

import pytest

from tests.conftest import ROOT, copy_of_repo, exported_weights, max_abs_diff, scalars, shell
from tests.test_slurm import CPU_NODES, cluster_is_up, job_field

README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}

# The Launching table's ways to start 2 CPU processes: each one real DDP, one run dir, the same training.
LAUNCHERS = ["accelerate launch --multi_gpu --num_processes N train.py",
             "accelerate launch --config_file config/accelerate/cpu_ddp.yaml train.py", "torchrun --nproc_per_node N train.py"]

# Shortening: appended after the README's own overrides, so they win.
TINY = ["model.n_head=1", "model.n_embd=16", "model.block_size=16"]  # the default GPT, tiny (its depth kept)
STEPS = ["trainer.max_steps=2", "trainer.eval_batches=1", "trainer.log_every=1"]
TINY_HF = ["model.config.n_layer=1", "model.config.n_head=1", "model.config.n_embd=16", "model.block_size=16"]
WSD_STEPS = ["trainer.eval_batches=1", "trainer.log_every=1", "scheduler.warmup_steps=1"]  # its length: the command's
SETUP = "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && "

# The FineWeb-Edu recipe's preparation, on a local file with a byte tokenizer (no network here), the same config.
FINEWEB_HERE = {"HuggingFaceFW/fineweb-edu": "data/shakespeare_speeches.jsonl", "--subset sample-10BT ": "",
                "--tokenizer gpt2 ": "--tokenizer byte ", "--tasks 64": "--tasks 8"}
# (README command, {README text: what runs instead}, appended arguments), run in this order in a copy of the
# repository: later commands use what earlier ones wrote (outputs/my_run, data/shakespeare.bin).
RUN = [
    (SETUP + "python train.py", {SETUP: ""}, [*TINY, *STEPS]),  # the install: README's set-up check
    ("python train.py", {}, [*TINY, *STEPS]),
    ("accelerate launch train.py", {}, [*TINY, *STEPS]),
    ("accelerate launch --multi_gpu --num_processes N train.py", {" N ": " 2 "}, [*TINY, *STEPS]),
    ("accelerate launch --config_file config/accelerate/cpu_ddp.yaml train.py", {}, [*TINY, *STEPS]),
    ("torchrun --nproc_per_node N train.py", {" N ": " 2 "}, [*TINY, *STEPS]),
    ("accelerate launch train.py model=hf_causal_lm", {}, [*TINY_HF, *STEPS]),
    ("accelerate launch train.py model=hf_causal_lm data=jsonl objective=causal_lm", {}, [*TINY_HF, *STEPS]),
    ("accelerate launch train.py model=hf_causal_lm data=hf_dataset data.path=data/shakespeare_speeches.jsonl "
     "data.packing=true objective=causal_lm hydra.run.dir=outputs/packed", {}, [*TINY_HF, *STEPS]),
    ("python eval.py path=outputs/packed/model +data.packing=false", {}, []),
    ("accelerate launch train.py model.n_layer=6 optimizer.lr=6e-4 trainer.max_steps=5000", {}, [*TINY, *STEPS]),
    ("accelerate launch train.py experiment=cifar10_resnet data.root=/data/cifar-10-batches-bin",
     {"/data/cifar-10-batches-bin": "{cifar}"}, [*STEPS, "data.batch_size=8"]),
    ("python scripts/prepare_tokens.py data/tinyshakespeare.txt data/shakespeare.bin", {}, []),
    ("accelerate launch train.py data=tokens data.path=data/shakespeare.bin data.vocab_size=256", {}, [*TINY, *STEPS]),
    ("python scripts/prepare_data.py data/shakespeare_speeches.jsonl data/speeches_shards --workers 2 "
     "--val-fraction 0.1", {}, []),
    ("accelerate launch train.py data=shards data.path=data/speeches_shards", {}, [*TINY, *STEPS]),
    ("accelerate launch train.py data=shards data.path=data/speeches_shards data.packing=true", {}, [*TINY, *STEPS]),
    ("python scripts/prepare_data.py data/tinyshakespeare.txt data/play_shards --val-fraction 0.1", {}, []),
    ("accelerate launch train.py data=shards 'data.sources=[{path: data/speeches_shards, weight: 3}, "
     "{path: data/play_shards, weight: 1}]' data.samples_per_epoch=100000", {}, [*TINY, *STEPS]),
    ("python scripts/prepare_data.py --cifar10 data/cifar-10-batches-bin data/cifar10_shards",
     {"data/cifar-10-batches-bin": "{cifar}"}, []),
    ("accelerate launch train.py experiment=cifar10_resnet data.root=data/cifar10_shards", {},
     [*STEPS, "data.batch_size=8"]),
    ("accelerate launch train.py data=prompts objective=grpo", {}, [*TINY, *STEPS, "objective.max_completion_tokens=4",
                                                                   "objective.num_generations=2", "data.batch_size=2"]),
    ("accelerate launch train.py data=stream data.path=data/shakespeare_speeches.jsonl trainer.max_steps=100", {},
     [*TINY, *STEPS]),
    ("python scripts/prepare_data.py HuggingFaceFW/fineweb-edu data/fineweb_edu --subset sample-10BT --tokenizer gpt2 "
     "--workers 32 --tasks 64", {**FINEWEB_HERE, "--workers 32 ": "--workers 2 "}, []),
    ("accelerate launch train.py experiment=fineweb_gpt2 trainer.gradient_accumulation_steps=8",
     {"accumulation_steps=8": "accumulation_steps=2"}, [*TINY, *STEPS, "data.batch_size=4", "trainer.compile=false"]),
    ("accelerate launch train.py experiment=nanogpt_shakespeare_char optimizer=muon", {}, [*STEPS]),
    ("accelerate launch train.py hydra.run.dir=outputs/my_run resume=auto", {}, [*TINY, *STEPS]),
    ("accelerate launch train.py resume=outputs/my_run/checkpoints/step_00000500 hydra.run.dir=outputs/fork",
     {"step_00000500": "step_00000002"}, [*TINY, *STEPS, "trainer.max_steps=3"]),
    ("accelerate launch train.py hydra.run.dir=outputs/my_run resume=outputs/my_run/checkpoints/step_00001000 "
     "'trainer.skip_steps=[[1001,1300]]'", {"step_00001000": "step_00000002", "[[1001,1300]]": "[[3,4]]"},
     [*TINY, *STEPS, "trainer.max_steps=4"]),
    ("accelerate launch train.py scheduler=wsd trainer.max_steps=10000 trainer.checkpoint_every=1000 "
     "hydra.run.dir=outputs/wsd", {"max_steps=10000": "max_steps=10", "checkpoint_every=1000": "checkpoint_every=5"},
     [*TINY, *WSD_STEPS]),
    ("accelerate launch train.py scheduler=wsd trainer.max_steps=20000 resume=outputs/wsd/checkpoints/step_00008000 "
     "hydra.run.dir=outputs/wsd_20000", {"max_steps=20000": "max_steps=12", "step_00008000": "step_00000008"},
     [*TINY, *WSD_STEPS]),
    ("accelerate launch train.py scheduler=wsd trainer.max_steps=6000 scheduler.decay_steps=1000 "
     "resume=outputs/wsd/checkpoints/step_00005000 hydra.run.dir=outputs/wsd_5000",
     {"max_steps=6000": "max_steps=6", "decay_steps=1000": "decay_steps=1", "step_00005000": "step_00000005"},
     [*TINY, *WSD_STEPS]),
    ("accelerate launch train.py data=shards data.path=data/play_shards scheduler=wsd trainer.max_steps=10000 "
     "hydra.run.dir=outputs/plays", {"max_steps=10000": "max_steps=10"}, [*TINY, *WSD_STEPS]),
    ("accelerate launch train.py data=shards data.path=data/speeches_shards trainer.resume_with_changed_data=true "
     "resume=outputs/plays/checkpoints/step_00008000 hydra.run.dir=outputs/plays_decayed_on_speeches",
     {"step_00008000": "step_00000008"}, [*TINY, *WSD_STEPS]),
    ("accelerate launch --multi_gpu --num_processes 2 train.py hydra.run.dir=outputs/run data.batch_size=4",
     {}, [*TINY, *STEPS]),
    ("accelerate launch train.py hydra.run.dir=outputs/run data.batch_size=4 trainer.gradient_accumulation_steps=2 "
     "resume=auto", {}, [*TINY, *STEPS, "trainer.max_steps=3"]),
    ("accelerate launch train.py hydra.run.dir=outputs/run data.batch_size=6 "
     "trainer.resume_with_new_global_batch=true resume=auto", {}, [*TINY, *STEPS, "trainer.max_steps=4"]),
    ("accelerate launch train.py model.n_layer=6 optimizer.lr=6e-4 trainer.max_steps=5000 hydra.run.dir=outputs/teacher",
     {}, [*TINY, *STEPS]),
    ("accelerate launch train.py objective=distill objective.teacher=outputs/teacher/model model.n_layer=2 "
     "hydra.run.dir=outputs/student", {}, [*TINY, *STEPS]),
    ("python eval.py path=outputs/RUN/model", {"RUN": "my_run"}, []),
    ("accelerate launch --multi_gpu --num_processes 2 eval.py path=outputs/RUN/checkpoints/step_00000500 "
     "+data.batch_size=256", {"RUN": "my_run", "step_00000500": "step_00000002"}, []),
    ("accelerate launch train.py trainer.sample_every=500 'trainer.sample_prompts=[ROMEO:,JULIET:]'",
     {"sample_every=500": "sample_every=2"}, [*TINY, *STEPS, "trainer.sample_tokens=10"]),
    ("python sample.py outputs/RUN/model --prompt \"ROMEO:\" --num-samples 3", {"RUN": "my_run"}, []),
    ("python scripts/export_hf.py outputs/RUN/model outputs/RUN/model_hf", {"RUN": "my_run"}, []),
    ("accelerate launch train.py 'trainer.eval_tasks=[data/eval_tasks/shakespeare_cloze.yaml,"
     "data/eval_tasks/shakespeare_perplexity.yaml]' trainer.eval_tasks_every=500 "
     "trainer.monitor=eval_tasks/shakespeare_cloze/acc trainer.monitor_mode=max",
     {"eval_tasks_every=500": "eval_tasks_every=1"}, [*TINY, *STEPS, "trainer.eval_tasks_limit=8"]),
    ("python train.py -m optimizer.lr=1e-3,3e-4 model.n_layer=4,6 trainer.max_steps=500",
     {"trainer.max_steps=500": "trainer.max_steps=2"}, [*TINY, "trainer.eval_batches=1"]),
    ("python train.py -m hparams_search=optuna hydra.sweeper.n_trials=20 trainer.max_steps=500",
     {"n_trials=20": "n_trials=2", "trainer.max_steps=500": "trainer.max_steps=2"}, [*TINY, "trainer.eval_batches=1"]),
    ("accelerate launch --num_processes 2 train.py", {}, [*TINY, *STEPS]),  # one process, and the warning that says so
    ("python -m src.schema", {}, []),
    ("python -m src.schema model", {}, []),
    ("python -m src.schema src.models.gpt.GPT", {}, []),
    ("python -m src.schema src.optim.optimizers.adamw", {}, []),
    ("python -m src.schema --markdown src.schema.trainer.TrainerConfig trainer.", {}, []),
    ("python scripts/env_check.py [--json]", {"[--json]": "--json"}, []),
    ("python scripts/make_synthetic_cifar10.py data/cifar-10-batches-bin", {}, []),
    ("python train.py hydra/launcher=submitit_slurm --cfg hydra -p hydra.launcher", {}, []),
]
# On the local SLURM cluster (scripts/local_slurm.sh): nodes with one CPU and no GPU, as a user overrides.
RUN_ON_SLURM = [
    ("sbatch slurm/train_single_node.sbatch experiment=cifar10_resnet data.root=/data/cifar-10-batches-bin",
     {"/data/cifar-10-batches-bin": "{cifar}"}, [*STEPS, "data.batch_size=8"]),
    ("sbatch slurm/train_multi_node.sbatch model=gpt trainer.max_steps=1000 hydra.run.dir=/scratch/x",
     {"/scratch/x": "outputs/scratch_x"}, [*TINY, *STEPS]),
    ("sbatch --nodes=4 --time=48:00:00 slurm/train_multi_node.sbatch experiment=owt_tokens "
     "data.path=/data/owt/train.bin", {"--nodes=4": "--nodes=2", "/data/owt/train.bin": "data/shakespeare.bin"},
     [*TINY, *STEPS, "data.batch_size=4", "trainer.compile=false"]),  # no C++ compiler needed
    ("sbatch --array=0-3 slurm/prepare_data.sbatch HuggingFaceFW/fineweb-edu data/fineweb_edu --subset sample-10BT "
     "--tokenizer gpt2 --tasks 64", {**FINEWEB_HERE, "--array=0-3": "--array=0-1"}, []),
    ("sbatch --nodes=2 slurm/train_multi_node.sbatch experiment=fineweb_gpt2 data.batch_size=32",
     {"data.batch_size=32": "data.batch_size=4"}, [*TINY, *STEPS, "trainer.compile=false"]),
    ("python train.py -m hydra/launcher=submitit_slurm hydra.launcher.nodes=2 hydra.launcher.gpus_per_node=8 "
     "hydra.launcher.timeout_min=600 optimizer.lr=1e-3,3e-4", {"gpus_per_node=8": "gpus_per_node=null"},
     [*TINY, *STEPS]),
]
ELIDED = "a command cut short (...) or a placeholder: the commands it stands for are run above"
IN_PROSE = "a command or flag named in a sentence, not a command to type; what it refers to runs above"
WALKTHROUGH_FILE = "the bring-your-own walkthrough's file: tests/test_readme_example.py writes and runs it verbatim"
PREFERENCE_WALKTHROUGH = ("the preference-tuning walkthrough (SFT, then DPO, a reward model and GRPO against it): "
                          "tests/test_readme_example.py follows it verbatim")
GSM8K_RECIPE = ("the GSM8K recipe reads Qwen2.5-0.5B-Instruct and openai/gsm8k from the hub (not reachable here): "
                "tests/test_grpo.py runs experiment=grpo_gsm8k on a local folder of its form with a tiny chat model")
NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt -r requirements-extras.txt "
    "&& python -m pytest tests": "the suite itself: .ci/run runs it verbatim (checked below)",
    "python -m pytest tests": "the suite itself (.ci/run)",
    "python -m pytest tests -m slow": "the slow tests, this one among them: .ci/run runs them after the suite",
    "python -m pytest tests -m gpu": "needs a CUDA GPU (docs/development.md says when they last ran)",
    "pip install -r requirements-extras.txt": "part of the README's test command, which .ci/run runs",
    "pip install lm_eval": "in requirements-extras.txt, which the README's test command installs",
    "tensorboard --logdir outputs": "a server that runs until stopped; the tests read the event files it shows "
                                    "(conftest.scalars)",
    "python scripts/benchmark.py NAME": "each benchmark takes minutes: tests/test_benchmarks.py runs their logic on "
                                        "a small scale; figures are in scripts/BENCHMARKS.md",
    "python scripts/benchmark.py scale": "minutes at the sizes that matter: tests/test_benchmarks.py covers its "
                                         "logic; figures in scripts/BENCHMARKS.md",
    "python sample.py gpt2 --prompt \"Hello,\"": "downloads from the Hugging Face hub (no network here); "
                                                "sample.py runs on exports above",
    "hf download NAME": "downloads from the Hugging Face hub (no network here)",
    "hf download": IN_PROSE,
    "scancel --signal=USR1 <job>": "needs a job of the user's: tests/test_slurm.py sends USR1 to its own jobs",
    "sbatch slurm/train_multi_node.sbatch hydra.run.dir=outputs/slurm-1234 ...": ELIDED,
    "python train.py -m hydra/launcher=submitit_slurm ...": ELIDED,
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300 accelerate launch ...": ELIDED,
    "python train.py ...": ELIDED,
    "python train.py -m": IN_PROSE,
    "accelerate launch": IN_PROSE,
    "accelerate config": "interactive (it asks); the configs it writes are config/accelerate/*.yaml, run above",
    "accelerate launch --num_processes N": IN_PROSE,
    "accelerate launch --mixed_precision bf16": IN_PROSE,
    "srun --kill-on-bad-exit=1": IN_PROSE,
    "python block: from typing import Annotated": WALKTHROUGH_FILE,
    "python block: import csv": WALKTHROUGH_FILE,
    "python block: import torch": WALKTHROUGH_FILE,
    "python block: from src.checkpointing.export import load_exported_model":
        "outputs/RUN/model stands for a run's export: tests/test_training.py loads exports with it",
    "accelerate launch train.py model=mlp data=csv objective=mse trainer.max_steps=300 hydra.run.dir=outputs/mlp":
        "tests/test_readme_example.py runs it verbatim, with the example's files",
    "accelerate launch --multi_gpu --num_processes 2 train.py model=mlp data=csv objective=mse trainer.max_steps=300 "
    "hydra.run.dir=outputs/mlp_ddp": "tests/test_readme_example.py runs it verbatim, with the example's files",
    "accelerate launch --config_file config/accelerate/single_gpu.yaml train.py": "needs a CUDA GPU",
    "accelerate launch --config_file config/accelerate/multi_gpu.yaml train.py": "needs CUDA GPUs",
    "accelerate launch --config_file config/accelerate/fsdp.yaml train.py": "needs CUDA GPUs",
    "accelerate launch --config_file config/accelerate/multi_gpu.yaml train.py experiment=fineweb_gpt2":
        "needs CUDA GPUs; the same experiment runs above on one CPU process and on two SLURM nodes",
    "sbatch slurm/train_multi_node.sbatch ...": "a pointer to the SLURM section, whose commands run here",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=gpt2 data=jsonl objective=causal_lm "
    "optimizer.lr=5e-5": "downloads from the Hugging Face hub (no network here); tests/test_finetune.py runs a "
                         "small model's id from the hub's cache",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=/models/gpt2 data=jsonl objective=causal_lm "
    "optimizer.lr=5e-5": "needs a downloaded model; tests/test_finetune.py runs it with a small pretrained folder",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=Qwen/Qwen2.5-0.5B model.block_size=512 data=jsonl "
    "data.path=pairs.jsonl data.prompt_key=prompt data.text_key=completion objective=causal_lm "
    "trainer.eval_on_start=true": "downloads from the Hugging Face hub (no network here); tests/test_finetune.py "
                                  "instruction-tunes a small pretrained folder",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/RUN/model data=jsonl objective=causal_lm":
        "tests/test_finetune.py fine-tunes one run's export in another",
    "accelerate launch train.py model=hf_causal_lm data=hf_dataset data.path=corpus.parquet "
    "data.packing=cross_document objective=causal_lm":
        "needs a dataset of the user's; tests/test_hf_dataset.py trains on Parquet it writes",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=gpt2 data=hf_dataset data.path=Salesforce/wikitext "
    "data.subset=wikitext-2-raw-v1 data.val_split=validation data.packing=true objective=causal_lm":
        "downloads from the Hugging Face hub (no network here); tests/test_hf_dataset.py reads a dataset's subset "
        "from the hub's cache",
    "python scripts/make_tiny_pretrained.py outputs/tiny_gpt2": "the fine-tuning walkthrough: "
                                                                "tests/test_readme_example.py follows it verbatim",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/tiny_gpt2 data=jsonl objective=causal_lm "
    "'model.peft={peft_type: LORA, r: 8, lora_alpha: 16, target_modules: [c_attn]}' optimizer.lr=3e-3 "
    "trainer.max_steps=100 trainer.sample_every=50 'trainer.sample_prompts=[ROMEO:]' hydra.run.dir=outputs/lora":
        "the fine-tuning walkthrough: tests/test_readme_example.py follows it verbatim",
    'python sample.py outputs/lora/model --prompt "ROMEO:" --tokens 50':
        "the fine-tuning walkthrough: tests/test_readme_example.py follows it verbatim",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/tiny_gpt2 model.block_size=256 "
    "data=jsonl data.path=data/shakespeare_dialogues.jsonl data.text_key=messages objective=causal_lm "
    "trainer.max_steps=50 scheduler.warmup_steps=10 hydra.run.dir=outputs/chat":
        "the fine-tuning walkthrough: tests/test_readme_example.py follows it verbatim",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/tiny_gpt2 model.block_size=256 "
    "data=mixture 'data.sources=[{path: data/shakespeare_speeches.jsonl, weight: 3}, {path: "
    "data/shakespeare_dialogues.jsonl, text_column: messages, weight: 1}]' objective=causal_lm trainer.max_steps=30 "
    "hydra.run.dir=outputs/mixture": "the fine-tuning walkthrough: tests/test_readme_example.py follows it verbatim",
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/tiny_gpt2 model.block_size=128 data=jsonl "
    "data.path=data/shakespeare_pairs.jsonl data.prompt_key=prompt data.text_key=chosen objective=causal_lm "
    "optimizer.lr=1e-3 trainer.max_steps=100 hydra.run.dir=outputs/sft": PREFERENCE_WALKTHROUGH,
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/sft/model model.block_size=128 data=jsonl "
    "data.path=data/shakespeare_pairs.jsonl data.preference=true objective=dpo 'model.peft={peft_type: LORA, r: 8, "
    "lora_alpha: 16, target_modules: [c_attn]}' data.batch_size=16 optimizer.lr=1e-3 trainer.max_steps=60 "
    "trainer.eval_every=20 trainer.eval_on_start=true trainer.monitor=eval/rewards/accuracies "
    "trainer.monitor_mode=max hydra.run.dir=outputs/dpo": PREFERENCE_WALKTHROUGH,
    "python eval.py path=outputs/dpo/model": PREFERENCE_WALKTHROUGH,
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/sft/model model.block_size=128 "
    "model.head=reward data=jsonl data.path=data/shakespeare_pairs.jsonl data.preference=true objective=reward "
    "optimizer.lr=1e-3 trainer.max_steps=40 trainer.eval_every=20 trainer.monitor=eval/rewards/accuracies "
    "trainer.monitor_mode=max hydra.run.dir=outputs/reward": PREFERENCE_WALKTHROUGH,
    "python eval.py path=outputs/reward/model": PREFERENCE_WALKTHROUGH,
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/sft/model model.block_size=128 "
    "data=prompts data.path=data/shakespeare_pairs.jsonl objective=grpo objective.reward=null "
    "objective.reward_model=outputs/reward/model objective.max_completion_tokens=48 data.batch_size=8 "
    "optimizer.lr=1e-3 trainer.max_steps=40 trainer.eval_every=20 trainer.eval_on_start=true trainer.eval_batches=4 "
    "hydra.run.dir=outputs/grpo": PREFERENCE_WALKTHROUGH,
    "python eval.py path=outputs/grpo/model eval_batches=4": PREFERENCE_WALKTHROUGH,
    "accelerate launch train.py experiment=grpo_gsm8k": GSM8K_RECIPE,
    "accelerate launch --config_file config/accelerate/multi_gpu.yaml train.py experiment=grpo_gsm8k": GSM8K_RECIPE,
    "python scripts/prepare_data.py data/shakespeare_pairs.jsonl data/pairs_shards --preference --tokenizer "
    "outputs/sft/model --workers 2 --val-fraction 0.1": PREFERENCE_WALKTHROUGH,
    "accelerate launch train.py model=hf_causal_lm model.pretrained=outputs/sft/model model.block_size=128 "
    "data=shards data.path=data/pairs_shards data.preference=true data.packing=true objective=dpo "
    "'model.peft={peft_type: LORA, r: 8, lora_alpha: 16, target_modules: [c_attn]}' data.batch_size=16 optimizer.lr=1e-3 trainer.max_steps=60 "
    "trainer.eval_every=20 trainer.eval_on_start=true hydra.run.dir=outputs/dpo_shards": PREFERENCE_WALKTHROUGH,
    "accelerate launch train.py model=hf_causal_lm model.pretrained=/models/gpt2 'model.peft={peft_type: LORA, r: 8, "
    "lora_alpha: 16, target_modules: [c_attn]}'": "needs a downloaded model; tests/test_finetune.py trains LoRA on a "
                                                  "small pretrained folder",
}


# A command in inline code (prose or a table cell): what a user could type at a shell prompt.
INLINE_COMMAND = re.compile(r"`((?:[A-Z_]+=\S+ )?(?:accelerate|python3?|torchrun|sbatch|srun|scancel|squeue|"
                            r"tensorboard|pip|hf) [^`]*)`")


def readme_commands() -> list[str]:
    """Each line of each bash block (comments dropped), each command in inline code (prose and tables), and each
    python block by its first line."""
    commands = []
    for page in (README, *DOCS.values()):
        for block in re.findall(r"```bash\n(.*?)```", page, flags=re.S):
            commands += [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.strip()]
        prose = re.sub(r"```.*?```", "", page, flags=re.S)
        commands += [" ".join(command.split()) for command in INLINE_COMMAND.findall(prose)]
        commands += [f"python block: {block.splitlines()[0]}"
                     for block in re.findall(r"```python\n(.*?)```", page, flags=re.S)]
    return commands


def shell_command(readme: str, replace: dict, extra: list[str], cifar) -> str:
    command = readme
    for old, new in replace.items():
        assert old in command, f"{old!r} is not in {readme!r}"
        command = command.replace(old, new.format(cifar=cifar))
    return " ".join([command, *extra])


def test_every_readme_command_is_run_or_listed_with_the_reason_it_is_not():
    listed = [c for c, _, _ in RUN + RUN_ON_SLURM] + list(NOT_RUN)
    found = readme_commands()
    assert sorted(set(found) - set(listed)) == [], "documented commands that this test neither runs nor lists"
    assert sorted(set(listed) - set(found)) == [], "listed here but no longer in the README"
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in NOT_RUN if c.endswith("python -m pytest tests"))
    assert any(line.startswith(test_command) for line in ci.splitlines()), \
        ".ci/run must run the README's test command verbatim (not in a comment)"


def test_the_readme_first_run_prints_no_warning_a_user_must_learn_to_ignore(tmp_path):
    """The set-up's training command, as written (shortened), on a machine without `accelerate config` answers:
    no launcher block of assumed defaults, no notice per save of the tied embedding, no warning at all."""
    first = re.search(r"```bash\n(.*?)\n```", README, flags=re.S).group(1)
    assert first.startswith(SETUP), first
    short = ["trainer.eval_every=2", "trainer.checkpoint_every=2", "scheduler.warmup_steps=1"]  # no warnings of
    # their own about a run shorter than its intervals
    command = " ".join([first.removeprefix(SETUP), *TINY, *STEPS, *short, f"hydra.run.dir={tmp_path / 'run'}"])
    proc = shell(command, ROOT)  # with no `accelerate config` answers: conftest points HF_HOME at an empty folder
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "exported the final model" in proc.stdout, proc.stdout[-3000:]
    noise = [line for line in proc.stdout.splitlines() if re.search(r"warn|were not passed|removed shared", line, re.I)]
    assert noise == [], proc.stdout[-3000:]


@pytest.fixture(scope="module")
def repo(tmp_path_factory, cifar_root):
    """A copy of the repository the commands run in (what they write stays out of this checkout)."""
    return copy_of_repo(tmp_path_factory.mktemp("readme") / "repo")


def run_in(repo, command: str, timeout: int = 300) -> str:
    proc = shell(command, repo, timeout)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout, f"{command}\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_readme_commands_run_and_its_launchers_train_identically(repo, cifar_root):
    pytest.importorskip("transformers", reason="optional: pip install -r requirements-extras.txt")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="optional: pip install -r requirements-extras.txt")
    outputs, done, launched = repo / "outputs", set(), {}
    for readme, replace, extra in RUN:
        command = shell_command(readme, replace, extra, cifar_root)
        if command in done:  # the set-up's training command is also the Launching table's first
            continue
        before = set(outputs.glob("*"))
        output = run_in(repo, command)
        done.add(command)
        if "resume=outputs/" in command or "resume=auto" in command and "outputs/run " in command:
            assert "resumed from" in output, output[-3000:]
        if readme in LAUNCHERS:
            assert "DistributedType.MULTI_CPU" in output, output[-3000:]
            (launched[readme],) = set(outputs.glob("*")) - before  # every rank in the same run dir
    assert (outputs / "fork" / "model").is_dir() and (outputs / "run" / "model").is_dir()
    assert (outputs / "my_run" / "model" / "eval_metrics.json").is_file()
    assert (outputs / "my_run" / "checkpoints" / "step_00000002" / "eval_metrics.json").is_file()
    first, *others = (launched[readme] for readme in LAUNCHERS)
    for other in others:
        assert max_abs_diff(exported_weights(first), exported_weights(other)) == 0
        assert scalars(first, "train/loss") == scalars(other, "train/loss")


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.skipif(not cluster_is_up(), reason="no SLURM cluster here (start one: scripts/local_slurm.sh start)")
def test_the_readme_slurm_commands_run(repo, cifar_root):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="optional: pip install -r requirements-extras.txt")
    if not (repo / "data" / "shakespeare.bin").is_file():  # made by a README command in the test above
        run_in(repo, "python scripts/prepare_tokens.py data/tinyshakespeare.txt data/shakespeare.bin")
    for readme, replace, extra in RUN_ON_SLURM:
        command = shell_command(readme, replace, extra, cifar_root)
        if command.startswith("sbatch"):
            sbatch = f"sbatch --parsable --wait {' '.join(CPU_NODES)} --output=slurm-%j.out"
            output = run_in(repo, command.replace("sbatch", sbatch, 1))
            job = output.strip().splitlines()[0].split(";")[0]
            assert job_field(job, "JobState") == "COMPLETED", (repo / f"slurm-{job}.out").read_text()[-3000:]
        else:
            run_in(repo, command, timeout=240)
