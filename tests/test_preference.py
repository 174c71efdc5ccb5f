"""Preference tuning: pairs tokenized as TRL tokenizes them, DPO / SimPO / ORPO equal to TRL's trainers, exact
however the global batch is split, the reference model without a second copy under LoRA, and real runs."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    GPU_ENV,
    ROOT,
    TINY_GPT,
    exported_weights,
    kill_when,
    max_abs_diff,
    named,
    refused,
    run,
    scalars,
    short_pairs,
)

PAIRS_FILE = ROOT / "data" / "shakespeare_pairs.jsonl"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LORA = "model.peft={peft_type: LORA, r: 4, lora_alpha: 8, target_modules: [c_attn]}"


def shipped_pairs(n: int, codec, block_size: int = 64) -> list[dict]:
    """The first n pairs of the shipped set that fit block_size tokens (no truncation: TRL's rule is another)."""
    from src.data.preference import tokenized_pair

    rows = []
    for line in PAIRS_FILE.read_text().splitlines():
        row = json.loads(line)
        prompt, chosen, rejected = tokenized_pair(codec, row["prompt"], row["chosen"], row["rejected"])
        if len(prompt) + max(len(chosen), len(rejected)) <= block_size:
            rows.append(row)
        if len(rows) == n:
            return rows
    raise AssertionError("too few short pairs")


@pytest.fixture
def trl():
    """TRL, for the side-by-side tests only (the GPU image has none, and the GPU tests here need none)."""
    return pytest.importorskip("trl")


@pytest.fixture(scope="module")
def chat_model(pretrained, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(pretrained, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def batch_of(codec, rows: list[dict], block_size: int = 64) -> dict:
    from src.data.preference import Pairs, collate_pairs, tokenized_pairs

    columns = {key: [row[key] for row in rows] for key in rows[0]}
    pairs, _ = tokenized_pairs(codec, columns, block_size, "truncate")
    return collate_pairs([Pairs(pairs)[i] for i in range(len(rows))])


def our_metrics(objective, model, batch: dict, reference=None) -> dict[str, float]:
    """The objective's evaluation of one batch of pairs, averaged as evaluation averages them."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if reference is not None:
        inputs["reference_logps"] = reference(model, inputs, batch["labels"])
    with torch.no_grad():
        per_pair = objective.model_metrics(model, inputs, batch["labels"])
    return objective.completed_metrics({k: (v.double().sum() / w.double().sum()).item()
                                        for k, (v, w) in per_pair.items()})


def trl_metrics(trainer) -> dict[str, float]:
    return {k.removeprefix("eval_"): v for k, v in trainer.evaluate().items()}


def trl_args(config_class, tmp_path: Path, pairs: int, **settings):
    # bf16 off: TRL's configs default to it, and on a CPU it would run only the prepared reference model in bf16.
    return config_class(output_dir=str(tmp_path / "trl"), per_device_eval_batch_size=pairs, report_to=[],
                        use_cpu=True, bf16=False, **settings)


def assert_same(ours: dict, theirs: dict, names) -> None:
    for name in names:
        assert ours[name] == pytest.approx(theirs[name], abs=1e-5), (name, ours[name], theirs[name])


def pairs_and_model(model_kind: str, packing: bool, pretrained):
    """Six of the shipped pairs, padded or packed (data.packing=true), and a model for them: the template's tied GPT
    or a transformers GPT-2 with a LoRA adapter that has moved (so that DPO's adapter-off reference differs)."""
    from src.data.packing import attend_per_document
    from src.data.preference import Pairs, collate_pairs, pack_pairs, tokenized_pairs
    from src.data.tokenizer import codec_for

    codec = codec_for(str(pretrained))
    rows = shipped_pairs(6, codec)
    samples = list(Pairs(tokenized_pairs(codec, {k: [row[k] for row in rows] for k in rows[0]}, 64, "truncate")[0]))
    batch = pack_pairs(samples, block_size=256) if packing else collate_pairs(samples)
    torch.manual_seed(0)
    if model_kind == "gpt":
        from src.models.gpt import GPT

        model = GPT(vocab_size=codec.vocab_size, block_size=256, n_layer=2, n_head=2, n_embd=32)
    else:
        peft = pytest.importorskip("peft")
        from transformers import AutoModelForCausalLM

        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(pretrained),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1)
    if packing:
        attend_per_document(model)
    labels = batch.pop("labels")
    return model.eval(), batch, labels  # eval: no dropout, so that both sides see the same model


def preference_objective(name: str, **settings):
    from src.objectives.preference import DPO, ORPO, SimPO

    return {"dpo": lambda: DPO(**settings), "simpo": lambda: SimPO(sft_weight=0.5, **settings),
            "orpo": lambda: ORPO(**settings)}[name]()


def started(objective, model, tmp_path):
    from accelerate import Accelerator

    objective.start(Accelerator(cpu=True), model, None, tmp_path, None)  # DPO: its reference (copy, or adapter off)
    return objective


# ---------------------------------------------------------------------------------------------------- tokenization


@pytest.mark.parametrize("form", ["strings", "implicit strings", "conversations", "implicit conversations"])
def test_pairs_are_tokenized_as_trls_dpo_trainer_tokenizes_them(form, chat_model, trl, tmp_path):
    """Prompt, chosen and rejected ids equal those of TRL's DPOTrainer, for strings and conversations, with the
    prompt given or implicit in the answers' shared start."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.data.preference import tokenized_pairs
    from src.data.tokenizer import codec_for

    strings = [json.loads(line) for line in PAIRS_FILE.read_text().splitlines()[:12]]
    rows = {
        "strings": strings,
        "implicit strings": [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                             for r in strings] + [{"chosen": "The sky is blue.", "rejected": "The sky is green."}],
        "conversations": [{"prompt": [{"role": "user", "content": r["prompt"]}],
                           "chosen": [{"role": "assistant", "content": r["chosen"]}],
                           "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in strings],
        "implicit conversations": [{"chosen": [{"role": "user", "content": r["prompt"]},
                                               {"role": "assistant", "content": r["chosen"]}],
                                    "rejected": [{"role": "user", "content": r["prompt"]},
                                                 {"role": "assistant", "content": r["rejected"]}]} for r in strings],
    }[form]
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    trainer = trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(chat_model),
                             args=trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False),
                             processing_class=tokenizer, train_dataset=Dataset.from_list(rows))
    theirs = trainer.train_dataset
    ours, counts = tokenized_pairs(codec_for(str(chat_model)), {k: [r[k] for r in rows] for k in rows[0]}, 10_000,
                                   "truncate")
    assert counts == {"truncated": 0, "dropped": 0, "empty": 0}
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours[key] == theirs[key], key


def test_pairs_of_a_hugging_face_dataset_and_of_a_mixture_are_tokenized_alike_and_each_numbered_once(
        tmp_path, pretrained):
    """data=hf_dataset gives the pairs data=jsonl gives; a mixture numbers every pair of every source, training and
    validation, once (what the precomputed reference's table is indexed by)."""
    from src.data.hf_dataset import HFDataset
    from src.data.jsonl import JsonlData
    from src.data.mixture import Mixture
    from src.objectives.reference import pair_sets

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    lines = PAIRS_FILE.read_text().splitlines()
    first.write_text("\n".join(lines[:40]) + "\n")
    second.write_text("\n".join(lines[40:70]) + "\n")
    common = dict(block_size=64, tokenizer=str(pretrained), preference=True, batch_size=2)
    by_jsonl, by_datasets = JsonlData(path=str(first), **common), HFDataset(path=str(first), **common)
    for ours, theirs in ((by_jsonl.train, by_datasets.train), (by_jsonl.val, by_datasets.val)):
        assert len(ours) == len(theirs)
        for i in range(len(ours)):
            assert all(torch.equal(ours[i][k], theirs[i][k]) for k in ours[i]), i
    mixture = Mixture(sources=[{"path": str(first), "weight": 1}, {"path": str(second), "weight": 1}], **common)
    numbers = [int(pairs[i]["pair_index"]) for pairs in pair_sets(mixture) for i in range(len(pairs))]
    assert sorted(numbers) == list(range(70))


def test_a_pair_longer_than_the_block_loses_its_prompts_start_first_or_is_dropped():
    from src.data.preference import fitted

    pair = (list(range(10)), [100, 101, 102], [200, 201])
    assert fitted(pair, 15, "truncate") is pair
    assert fitted(pair, 8, "truncate") == ([5, 6, 7, 8, 9], [100, 101, 102], [200, 201])
    assert fitted(pair, 3, "truncate") == ([9], [100, 101], [200, 201])  # the prompt keeps a token
    assert fitted(pair, 8, "drop") is None


# ---------------------------------------------------------------------------------------------- equal to TRL


@pytest.mark.parametrize("loss_type, sft_weight", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.0),
                                                   ("sigmoid", 0.2)])
def test_dpo_loss_and_metrics_equal_trls_dpo_trainer(loss_type, sft_weight, pretrained, tmp_path, trl):
    """For the same model, reference, pairs and settings, the loss and TRL's reward and log-probability metrics
    equal DPOTrainer's within 1e-5; with sft_weight, TRL's loss_type [sigmoid, sft] weighted [1, sft_weight] (RPO).
    The reference differs from the policy (another model), so that the rewards are not all zero."""
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.data.tokenizer import codec_for
    from src.objectives.preference import DPO
    from src.objectives.reference import FrozenCopy

    codec = codec_for(str(pretrained))
    rows = shipped_pairs(12, codec)
    policy = AutoModelForCausalLM.from_pretrained(pretrained)
    reference = AutoModelForCausalLM.from_pretrained(pretrained)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    smoothing = 0.2 if loss_type == "robust" else 0.0
    settings = dict(beta=0.3, loss_type=loss_type, label_smoothing=smoothing)
    losses = {"loss_type": [loss_type, "sft"], "loss_weights": [1.0, sft_weight]} if sft_weight else {
        "loss_type": [loss_type]}
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, processing_class=AutoTokenizer.from_pretrained(
        pretrained), args=trl_args(trl.DPOConfig, tmp_path, len(rows), **{**settings, **losses}),
        train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows))
    theirs = trl_metrics(trainer)
    ours = our_metrics(DPO(**settings, sft_weight=sft_weight, reference="copy"), policy, batch_of(codec, rows),
                       FrozenCopy(Accelerator(cpu=True), reference, DPO()))
    assert theirs["rewards/margins"] != 0
    assert_same(ours, theirs, ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                               "logps/chosen", "logps/rejected"])


