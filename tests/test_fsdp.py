"""FSDP2: train.py under accelerate's FSDP plugin, as `accelerate launch --config_file config/accelerate/fsdp.yaml`.

Without GPUs the plugin runs on CPU processes over gloo through tests/fsdp_on_cpu.py, which lifts only
accelerate's GPU check: the sharding (fully_shard), the sharded checkpoints (torch.distributed.checkpoint) and
their resharding on load, and the gathered export are the plugin's own code. tests/fsdp_paths.py checks our
code on weights sharded by hand with torch's fully_shard. With a GPU, the gpu-marked test runs the plugin as a
user does.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from src.checkpointing.export import load_exported_model
from src.launch.memory import gib
from tests.conftest import (
    FSDP_ON_CPU,
    GPU_ENV,
    GPUS,
    PRETRAINED_VOCAB,
    QUIET,
    TINY_GPT,
    banner_row,
    exported_weights,
    kill_when,
    launch_command,
    max_abs_diff,
    named,
    run,
    scalars,
)
from tests.test_no_pickles import plain_files_only

# Global batch 16: 4 samples x 2 processes x 2 micro-steps; sharded checkpoints at steps 4, 8 and 12.
ARGS = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.gradient_accumulation_steps=2", "trainer.max_steps=12",
        "trainer.checkpoint_every=4", "trainer.monitor=null", "scheduler.warmup_steps=4"]
# Another layout of the same global batch is the README's promise: the same weights up to float rounding.
LAYOUT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp") / "uninterrupted"
    proc = run([*ARGS, f"hydra.run.dir={run_dir}"], nproc=2, **FSDP_ON_CPU)
    assert banner_row(proc.stdout, "distributed type") == "DistributedType.FSDP"
    # The banner's model state is each rank's shard: fp32 weights and gradients, and AdamW's two moments.
    parameters = int(re.search(r"parameters +: ([\d,]+) ", proc.stdout).group(1).replace(",", ""))
    shard = -(-parameters * 4 // 2)
    assert (f"(sharded over 2 ranks): weights {gib(shard)}, gradients {gib(shard)}, optimizer state "
            f"{gib(2 * shard)}") in proc.stdout, proc.stdout[:3000]
    return run_dir


def max_loss_diff(a: Path, b: Path) -> float:
    expected, got = scalars(a, "train/loss"), scalars(b, "train/loss")
    assert sorted(got) == sorted(expected) == list(range(1, 13))
    return max(abs(got[step] - expected[step]) for step in expected)


def test_fsdp_trains_the_weights_ddp_trains_and_exports_a_loadable_tied_model(tmp_path, fsdp_run):
    ddp = tmp_path / "ddp"
    run([*ARGS, f"hydra.run.dir={ddp}"], nproc=2)
    assert max_loss_diff(ddp, fsdp_run) <= LAYOUT_TOLERANCE
    assert max_abs_diff(exported_weights(ddp), exported_weights(fsdp_run)) <= LAYOUT_TOLERANCE
    model = load_exported_model(fsdp_run / "model")
    assert model.lm_head.weight is model.tok_emb.weight


def test_eval_reads_an_fsdp_checkpoint_whole_on_one_process_as_the_export_holds_it(fsdp_run):
    """eval.py's model of a sharded checkpoint: every rank's shards read into one whole model, no process group."""
    from src.checkpointing.for_eval import load_checkpointed_model, run_config_for

    checkpoint = fsdp_run / "checkpoints" / "step_00000012"
    model = load_checkpointed_model(checkpoint, run_config_for(checkpoint))
    exported = load_exported_model(fsdp_run / "model")
    assert max_abs_diff(model.state_dict(), exported.state_dict()) == 0
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("model", [
    ["model._target_=tests.components.SaysHowItWasBuilt", "model.dropout=0.1"],  # rank 1 draws as rank 0 did
    ["model=hf_causal_lm", "data=jsonl", "objective=causal_lm", "model.block_size=48",  # untied, rotary buffers
     "~model.config", "+model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
     "num_attention_heads: 2, num_key_value_heads: 1, vocab_size: ${dataset:vocab_size}, max_position_embeddings: 48}"],
], ids=["gpt_tied", "llama_from_config"])
def test_a_sharded_start_builds_the_model_on_rank_0_alone_and_trains_the_weights_of_a_whole_copy_per_rank(
        tmp_path, model):
    """Only rank 0 makes the model's values; the others get their shards from it when FSDP wraps the model."""
    base = ARGS if "SaysHowItWasBuilt" in model[0] else [a for a in ARGS if a not in TINY_GPT]
    args = [*base, *model, "trainer.max_steps=3", "trainer.checkpoint_every=0"]
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    *launcher, script = launch_command(FSDP_ON_CPU["script"], 2, "fsdp")
    # accelerate launch's switch off config/accelerate/fsdp.yaml's sharded start: every rank builds the model whole
    whole_copy_per_rank = [*launcher, "--fsdp_cpu_ram_efficient_loading", "false", script]
    launched = {run_dir: run([*args, f"hydra.run.dir={run_dir}"], command=command)
                for run_dir, command in ((whole, whole_copy_per_rank), (sharded, [*launcher, script]))}
    if "SaysHowItWasBuilt" in model[0]:
        assert "rank 1 built with values: True" in launched[whole].stdout
        assert "rank 1 built with values: False" in launched[sharded].stdout
        assert "rank 0 built with values: True" in launched[sharded].stdout
        # The export names the test's own model: trusted here, as the run's command line named it.
        exported = load_exported_model(sharded / "model", trusted=[model[0].split("=")[1]])
        assert exported.lm_head.weight is exported.tok_emb.weight
    assert scalars(whole, "train/loss") == scalars(sharded, "train/loss")
    assert max_abs_diff(exported_weights(whole), exported_weights(sharded)) == 0


