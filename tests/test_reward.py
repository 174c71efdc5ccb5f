"""objective=reward with model.head=reward: a reward model on preference pairs (TRL's RewardTrainer's loss), its
reward the value at each answer's last token, padded or packed; exact on any layout; a transformers one exported
as the sequence classifier other tools read, and read back by eval.py."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from src.errors import UsageError
from tests.conftest import FSDP_ON_CPU, QUIET, named, run, scalars
from tests.test_config import compose_train
from tests.test_preference import LORA, PAIRS_FILE, shipped_pairs

PAIRS = ["data=jsonl", f"data.path={PAIRS_FILE}", "data.preference=true", "objective=reward", "model.head=reward"]
GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=256", "model.dropout=0.0"]


def reward_batches():
    """Eight of the shipped pairs, byte-tokenized, padded and packed, and a GPT with a reward head."""
    from src.data.preference import Pairs, collate_pairs, pack_pairs, tokenized_pairs
    from src.data.tokenizer import codec_for
    from src.models.gpt import GPT as Model

    codec = codec_for("byte")
    rows = shipped_pairs(8, codec, block_size=128)
    samples = list(Pairs(tokenized_pairs(codec, {k: [row[k] for row in rows] for k in rows[0]}, 128, "truncate")[0]))
    torch.manual_seed(0)
    model = Model(vocab_size=codec.vocab_size, block_size=256, n_layer=2, n_head=2, n_embd=32, head="reward")
    return collate_pairs(samples), pack_pairs(samples, block_size=256), model


def inputs_of(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "labels"}  # the loop gives the labels apart


def test_the_reward_is_the_value_at_each_answers_last_token_and_the_loss_bradley_terrys():
    """Padded and packed, each row's reward is the model's value after reading its prompt and whole answer, as a
    row alone gives it; the loss per pair is -log sigmoid(chosen - rejected) + c (chosen + rejected)²."""
    from src.objectives.reward import Reward

    padded, packed, model = reward_batches()
    objective = Reward(center_rewards_coefficient=0.01)
    model.eval()
    with torch.no_grad():
        rewards = objective.pairs(model, inputs_of(padded), padded["labels"])["rewards"]
        packed_rewards = objective.pairs(model, inputs_of(packed), packed["labels"])["rewards"]
        alone = []
        for ids, labels in zip(padded["input_ids"], padded["labels"]):
            last = int((labels != -100).nonzero().max())
            alone.append(model(ids[None, : last + 1])[0, -1, 0])
    torch.testing.assert_close(rewards, torch.stack(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_rewards, rewards, rtol=1e-5, atol=1e-5)
    chosen, rejected = rewards.chunk(2)
    torch.testing.assert_close(objective.pair_losses({"rewards": rewards}),
                               -F.logsigmoid(chosen - rejected) + 0.01 * (chosen + rejected) ** 2)
    assert rewards.std() > 0


def test_a_gpt_reward_model_learns_the_shipped_preferences(tmp_path, capsys):
    """The rejected answers are the chosen ones with their words shuffled: after 150 steps the reward model ranks
    the held-out pairs almost always right. sample.py refuses to write with it (it would repeat token 0), naming
    eval.py, which scores with it."""
    import sample

    run_dir = tmp_path / "reward"
    run([*GPT, *PAIRS, "optimizer.lr=1e-3", "trainer.max_steps=150", "trainer.eval_every=0", "trainer.log_every=50",
         "trainer.monitor=eval/rewards/accuracies", "trainer.monitor_mode=max", f"hydra.run.dir={run_dir}"])
    assert scalars(run_dir, "eval/rewards/accuracies")[150] >= 0.9
    assert scalars(run_dir, "eval/rewards/margins")[150] > 1
    assert sample.main([str(run_dir / "model"), "--tokens", "4"]) == 2
    named(capsys.readouterr().err, "a reward model", f"python eval.py path={run_dir / 'model'}")


def test_a_reward_model_trains_the_same_on_two_processes_as_on_one_accumulating(tmp_path):
    args = [*GPT, *PAIRS, *QUIET, "optimizer.lr=1e-3", "data.batch_size=4", "trainer.max_steps=4"]
    run([*args, "trainer.gradient_accumulation_steps=2", f"hydra.run.dir={tmp_path / 'one'}"])
    run([*args, f"hydra.run.dir={tmp_path / 'two'}"], nproc=2)
    one, two = (scalars(tmp_path / name, "train/loss") for name in ("one", "two"))
    assert sorted(two) == [1, 2, 3, 4] and max(abs(one[s] - two[s]) for s in one) <= 1e-5


@pytest.mark.parametrize("layout", ["one process", "fsdp", "fsdp lora"])
def test_a_transformers_reward_model_exports_as_a_sequence_classifier_and_eval_py_reads_it_back(
        pretrained, tmp_path, layout):
    """AutoModelForSequenceClassification loads the export with no weight missing or left over, and scores each
    row as the trained model's value at its last token; eval.py's metrics of the export are the run's last. Under
    FSDP with LoRA the head trains whole beside the adapter and the export is still written tensor by tensor."""
    from transformers import AutoModelForSequenceClassification

    from src.checkpointing.export import load_exported_model

    run_dir = tmp_path / "reward"
    proc = run(["model=hf_causal_lm", f"model.pretrained={pretrained}", "model.block_size=64", *PAIRS,
                f"data.tokenizer={pretrained}", "optimizer.lr=1e-3", "trainer.max_steps=6", "trainer.eval_every=0",
                "trainer.monitor=null", f"hydra.run.dir={run_dir}", *([LORA] if "lora" in layout else [])],
               **({"nproc": 2, **FSDP_ON_CPU} if "fsdp" in layout else {}))
    if "fsdp" in layout:
        named(proc.stdout, "model.head=reward makes a new output layer")
        assert "gathering the whole model" not in proc.stdout
    export = run_dir / "model"
    classifier, info = AutoModelForSequenceClassification.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    assert classifier.config.num_labels == 1 and classifier.config.architectures == ["GPT2ForSequenceClassification"]
    trained = load_exported_model(export)
    ids = torch.tensor([[5, 17, 23, 42, 7, 9], [5, 17, 23, 42, 7, 9]])
    ids[1, 4:] = classifier.config.pad_token_id  # a shorter row, padded as the classifier reads padding
    with torch.no_grad():
        scores = classifier(input_ids=ids).logits[:, 0]
        values = trained(input_ids=ids).logits[:, :, 0]
    torch.testing.assert_close(scores, torch.stack([values[0, 5], values[1, 3]]), rtol=1e-5, atol=1e-5)
    if layout == "one process":  # a file whose weights do not fit the reward form is refused, naming what differs
        import shutil

        from safetensors.torch import load_file, save_file

        odd = Path(shutil.copytree(export, tmp_path / "odd"))
        save_file({**load_file(odd / "model.safetensors"), "extra.weight": torch.zeros(1)}, odd / "model.safetensors")
        with pytest.raises(FileNotFoundError, match="unexpected.*extra.weight"):
            load_exported_model(odd)
    run([f"path={export}"], script="eval.py")
    metrics = json.loads((export / "eval_metrics.json").read_text())
    assert abs(metrics["eval/rewards/accuracies"] - scalars(run_dir, "eval/rewards/accuracies")[6]) < 1e-6
    assert abs(metrics["eval/loss"] - scalars(run_dir, "eval/loss")[6]) < 1e-5


@pytest.mark.parametrize("overrides, named_keys", [
    (["objective=reward", "data=jsonl", "data.preference=true"], ["model.head=reward"]),
    (["model.head=reward"], ["model.head=reward", "objective=cross_entropy"]),
    ([*PAIRS, "trainer.sample_every=10"], ["trainer.sample_every", "0"]),
])
def test_a_reward_head_and_the_reward_objective_come_together_and_write_no_text(overrides, named_keys):
    from src.schema.complete import complete_config

    with pytest.raises(UsageError) as error:
        complete_config(compose_train(overrides))
    named(str(error.value), *named_keys)