def reference_free_trl(trainer_class, config_class, pretrained: Path, tmp_path: Path, **settings):
    """(codec, model, pairs, TRL's metrics) of one of TRL's reference-free trainers on the shipped pairs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.data.tokenizer import codec_for

    codec = codec_for(str(pretrained))
    rows = shipped_pairs(12, codec)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(pretrained), AutoTokenizer.from_pretrained(pretrained)
    tokenizer.pad_token = tokenizer.eos_token
    trainer = trainer_class(model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
                            eval_dataset=Dataset.from_list(rows),
                            args=trl_args(config_class, tmp_path, len(rows), max_length=64, **settings))
    return codec, model, rows, trl_metrics(trainer)


@pytest.mark.parametrize("sft_weight", [0.0, 1.0])
def test_simpo_equals_trls_cpo_trainer_with_loss_type_simpo(sft_weight, pretrained, tmp_path, trl):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from src.objectives.preference import SimPO

    codec, model, rows, theirs = reference_free_trl(CPOTrainer, CPOConfig, pretrained, tmp_path, loss_type="simpo",
                                                    beta=2.0, simpo_gamma=0.5, cpo_alpha=sft_weight)
    ours = our_metrics(SimPO(beta=2.0, simpo_gamma=0.5, sft_weight=sft_weight), model, batch_of(codec, rows))
    assert_same(ours, theirs, ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                               "logps/chosen", "logps/rejected"])


def test_orpo_equals_trls_orpo_trainer(pretrained, tmp_path, trl):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from src.objectives.preference import ORPO

    codec, model, rows, theirs = reference_free_trl(ORPOTrainer, ORPOConfig, pretrained, tmp_path, beta=0.1)
    ours = our_metrics(ORPO(beta=0.1), model, batch_of(codec, rows))
    assert_same(ours, theirs, ["loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen",
                               "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                               "logps/rejected"])


# ------------------------------------------------------------------------------------- exact over the global batch


@pytest.mark.parametrize("objective", ["dpo", "dpo_sft", "simpo", "orpo"])
def test_a_steps_loss_and_gradient_are_the_same_however_the_global_batch_is_split(objective, pretrained):
    """The loop's recipe (each micro-batch's terms over the global batch's counts, src/loop/accumulation.py) gives
    the whole batch's loss and gradient for micro-batches of 1, 2 and 3 pairs of different lengths: pairs for every
    objective, and tokens for the language-model term of ORPO, and of SimPO and DPO with sft_weight."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.tokenizer import codec_for
    from src.objectives.preference import DPO, ORPO, SimPO
    from src.objectives.reference import FrozenCopy

    codec = codec_for(str(pretrained))
    rows = shipped_pairs(6, codec)
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    chosen = {"dpo": lambda: DPO(reference="copy"), "dpo_sft": lambda: DPO(reference="copy", sft_weight=0.2),
              "simpo": lambda: SimPO(sft_weight=0.5), "orpo": lambda: ORPO()}[objective]()
    reference = FrozenCopy(Accelerator(cpu=True), AutoModelForCausalLM.from_pretrained(pretrained), DPO())
    if objective.startswith("dpo"):  # a reference unlike the policy, so that the loss is not log 2 everywhere
        with torch.no_grad():
            for parameter in reference.model.parameters():
                parameter.mul_(0.9)

    def loss_and_gradient(splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        batches, start = [], 0
        for size in splits:
            batches.append(batch_of(codec, rows[start:start + size]))
            start += size
        counts = sum(chosen.count(b["labels"]) for b in batches)
        total = 0
        for b in batches:
            inputs = {k: v for k, v in b.items() if k != "labels"}
            if objective.startswith("dpo"):
                inputs["reference_logps"] = reference(model, inputs, b["labels"])
            loss = (chosen.model_loss_sum(model, inputs, b["labels"]) / counts).sum()
            loss.backward()
            total += loss.detach()
        return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    whole_loss, whole_gradient = loss_and_gradient([6])
    for splits in ([1, 2, 3], [3, 3], [1] * 6):
        loss, gradient = loss_and_gradient(splits)
        assert loss.item() == pytest.approx(whole_loss.item(), abs=1e-6), splits
        assert (gradient - whole_gradient).abs().max().item() < 1e-6, splits


def test_packed_pairs_compute_no_more_tokens_than_padded_ones_and_each_answer_lands_once():
    """narrowest_packing over random batches: every row placed once, no packed row wider than the block, and
    rows times width never above the padded layout's; where best fit at the block's width leaves a ragged row, a
    narrower width packs without padding."""
    import random

    from src.data.preference import narrowest_packing

    rng = random.Random(0)
    for _ in range(300):
        block = rng.randint(8, 256)
        lengths = [rng.randint(1, block) for _ in range(2 * rng.randint(1, 16))]
        rows, width = narrowest_packing(lengths, block)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in row) for row in rows) == width <= block
        assert len(rows) * width <= len(lengths) * max(lengths)
    assert narrowest_packing([30, 30, 30, 30, 10, 10], 100) == ([[0, 1, 4], [2, 3, 5]], 70)  # at 100: 2 x 100