def whole_copy_and_sliced(tmp_path: Path, args: list, script: str = FSDP_ON_CPU["script"], env=None,
                          launcher_flags: tuple = ()) -> dict:
    """The same run launched twice under config/accelerate/fsdp.yaml on 2 processes: every rank reading the weights
    whole (`whole`), and the sharded start where each rank reads its own slices (`sliced`); run dir -> output.
    `launcher_flags`: accelerate launch's own, for both."""
    *launcher, script = launch_command(script, 2, "fsdp")
    launcher += launcher_flags
    whole_copy_per_rank = [*launcher, "--fsdp_cpu_ram_efficient_loading", "false", script]
    commands = {tmp_path / "whole": whole_copy_per_rank, tmp_path / "sliced": [*launcher, script]}
    return {run_dir: run([*args, f"hydra.run.dir={run_dir}"], command=command, env=env).stdout
            for run_dir, command in commands.items()}


@pytest.fixture(scope="module")
def llama_in_several_files(tmp_path_factory, pretrained) -> Path:
    """An untied Llama saved in several safetensors files (an index names each weight's), with the tiny GPT-2's
    tokenizer beside it, as a big model on the hub comes; its MLP's 63 rows are split 32 and 31 between 2 ranks."""
    transformers = pytest.importorskip("transformers")
    import shutil

    import torch

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=63, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=PRETRAINED_VOCAB, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("llama") / "llama"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="30KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    for file in pretrained.glob("tokenizer*"):
        shutil.copy(file, folder)
    return folder


@pytest.mark.parametrize("folder, adapter, launcher_flags", [
    pytest.param("pretrained", ["model.peft={peft_type: LORA, r: 4, lora_alpha: 8, target_modules: [c_attn]}"], (),
                 marks=pytest.mark.slow),  # tied; the third case is this one with activation checkpointing
    ("llama_in_several_files", [], ()),
    # accelerate's activation checkpointing renames every layer's weights (_checkpoint_wrapped_module.)
    ("pretrained", ["model.peft={peft_type: LORA, r: 4, lora_alpha: 8, target_modules: [c_attn]}"],
     ("--fsdp_activation_checkpointing", "true")),
], ids=["gpt2_tied_with_lora", "llama_in_several_files", "lora_with_activation_checkpointing"])
def test_a_sharded_start_of_a_pretrained_folder_reads_each_ranks_slices_and_trains_the_weights_of_whole_copies(
        tmp_path, request, folder, adapter, launcher_flags):
    """No rank reads the folder whole, rank 0 neither: each reads its shard's rows of every weight from the files."""
    folder = request.getfixturevalue(folder)
    args = ["model=hf_causal_lm", f"model.pretrained={folder}", "model.block_size=48", "data.batch_size=4", *adapter,
            "optimizer.lr=3e-2", "scheduler.warmup_steps=1", "trainer.max_steps=3", "trainer.checkpoint_every=0",
            *QUIET]
    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    launched = whole_copy_and_sliced(tmp_path, args, launcher_flags=launcher_flags)
    assert "each rank reads its own slices of model.pretrained" in launched[sliced]
    assert "each rank reads its own slices" not in launched[whole]
    assert scalars(whole, "train/loss") == scalars(sliced, "train/loss")
    assert max_abs_diff(exported_weights(whole), exported_weights(sliced)) == 0
    if folder.name == "gpt2_tiny":  # the export of the tied model stores its embedding once, as from_pretrained's
        assert "lm_head.weight" not in exported_weights(sliced)


