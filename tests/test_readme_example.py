"""The documentation's walkthroughs (docs/bring-your-own.md, docs/fine-tuning.md), followed verbatim in a copy of the repository: "bring your own model, data and
loss" (new files only; trains on 1 and 2 processes, exports, reloads) and fine-tuning with LoRA (a tiny
pretrained folder, an adapter trained on local documents, samples from the export)."""

import json
import math
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, copy_of_repo, named, scalars, shell, tracked_files, user_env

DOCS = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def blocks(marker: str) -> list[tuple[str, str]]:
    """(marker argument, code) of every fenced block right after `<!-- marker[: argument] -->`."""
    pattern = rf"<!-- {marker}(?:: (\S+))? -->\n```\w*\n(.*?)```"
    return re.findall(pattern, DOCS, flags=re.S)


@pytest.mark.slow
def test_readme_example_adds_only_new_files_trains_on_one_and_two_processes_exports_and_reloads(tmp_path):
    files, commands, snippets = blocks("example-file"), blocks("example-run"), blocks("example-python")
    assert len(files) == 4 and len(commands) == 1 and len(snippets) == 1
    tracked = tracked_files()
    assert not [name for name, _ in files if name in tracked], "the example must add files, not edit ours"

    repo = copy_of_repo(tmp_path / "repo")  # a copy, so the example never touches this checkout
    for name, code in files:
        (repo / name).write_text(code)
    assert "data/table.csv" in tracked  # the walkthrough's table ships: it runs as written on a fresh clone

    for command in commands[0][1].strip().splitlines():
        proc = shell(command, repo)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}"
    for run_name, nproc in (("mlp", 1), ("mlp_ddp", 2)):
        run_dir = repo / "outputs" / run_name
        assert f"processes                   : {nproc} " in (run_dir / "train.log").read_text()
        eval_loss, eval_mae = scalars(run_dir, "eval/loss"), scalars(run_dir, "eval/mae")
        assert eval_loss[300] < 0.1 and eval_mae[300] < 0.3  # the target's variance is about 3.5
        assert scalars(run_dir, "eval/accuracy") == {}  # accuracy only where it means something

    proc = subprocess.run([sys.executable, "-c", snippets[0][1]], cwd=repo, env=user_env(), text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"tensor\(\[-?\d", proc.stdout), proc.stdout


@pytest.mark.slow
def test_readme_fine_tuning_walkthrough_trains_a_lora_adapter_on_a_pretrained_folder_and_samples_from_it(tmp_path):
    (_, commands), = blocks("finetune-run")
    repo = copy_of_repo(tmp_path / "repo")
    outputs = []
    for command in commands.strip().splitlines():
        proc = shell(command, repo)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}"
        outputs.append(proc.stdout)
    run_dir = repo / "outputs" / "lora"
    losses = scalars(run_dir, "train/loss")
    assert losses[10] < math.log(512) - 1  # the folder's weights: random ones score ln 512 = 6.2
    assert losses[100] < losses[10] - 0.05  # logged every trainer.log_every=10 steps
    log = (run_dir / "train.log").read_text()
    assert "sample 0 at step 50:\nROMEO:" in log and "sample 0 at step 100:\nROMEO:" in log
    assert re.search(r"parameters\s+: [\d,]+ \([\d,]+ trainable, [0-4]\.\d\d%\)", log)  # the adapter only
    assert (run_dir / "model" / "adapter" / "adapter_config.json").is_file()
    assert outputs[-1].startswith("ROMEO:") and len(outputs[-1]) > len("ROMEO:") + 20

    # Then the same folder on multi-turn chats: it trains, on exactly the tokens transformers marks as the assistant's.
    import transformers

    from src.data.jsonl import IGNORE_INDEX, JsonlData

    (_, chat_command), = blocks("chat-run")
    proc = shell(chat_command.strip(), repo)
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = scalars(repo / "outputs" / "chat", "train/loss")
    first, last = min(losses), max(losses)  # logged every trainer.log_every steps
    assert last == 50 and losses[last] < losses[first], losses
    folder, dialogues = repo / "outputs" / "tiny_gpt2", repo / "data" / "shakespeare_dialogues.jsonl"
    data = JsonlData(path=str(dialogues), text_key="messages", tokenizer=str(folder), block_size=256, batch_size=4)
    first = json.loads(dialogues.read_text().splitlines()[0])["messages"]
    expected = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        first, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert data.train[0]["input_ids"].tolist() == expected["input_ids"]
    assert [label != IGNORE_INDEX for label in data.train[0]["labels"].tolist()] == \
        [bool(m) for m in expected["assistant_masks"]]

    # Then both datasets in one run, three speeches to one dialogue: each source's share is said, and it trains.
    (_, mixture_command), = blocks("mixture-run")
    proc = shell(mixture_command.strip(), repo)
    assert proc.returncode == 0, proc.stdout[-3000:]
    named(proc.stdout, "data.sources[0] data/shakespeare_speeches.jsonl: weight 3",
          "data.sources[1] data/shakespeare_dialogues.jsonl: weight 1")
    losses = scalars(repo / "outputs" / "mixture", "train/loss")
    assert max(losses) == 30 and losses[30] < losses[min(losses)], losses