@pytest.mark.parametrize("model_kind", ["template", "transformers"])
@pytest.mark.parametrize("objective", ["dpo", "dpo_ipo", "simpo", "orpo"])
def test_packed_pairs_train_and_evaluate_as_the_same_pairs_padded(objective, model_kind, pretrained):
    """data.packing=true with pairs (TRL's padding_free): the 2B answers packed into fewer rows, each attending to
    itself only, give every objective's loss, gradient and metrics of the same pairs padded, with the reference's
    log-probabilities computed on the packed batch too; the packed batch has no padding row and no attention_mask."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.packing import attend_per_document
    from src.data.preference import Pairs, collate_pairs, pack_pairs, tokenized_pairs
    from src.data.tokenizer import codec_for
    from src.models.gpt import GPT
    from src.objectives.preference import DPO, ORPO, SimPO
    from src.objectives.reference import FrozenCopy

    codec = codec_for(str(pretrained))
    rows = shipped_pairs(6, codec)
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    samples = list(Pairs(tokenized_pairs(codec, columns, 64, "truncate")[0]))
    padded, packed = collate_pairs(samples), pack_pairs(samples, block_size=256)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0] and "attention_mask" not in packed

    torch.manual_seed(0)
    build = {"template": lambda: GPT(vocab_size=codec.vocab_size, block_size=256, n_layer=2, n_head=2, n_embd=32),
             "transformers": lambda: AutoModelForCausalLM.from_pretrained(pretrained)}[model_kind]
    model = build()
    attend_per_document(model)
    chosen = {"dpo": lambda: DPO(reference="copy"), "dpo_ipo": lambda: DPO(loss_type="ipo", reference="copy"),
              "simpo": lambda: SimPO(sft_weight=0.5), "orpo": lambda: ORPO()}[objective]()
    reference = FrozenCopy(Accelerator(cpu=True), model, chosen)
    with torch.no_grad():  # a reference unlike the policy, so that the loss is not log 2 everywhere
        for parameter in reference.model.parameters():
            parameter.mul_(0.9)

    def trained(batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        model.zero_grad()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if objective.startswith("dpo"):
            inputs["reference_logps"] = reference(model, inputs, batch["labels"])
        loss = (chosen.model_loss_sum(model, inputs, batch["labels"]) / chosen.count(batch["labels"])).sum()
        loss.backward()
        gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return loss.detach(), gradient, our_metrics(chosen, model, batch, reference if inputs.get(
            "reference_logps") is not None else None)

    (padded_loss, padded_gradient, padded_metrics), (loss, gradient, metrics) = trained(padded), trained(packed)
    assert loss.item() == pytest.approx(padded_loss.item(), abs=1e-6)
    assert (gradient - padded_gradient).abs().max().item() < 1e-6
    assert metrics.keys() == padded_metrics.keys()
    for name, value in metrics.items():
        assert value == pytest.approx(padded_metrics[name], abs=1e-5), name


# ------------------------------------------------------------------------------------------- the reference model


def test_the_reference_of_a_lora_model_is_its_base_with_the_adapter_off_and_holds_no_copy(pretrained):
    """objective.reference=auto on a model with an adapter: its log-probabilities are the base model's, however far
    the adapter has moved, computed by the model itself (no module of its own), and in eval mode (no dropout)."""
    peft = pytest.importorskip("peft")
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from src.data.tokenizer import codec_for
    from src.objectives.preference import DPO
    from src.objectives.reference import AdapterOff, Reference

    codec = codec_for(str(pretrained))
    batch = batch_of(codec, shipped_pairs(4, codec))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(pretrained, resid_pdrop=0.5),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    model.train()
    reference = Reference.build("auto", Accelerator(cpu=True), model, None, Path("unused"), None, DPO())
    assert isinstance(reference, AdapterOff)
    assert not any(isinstance(value, torch.nn.Module) for value in vars(reference).values())
    base = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    from src.objectives.preference import model_answer_logps

    with torch.no_grad():
        expected = model_answer_logps(base, batch, batch["labels"], -100)[0]
        adapted = model_answer_logps(model.eval(), batch, batch["labels"], -100)[0]
    model.train()
    got = reference(model, inputs, batch["labels"])
    assert model.training  # its mode is given back
    torch.testing.assert_close(got, expected)
    assert (adapted - expected).abs().max() > 1e-2  # the adapter does change the model


# ------------------------------------------------------------------------------------------------- real runs


def dpo_args(pretrained, run_dir, *extra, pairs: Path = PAIRS_FILE) -> list[str]:
    return ["model=hf_causal_lm", f"model.pretrained={pretrained}", "model.block_size=64", "data=jsonl",
            f"data.path={pairs}", "data.preference=true", "data.batch_size=8", "objective=dpo",
            "optimizer.lr=3e-3", "scheduler.warmup_steps=2", f"hydra.run.dir={run_dir}", *extra]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft, not ours
def test_dpo_on_lora_learns_the_preference_logs_trls_metrics_and_eval_scores_its_export_as_the_run_did(
        tmp_path, pretrained):
    run_dir = tmp_path / "dpo"
    log = run(dpo_args(pretrained, run_dir, LORA, "trainer.max_steps=24", "trainer.eval_every=12",
                       "trainer.log_every=1", "trainer.eval_on_start=true", "trainer.monitor=eval/rewards/accuracies",
                       "trainer.monitor_mode=max")).stdout
    assert "objective.reference=adapter" in log and "preference pairs kept" in log  # some are truncated to 64
    for split in ("train", "eval"):
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                     "logps/rejected"):
            assert scalars(run_dir, f"{split}/{name}"), f"{split}/{name}"
    accuracy, margins = scalars(run_dir, "eval/rewards/accuracies"), scalars(run_dir, "eval/rewards/margins")
    assert accuracy[0] == 0 and margins[0] == 0  # the policy is its reference at the start: every pair a tie
    assert accuracy[24] > 0.8 and margins[24] > margins[12] > 0
    assert scalars(run_dir, "train/loss")[1] == pytest.approx(math.log(2), abs=1e-6)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_metrics"]["eval/rewards/accuracies"] == pytest.approx(accuracy[24])
    assert summary["final_metrics"]["train/rewards/margins"] == pytest.approx(
        scalars(run_dir, "train/rewards/margins")[24], abs=1e-6)  # training's too, as last logged
    assert summary["best"]["metric"] == "eval/rewards/accuracies" and (run_dir / "model_best").is_dir()
    assert (run_dir / "model" / "adapter" / "adapter_config.json").is_file()  # beside the merged model, as for SFT

    evaluated = run(["path=" + str(run_dir / "model"), "output=" + str(tmp_path / "eval.json")], script="eval.py")
    assert evaluated.returncode == 0
    scored = json.loads((tmp_path / "eval.json").read_text())
    assert scored["eval/rewards/margins"] == pytest.approx(margins[24], abs=1e-5)
    assert scored["eval/loss"] == pytest.approx(scalars(run_dir, "eval/loss")[24], abs=1e-5)


def test_pairs_without_their_columns_or_with_an_objective_or_packing_for_documents_are_refused(tmp_path, pretrained):
    from src.data.hf_dataset import HFDataset
    from src.data.jsonl import JsonlData
    from src.errors import UsageError

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(UsageError, match=r"bad.jsonl:1.*rejected"):
        JsonlData(block_size=16, path=str(bad), preference=True)
    refused(run(dpo_args(pretrained, tmp_path / "a", "objective=causal_lm"), check=False),
            "data.preference=true", "objective=causal_lm", "dpo")
    refused(run([*dpo_args(pretrained, tmp_path / "b"), "data.preference=false"], check=False),
            "data.preference=false", "objective=dpo", "data.preference=true")
    with pytest.raises(UsageError, match="packs preference pairs only.*data=hf_dataset.*data.packing=true"):
        JsonlData(block_size=16, packing=True)  # documents: data=hf_dataset packs them
    with pytest.raises(UsageError, match="data.packing=cross_document is for documents.*padded.*packed"):
        HFDataset(path=str(PAIRS_FILE), block_size=64, preference=True, packing="cross_document")


def without_key_biases(run_dir: Path) -> dict:
    """The exported weights, GPT-2's key biases aside: attention is invariant to them (a softmax shifted by a
    constant), so their gradient is zero but for rounding, which AdamW's normalisation turns into whole steps that
    differ with the order of a sum (measured: 3e-3 between layouts there, under 1e-5 everywhere else)."""
    weights = exported_weights(run_dir)
    for name, tensor in weights.items():
        if name.endswith("attn.c_attn.bias"):
            width = tensor.shape[0] // 3  # query, key, value
            weights[name] = torch.cat([tensor[:width], tensor[2 * width:]])
    return weights


# "The same weights" across layouts is up to float rounding, which AdamW's normalisation amplifies where a
# gradient is near zero (as for the key biases above): one element of 4,096 ended 3e-5 apart between 1 and 2
# processes on an AMD EPYC (every other under 1e-6), while a global batch of 7 pairs in place of 8 moves 3/4 of
# the elements more than 1e-4 apart (the furthest 1e-2).
ACROSS_LAYOUTS = 1e-4


@pytest.mark.slow  # four launches of two processes or a kill, ~60 s
def test_dpo_is_the_same_however_the_global_batch_is_split_and_resumes_bitwise_with_its_precomputed_reference(
        tmp_path, pretrained):
    """Full fine-tuning against log-probabilities precomputed before the first step: 2 processes of 2 pairs
    accumulating 2, packed (data.packing=true) and chunked through the output layer (objective.chunk_tokens), train
    the weights (ACROSS_LAYOUTS) and log the metrics (<= 1e-5) of 1 process of 4 pairs accumulating 2, padded;
    a reference=copy run trains the same weights; a run killed after a checkpoint resumes bitwise, reading the
    table it kept rather than computing it again."""
    from src.data.jsonl import JsonlData

    common = ["trainer.max_steps=6", "trainer.checkpoint_every=3", "trainer.monitor=null", "trainer.eval_every=0",
              "trainer.gradient_accumulation_steps=2", "trainer.log_every=1"]
    one, two, copied, killed = (tmp_path / name for name in ("one", "two", "copy", "killed"))
    pairs = short_pairs(tmp_path / "pairs.jsonl")
    packed = JsonlData(block_size=64, path=str(pairs), tokenizer=str(pretrained), preference=True, packing=True)
    assert any(packed.collate_fn([packed.train[i], packed.train[i + 1]])["input_ids"].shape[0] < 4  # rows to fill
               for i in range(0, 8, 2))
    precomputed = ["objective.reference=precomputed", *common]
    run(dpo_args(pretrained, one, "data.batch_size=4", *precomputed, pairs=pairs))
    run(dpo_args(pretrained, two, "data.batch_size=2", "data.packing=true", "objective.chunk_tokens=13", *precomputed,
                 pairs=pairs), nproc=2)
    run(dpo_args(pretrained, copied, "data.batch_size=4", "objective.reference=copy", *common, pairs=pairs))
    for name in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        ones = scalars(one, f"train/{name}")  # a log-probability of -150 is stored to 1.5e-5 (TensorBoard's fp32)
        # At step 1 the policy is its reference: every pair a tie, whose sign (the accuracy) is rounding's.
        steps = [s for s in ones if s > 1 or name != "rewards/accuracies"]
        assert all(scalars(two, f"train/{name}")[s] == pytest.approx(ones[s], abs=1e-5, rel=1e-6) for s in steps), name
    assert max_abs_diff(without_key_biases(two), without_key_biases(one)) <= ACROSS_LAYOUTS
    assert max_abs_diff(without_key_biases(copied), without_key_biases(one)) <= 1e-5

    kill_when(dpo_args(pretrained, killed, "data.batch_size=4", *precomputed, pairs=pairs), 1,
              ready=lambda: (killed / "checkpoints" / "step_00000003").is_dir())
    resumed = run(dpo_args(pretrained, killed, "data.batch_size=4", *precomputed, "resume=auto", pairs=pairs)).stdout
    assert "objective.reference=precomputed: read" in resumed
    assert scalars(killed, "train/loss") == scalars(one, "train/loss")
    assert max_abs_diff(exported_weights(killed), exported_weights(one)) == 0


@pytest.mark.slow  # four launches, two of them FSDP2 over gloo, ~70 s
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft, not ours
def test_dpo_under_fsdp_trains_the_weights_of_one_process_with_lora_s_base_or_precomputed_log_probabilities(
        tmp_path, pretrained):
    """FSDP2 (2 processes of 2 pairs accumulating 2, packed, chunked through the sharded output layer) against 1
    process of 4 pairs accumulating 2, padded, at once:
    with LoRA the reference is the sharded model with its adapter off; without, it defaults to the starting
    weights' log-probabilities, computed sharded before the first step, since a copy would be whole on every rank."""
    from tests.test_fsdp import FSDP_ON_CPU

    common = ["trainer.max_steps=4", "trainer.monitor=null", "trainer.eval_every=0",
              "trainer.gradient_accumulation_steps=2"]
    pairs = short_pairs(tmp_path / "pairs.jsonl")
    for name, extra in (("lora", [LORA]), ("full", [])):
        one, sharded = tmp_path / f"{name}_one", tmp_path / f"{name}_fsdp"
        run(dpo_args(pretrained, one, "data.batch_size=4", *common, *extra,
                     *([] if extra else ["objective.reference=precomputed"]), pairs=pairs))
        log = run(dpo_args(pretrained, sharded, "data.batch_size=2", "data.packing=true", "objective.chunk_tokens=13",
                           *common, *extra, pairs=pairs), nproc=2, **FSDP_ON_CPU).stdout
        assert f"objective.reference={'adapter' if extra else 'precomputed'}" in log
        assert max_abs_diff(without_key_biases(sharded), without_key_biases(one)) <= ACROSS_LAYOUTS, name
    proc = run(dpo_args(pretrained, tmp_path / "copy", "objective.reference=copy", *common), nproc=2, check=False,
               **FSDP_ON_CPU)
    assert proc.returncode != 0 and "step 1/" not in proc.stdout
    named(proc.stdout, "objective.reference=copy", "FSDP", "precomputed")