def test_a_sharded_start_from_another_runs_weights_reads_each_ranks_slices_and_refuses_weights_that_do_not_fit(
        tmp_path, fsdp_run):
    """trainer.init_weights (the template's tied GPT, exported by another run): the same weights as a whole copy
    per rank, with dropout drawing on; weights of another shape are refused, naming them, before any step."""
    source = fsdp_run / "model"
    args = [*ARGS, "model.dropout=0.1", "trainer.max_steps=3", "trainer.checkpoint_every=0",
            f"trainer.init_weights={source}"]
    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    launched = whole_copy_and_sliced(tmp_path, args)
    assert "each rank reads its own slices of trainer.init_weights" in launched[sliced]
    assert scalars(whole, "train/loss") == scalars(sliced, "train/loss")
    assert max_abs_diff(exported_weights(whole), exported_weights(sliced)) == 0
    assert exported_weights(sliced)["tok_emb.weight"].shape == exported_weights(fsdp_run)["tok_emb.weight"].shape

    deeper = tmp_path / "deeper"
    proc = run([*args, "model.n_layer=3", f"hydra.run.dir={deeper}"], nproc=2, check=False, **FSDP_ON_CPU)
    assert proc.returncode != 0 and "step 1/" not in proc.stdout
    named(proc.stdout, f"trainer.init_weights={source}", "blocks.2.")


@pytest.mark.parametrize("writing", [[], ["trainer.async_checkpoint=true"]], ids=["blocking", "in_background"])
def test_a_killed_fsdp_run_resumes_bitwise_from_its_sharded_checkpoint(tmp_path, fsdp_run, writing):
    """In the background, each rank's thread writes its shards (torch.distributed.checkpoint's async_save) while
    training goes on; the checkpoint is the blocking one's, file for file."""
    run_dir = tmp_path / "run"
    args = [*ARGS, *writing, f"hydra.run.dir={run_dir}"]
    kill_when(args, 2, ready=lambda: (run_dir / "checkpoints" / "step_00000008").is_dir(), **FSDP_ON_CPU)
    checkpoint = run_dir / "checkpoints" / "step_00000008"
    for state in ("pytorch_model_fsdp_0", "optimizer_0"):  # one file per process, not a gathered copy, no pickle
        assert {f.name for f in (checkpoint / state).glob("shard-*")} == {"shard-00001-of-00002.safetensors",
                                                                         "shard-00002-of-00002.safetensors"}
    plain_files_only(checkpoint)
    assert not (run_dir / "model").exists()
    proc = run([*args, "resume=auto"], nproc=2, **FSDP_ON_CPU)
    assert "resumed from" in proc.stdout
    assert max_loss_diff(fsdp_run, run_dir) == 0
    assert max_abs_diff(exported_weights(fsdp_run), exported_weights(run_dir)) == 0
    periodic = [line for line in (run_dir / "train.log").read_text().splitlines()
                if "saved checkpoint" in line and "step_00000012" not in line]  # the final save blocks
    assert periodic and all(("written in the background" in line) == bool(writing) for line in periodic), periodic


def test_a_pickle_planted_in_a_sharded_checkpoint_is_refused_at_resume_on_every_rank_and_never_runs(
        tmp_path, fsdp_run):
    """torch.distributed.checkpoint's default files (a pickled .metadata, which torch reads with pickle.load, and
    shards whose non-tensor values it unpickles with weights_only=False) are never written here; one planted in
    their place stops the resume on every rank, naming it, before anything is read."""
    import shutil

    from tests.test_no_pickles import plant

    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(fsdp_run, run_dir)
    optimizer = run_dir / "checkpoints" / "step_00000012" / "optimizer_0"
    plain_files_only(optimizer.parent)
    plant([optimizer / ".metadata"], marker)
    proc = run([*ARGS, "trainer.max_steps=13", "resume=auto", f"hydra.run.dir={run_dir}"], nproc=2, check=False,
               **FSDP_ON_CPU)
    assert proc.returncode != 0 and "step 13/" not in proc.stdout  # torch's launcher reports its ranks' exits
    named(proc.stdout, str(optimizer / ".metadata"), "pickle format")
    assert not marker.exists()