@pytest.mark.slow
def test_readme_preference_walkthrough_tunes_the_tiny_model_then_aligns_it_with_dpo_its_reward_accuracy_rising(
        tmp_path):
    """The fine-tuning walkthrough's tiny folder, tuned on the chosen answers, then DPO on a LoRA adapter whose base
    is the reference: at step 0 every validation pair is a tie, then the margins grow at each evaluation and the
    reward accuracy rises; eval.py scores the export as the run's last evaluation did. Then a reward model, and
    GRPO against it."""
    (_, finetune), = blocks("finetune-run")
    (_, commands), = blocks("preference-run")
    repo = copy_of_repo(tmp_path / "repo")
    outputs = []
    for command in [finetune.strip().splitlines()[0], *commands.strip().splitlines()]:
        proc = shell(command, repo)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}"
        outputs.append(proc.stdout)
    sft, dpo = repo / "outputs" / "sft", repo / "outputs" / "dpo"
    losses = scalars(sft, "train/loss")
    assert losses[max(losses)] < losses[min(losses)]
    named(outputs[2], "objective.reference=adapter")
    accuracy, margins = scalars(dpo, "eval/rewards/accuracies"), scalars(dpo, "eval/rewards/margins")
    assert sorted(accuracy) == [0, 20, 40, 60] and accuracy[0] == 0 and margins[0] == 0
    assert margins[0] < margins[20] < margins[40] < margins[60] and accuracy[60] > 0.9
    scored = json.loads((dpo / "model" / "eval_metrics.json").read_text())
    assert scored["eval/rewards/margins"] == pytest.approx(margins[60], abs=1e-5)
    # The same DPO on the pairs prepared once into shards with the SFT model's tokenizer.
    (_, on_shards), = blocks("preference-shards-run")
    for command in on_shards.strip().splitlines():
        proc = shell(command, repo)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}"
    accuracy, margins = (scalars(repo / "outputs" / "dpo_shards", f"eval/rewards/{name}")
                         for name in ("accuracies", "margins"))
    assert accuracy[0] == 0 and margins[0] == 0 and margins[0] < margins[20] < margins[40] < margins[60]
    assert accuracy[60] > 0.75  # other validation pairs than the jsonl run's: 57 held out by hash
    # A reward model on the same pairs, from the SFT model, exported as a sequence classifier eval.py reads back.
    (_, reward_commands), = blocks("reward-run")
    for command in reward_commands.strip().splitlines():
        proc = shell(command, repo)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}"
    reward = repo / "outputs" / "reward"
    accuracy, loss = scalars(reward, "eval/rewards/accuracies"), scalars(reward, "eval/loss")
    assert sorted(accuracy) == [20, 40] and accuracy[40] > 0.55 and loss[40] < min(loss[20], 0.6931)
    assert json.loads((reward / "model" / "config.json").read_text())["architectures"] == [
        "GPT2ForSequenceClassification"]
    scored = json.loads((reward / "model" / "eval_metrics.json").read_text())
    assert scored["eval/rewards/accuracies"] == pytest.approx(accuracy[40], abs=1e-5)
    # GRPO from the SFT model against that reward model alone: its score of the completions rises; eval.py draws
    # the run's evaluation completions again and scores them as the run's last evaluation did.
    (_, grpo_commands), = blocks("grpo-run")
    for command in grpo_commands.strip().splitlines():
        proc = shell(command, repo)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}"
    grpo = repo / "outputs" / "grpo"
    reward = scalars(grpo, "eval/reward")
    assert sorted(reward) == [0, 20, 40] and reward[0] < reward[20] < reward[40], reward
    scored = json.loads((grpo / "model" / "eval_metrics.json").read_text())
    assert scored["eval/reward"] == pytest.approx(reward[40], abs=1e-5)