@pytest.mark.slow  # compilation (~20 s)
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_a_compiled_step_on_pairs_compiles_once_for_every_micro_batch_and_sums_their_metrics(objective, pretrained,
                                                                                             tmp_path):
    """trainer.compile=true with accumulation: the pairs' training metrics are added up on the device across a
    window's micro-batches without the compiled step depending on how many came before (a list appended to in the
    step recompiled it for each, past the compiler's limit of 8 into eager mode), and read as the sums of each
    micro-batch's metrics."""
    from src.loop.forward import Forward

    model, inputs, labels = pairs_and_model("gpt", False, pretrained)
    eager = started(preference_objective(objective), model, tmp_path)
    compiled = started(preference_objective(objective), model, tmp_path)
    with torch.no_grad():
        for parameter in model.parameters():  # the policy moves away from DPO's reference copy
            parameter.mul_(1.1)
    torch._dynamo.reset()  # what earlier tests compiled in this process: a new objective would recompile it
    forward = Forward(compiled, compile=True)
    for _ in range(2):  # steps of 3 micro-batches, read after each as the loop reads them
        for _ in range(3):
            Forward(eager, compile=False).loss_sum(model, inputs, labels)
            with torch._dynamo.config.patch(error_on_recompile=True):
                forward.loss_sum(model, inputs, labels).sum().backward()
        expected, got = eager.training_metrics(), compiled.training_metrics()
        assert got.keys() == expected.keys() == set(compiled.pair_metric_names)
        for name in got:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("reference, packing, chunk_tokens", [("copy", "false", "24"), ("precomputed", "true", "null")])