@pytest.mark.parametrize("changed", ["optimizer_0/shard-00002-of-00002.safetensors", "optimizer_0/plain_values.json"])
def test_a_byte_changed_in_any_file_of_a_sharded_checkpoint_is_refused_naming_it(tmp_path, fsdp_run, changed):
    """A shard's tensor bytes (its header intact, so safetensors' own check passes) or the optimizer's plain values
    (still valid JSON): each file has its CRC in checksums.json, which the rank that reads it compares."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run, run_dir)
    file = run_dir / "checkpoints" / "step_00000012" / changed
    data = bytearray(file.read_bytes())
    if file.suffix == ".json":
        at = data.index(b"0.9")  # a beta of AdamW: another number, the same JSON
        data[at:at + 3] = b"0.8"
    else:
        data[-8] ^= 0x01  # inside the last tensor's values
    file.write_bytes(bytes(data))
    proc = run([*ARGS, "trainer.max_steps=13", "resume=auto", f"hydra.run.dir={run_dir}"], nproc=2, check=False,
               **FSDP_ON_CPU)
    assert proc.returncode != 0 and "step 13/" not in proc.stdout
    named(proc.stdout, str(file), "CRC")


def test_an_fsdp_checkpoint_resumes_resharded_on_another_number_of_processes(tmp_path, fsdp_run):
    """Written by 2 processes accumulating 2, read by 4 without accumulation: the same global batch."""
    run_dir = tmp_path / "four"
    proc = run([*ARGS, "trainer.gradient_accumulation_steps=1", f"resume={fsdp_run / 'checkpoints' / 'step_00000004'}",
                f"hydra.run.dir={run_dir}"], nproc=4, **FSDP_ON_CPU)
    assert "processes                   : 4" in proc.stdout and "resumed from" in proc.stdout
    expected, got = scalars(fsdp_run, "train/loss"), scalars(run_dir, "train/loss")
    assert sorted(got) == list(range(5, 13))
    assert max(abs(got[step] - expected[step]) for step in got) <= LAYOUT_TOLERANCE
    assert max_abs_diff(exported_weights(fsdp_run), exported_weights(run_dir)) <= LAYOUT_TOLERANCE


def test_a_transformers_model_under_fsdp_exports_a_folder_from_pretrained_loads_with_its_tied_weights(tmp_path):
    """The same config file for any model: the plugin shards each layer the model lists in _no_split_modules."""
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    run(["model=hf_causal_lm", "data=jsonl", "objective=causal_lm", "model.config.n_layer=2", "model.config.n_embd=32",
         "model.config.n_head=2", "model.block_size=48", *QUIET, "data.batch_size=4", "trainer.max_steps=4",
         f"hydra.run.dir={run_dir}"], nproc=2, **FSDP_ON_CPU)
    assert "lm_head.weight" not in exported_weights(run_dir)  # stored once, as save_pretrained does unsharded
    model = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_lora_under_fsdp_exports_its_adapter_and_the_merged_model_it_makes_and_resumes_from_adapter_shards(
        tmp_path, pretrained):
    """The merged export is built from the gathered weights (a sharded model cannot be deep-copied). Its sharded
    checkpoints hold the adapter alone; a resume reads the base from model.pretrained again, bitwise."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir, resumed = tmp_path / "run", tmp_path / "resumed"
    args = ["model=hf_causal_lm", f"model.pretrained={pretrained}", "model.block_size=48", "data.batch_size=4",
            "model.peft={peft_type: LORA, r: 4, lora_alpha: 8, target_modules: [c_attn]}", "optimizer.lr=3e-2",
            "scheduler.warmup_steps=1", "trainer.max_steps=3", "trainer.checkpoint_every=2", *QUIET]
    run([*args, f"hydra.run.dir={run_dir}"], nproc=2, **FSDP_ON_CPU)
    shards = run_dir / "checkpoints" / "step_00000002" / "pytorch_model_fsdp_0"
    names = set()
    for shard in shards.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as tensors:
            names |= set(tensors.keys())
    assert names and all("lora_" in name for name in names), sorted(names)
    run([*args, f"resume={shards.parent}", f"hydra.run.dir={resumed}"], nproc=2, **FSDP_ON_CPU)
    assert max_abs_diff(exported_weights(resumed), exported_weights(run_dir)) == 0
    before, after = load_file(pretrained / "model.safetensors"), exported_weights(run_dir)
    assert {name for name in before if not torch.equal(before[name], after[name])} == {
        f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)}
    merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model").eval()
    assert merged.lm_head.weight is merged.get_input_embeddings().weight
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    adapted = peft.PeftModel.from_pretrained(base, run_dir / "model" / "adapter").eval()
    ids = torch.randint(0, 320, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits)


@pytest.mark.slow
def test_fsdp_with_the_compiled_step_and_activation_checkpointing_trains_the_eager_weights(tmp_path, fsdp_run):
    run_dir = tmp_path / "compiled"
    run([*ARGS, "trainer.compile=true", "model.gradient_checkpointing=true", f"hydra.run.dir={run_dir}"], nproc=2,
        **FSDP_ON_CPU)
    assert max_loss_diff(fsdp_run, run_dir) <= LAYOUT_TOLERANCE
    # the export's names are the model's own: no compiler prefix (max_abs_diff compares the key sets)
    assert max_abs_diff(exported_weights(fsdp_run), exported_weights(run_dir)) <= LAYOUT_TOLERANCE


def test_a_nonfinite_step_on_sharded_weights_is_skipped_and_holds_the_schedule(tmp_path):
    """Skip mode with a fused AdamW, as on GPUs: the bad step (step 3's two micro-batches) is skipped on the
    device, counted, and the schedule waits; tests/fsdp_paths.py shows such a step leaves the shards unchanged."""
    run_dir = tmp_path / "run"
    run([*ARGS, "model._target_=tests.components.NaNOnCalls", "+model.nan_calls=[5,6]", "trainer.nonfinite=skip",
         "optimizer.fused=true", f"hydra.run.dir={run_dir}"], nproc=2, **FSDP_ON_CPU)
    skipped, lr = scalars(run_dir, "train/skipped_steps"), scalars(run_dir, "train/lr")
    assert (skipped[2], skipped[3], skipped[12]) == (0, 1, 1)
    assert lr[3] == lr[2] < lr[4]  # warm-up paused for the skipped step
    assert all(t.isfinite().all() for t in exported_weights(run_dir).values())


@pytest.mark.parametrize("option, names", [  # the alternatives named: fsdp_run trains with trainer.ema_decay=null
    ("trainer.ema_decay=0.99", ("trainer.ema_decay", "DistributedType.FSDP", "config/accelerate/multi_gpu.yaml",
                                "trainer.ema_decay=null")),
    ("trainer.sample_every=2", ("trainer.sample_every", "python sample.py RUN_DIR/model")),
    ("trainer.auto_micro_batch=true", ("trainer.auto_micro_batch", "DistributedType.FSDP", "data.batch_size",
                                       "trainer.gradient_accumulation_steps", "trainer.auto_micro_batch=false")),
    pytest.param("trainer.eval_tasks=[data/eval_tasks/shakespeare_next_words.yaml]",
                 ("trainer.eval_tasks", "shakespeare_next_words", "lm_eval --model hf"),
                 marks=pytest.mark.skipif(not importlib.util.find_spec("lm_eval"), reason="lm_eval: an extra")),
], ids=["ema", "sampling", "auto_micro_batch", "generation_task"])
def test_what_needs_whole_weights_is_refused_under_fsdp_before_training_naming_the_alternative(
        tmp_path, option, names):
    run_dir = tmp_path / "run"
    proc = run([*ARGS, option, f"hydra.run.dir={run_dir}"], nproc=2, check=False, **FSDP_ON_CPU)
    assert proc.returncode != 0
    named(proc.stdout, *names)
    assert "step 1/" not in proc.stdout and not (run_dir / "checkpoints").exists()