def test_dpo_steps_make_no_host_reads_between_logging_steps(tmp_path, reference, packing, chunk_tokens):
    """The reference's pass, the pairs' metrics and the second loss term stay on the device, and so do reading
    packed answers back and computing log-probabilities in chunks through the output layer: as for every objective,
    the host reads a step's results only at steps that log, evaluate or save (tests/host_reads.py). On the
    template's GPT: a transformers model reads its padding mask on the host itself (masking_utils)."""
    run([*TINY_GPT, "model.block_size=64", "data=jsonl", f"data.path={short_pairs(tmp_path / 'pairs.jsonl')}",
         "data.preference=true", f"data.packing={packing}", "objective=dpo", f"objective.reference={reference}",
         f"objective.chunk_tokens={chunk_tokens}",
         "trainer.max_steps=12", "trainer.log_every=5", "trainer.eval_every=6",
         "trainer.checkpoint_every=4", "trainer.eval_batches=2", "data.batch_size=4", "optimizer.fused=true",
         "trainer.gradient_accumulation_steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
        script="tests/host_reads.py", launcher="torchrun", env={"HOST_READS_FILE": str(tmp_path / "reads")})
    reads = json.loads((tmp_path / "reads.0").read_text())
    assert len(reads) == 11 and not any(reads.values()), {step: r for step, r in reads.items() if r}


@pytest.mark.gpu
@pytest.mark.parametrize("reference, packing, chunk_tokens", [("copy", "false", "24"), ("precomputed", "true", "null")])
def test_dpo_steps_make_no_cuda_sync_in_bf16_compiled_training(tmp_path, reference, packing, chunk_tokens):
    """On a GPU, the same as the host-read test above with CUDA's own sync detector set to raise: the reference's
    pass under autocast, the table lookup, packed answers read back, chunked log-probabilities and the metrics'
    sums never wait for the device."""
    run([*TINY_GPT, "model.block_size=64", "data=jsonl", f"data.path={short_pairs(tmp_path / 'pairs.jsonl')}",
         "data.preference=true", f"data.packing={packing}", "objective=dpo", f"objective.reference={reference}",
         f"objective.chunk_tokens={chunk_tokens}",
         "trainer.max_steps=12", "trainer.log_every=5", "trainer.eval_every=6",
         "trainer.checkpoint_every=4", "trainer.eval_batches=2", "data.batch_size=4", "optimizer.fused=true",
         "trainer.mixed_precision=bf16", "trainer.compile=true", f"hydra.run.dir={tmp_path / 'run'}"],
        script="tests/host_reads.py", launcher="torchrun",
        env={**GPU_ENV, "HOST_READS_FILE": str(tmp_path / "reads"), "HOST_READS_CUDA_SYNC": "error"})
    reads = json.loads((tmp_path / "reads.0").read_text())
    assert not any(reads.values()), reads
    assert "device                      : cuda" in (tmp_path / "run" / "train.log").read_text()