def test_clipping_the_nonfinite_check_the_export_a_teacher_and_generation_work_on_sharded_tied_weights():
    """A distillation teacher's weights are sharded again after each forward (whole logits and chunked). GRPO's
    generation with gather_for_generation all-gathers each module's weights once per rollout, however many tokens
    it writes (without it: again for every token), shards the blocks again at its end and leaves them resharded
    after each forward as before (2 blocks gathered by each forward after it); the same completions either way."""
    proc = run([], script="tests/fsdp_paths.py", nproc=2, launcher="torchrun")
    found = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert found["tied"] and found["weights_equal"], found
    assert found["teacher_sharded_after_its_forward"] == [True, True], found
    gathers, completions = found["grpo_gathers"], found["grpo_completions"]
    # Once each: the two blocks and, the first time, the root (FSDP2 keeps the root's gathered after a forward).
    assert (gathers["True 4"], gathers["True 12"]) == (3, 2), gathers
    assert (gathers["False 4"], gathers["False 12"]) == (4 * 2, 12 * 2), gathers  # each block for every token
    assert all(gathers[f"{gather} {tokens} forward {after}"] == 2 for gather in (True, False) for tokens in (4, 12)
               for after in (1, 2)), gathers
    assert completions["True 4"] == completions["False 4"] and completions["True 12"] == completions["False 12"]


@pytest.mark.parametrize("kind", ["gpt", pytest.param("lora", marks=[pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="optional: pip install -r requirements-extras.txt"),
    pytest.mark.slow])])  # 7 s more for the merge layer by layer; the LoRA export's files are tested by default
def test_the_export_of_sharded_weights_holds_no_whole_copy_on_any_rank_and_writes_the_gathered_files(kind):
    """Each tensor gathered, written and freed in turn (LoRA merged layer by layer): no rank's resident memory
    grows by half the model, where gathering the whole state dict grows rank 0's by the model (twice with the
    adapter merged into a rebuilt copy), which shows that the measure sees a whole copy."""
    proc = run([kind], script="tests/fsdp_export_memory.py", nproc=2, launcher="torchrun")
    found = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert found["same_files"], found
    whole = found["whole_gib"]
    assert all(rank["beyond_gib"] < 0.5 * whole for rank in found["streamed"]), found
    assert found["gathered"][0]["beyond_gib"] > 0.8 * whole, found


@pytest.mark.gpu
def test_fsdp_on_one_gpu_trains_resumes_bitwise_from_a_background_save_and_exports_a_loadable_tied_model(tmp_path):
    """The resumed run's checkpoints are written in the background: its shards are staged from the GPU into pinned
    host memory while the next steps run, so resuming from one proves that copy (the CPU tests stage from host
    memory)."""
    args = [*TINY_GPT, *QUIET, "scheduler=constant", "trainer.checkpoint_every=4", "trainer.mixed_precision=bf16"]
    in_background = ["trainer.async_checkpoint=true", f"hydra.run.dir={tmp_path / 'resumed'}"]
    run([*args, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'whole'}"], launcher="fsdp", env=GPU_ENV)
    run([*args, "trainer.max_steps=4", *in_background], launcher="fsdp", env=GPU_ENV)
    assert "written in the background" in (tmp_path / "resumed" / "train.log").read_text()
    run([*args, "trainer.max_steps=8", "resume=auto", *in_background], launcher="fsdp", env=GPU_ENV)
    assert scalars(tmp_path / "whole", "train/loss") == scalars(tmp_path / "resumed", "train/loss")
    assert max_abs_diff(exported_weights(tmp_path / "whole"), exported_weights(tmp_path / "resumed")) == 0
    model = load_exported_model(tmp_path / "whole" / "model")
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="a sharded start needs 2 ranks, a GPU each (NCCL refuses two on one)")
def test_on_two_gpus_each_rank_reads_its_slices_of_a_pretrained_folder_and_trains_the_weights_of_whole_copies(
        tmp_path, llama_in_several_files):
    """What the CPU test shows over gloo, on GPUs over NCCL as a user launches it (train.py, no CPU shim): each
    rank's rows are read into host memory and reach its GPU through FSDP's own placement."""
    args = ["model=hf_causal_lm", f"model.pretrained={llama_in_several_files}", "model.block_size=48",
            "data.batch_size=4", "optimizer.lr=3e-2", "scheduler.warmup_steps=1", "trainer.max_steps=3",
            "trainer.checkpoint_every=0", "trainer.deterministic=true", *QUIET]
    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    launched = whole_copy_and_sliced(tmp_path, args, script="train.py", env=GPU_ENV)
    assert "each rank reads its own slices of model.pretrained" in launched[sliced]
    assert banner_row(launched[sliced], "distributed type") == "DistributedType.FSDP"
    assert scalars(whole, "train/loss") == scalars(sliced, "train/loss")
    assert max_abs_diff(exported_weights(whole), exported_weights(sliced)) == 0
