"""optimizer=muon: Muon on the hidden matrices, AdamW on the rest, as one optimizer (src/optim/muon.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from src.checkpointing.plain_state import load_tree, save_tree
from src.errors import UsageError
from src.models.gpt import GPT
from src.optim.optimizers import muon, param_groups
from tests.conftest import (
    FSDP_ON_CPU,
    QUIET,
    TINY_GPT,
    exported_weights,
    kill_when,
    max_abs_diff,
    refused,
    run,
    scalars,
)

VOCAB = 50


def template_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32)


def hf_gpt2() -> torch.nn.Module:
    """transformers' GPT-2: its hidden matrices are Conv1D weights (input x output), not Linear ones."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def train_steps(model: torch.nn.Module, optimizers: list, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 16), generator=generator)
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        for optimizer in optimizers:
            optimizer.zero_grad()
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("make_model, kept_out", [(template_gpt, ("tok_emb", "pos_emb")),
                                                  (hf_gpt2, ("wte", "wpe"))], ids=["template_gpt", "hf_gpt2"])
def test_muon_steps_the_hidden_matrices_as_torchs_muon_and_embeddings_output_layer_and_vectors_as_adamw(
        make_model, kept_out):
    """Bitwise the same weights as torch's Muon over the 2-D weights between embedding and output layer and torch's
    AdamW over the others (embeddings, the tied output layer, biases and norms without weight decay)."""
    model, reference = make_model(), make_model()
    optimizer = muon(param_groups(model), model=model, lr=1e-2)
    named = dict(reference.named_parameters())
    hidden = [p for name, p in named.items() if p.ndim == 2 and not any(k in name for k in kept_out)]
    matrices = [p for name, p in named.items() if p.ndim == 2 and any(k in name for k in kept_out)]
    vectors = [p for p in named.values() if p.ndim < 2]
    assert hidden and matrices and vectors
    separate = [torch.optim.Muon(hidden, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=1e-2,
                                  betas=(0.9, 0.99), weight_decay=0.1)]

    train_steps(model, [optimizer], 3)
    train_steps(reference, separate, 3)

    assert max_abs_diff(dict(model.named_parameters()), dict(reference.named_parameters())) == 0
    assert [(g["algorithm"], len(g["params"])) for g in optimizer.param_groups] == [
        ("muon", len(hidden)), ("adamw", len(matrices)), ("adamw", len(vectors))]


def test_muon_resumed_from_its_pickle_free_state_continues_bitwise(tmp_path):
    model = template_gpt()
    optimizer = muon(param_groups(model), model=model, lr=1e-2, muon_lr=2e-2, adjust_lr="original")
    train_steps(model, [optimizer], 2)
    save_tree(optimizer.state_dict(), tmp_path / "optimizer.safetensors")
    resumed_model = copy.deepcopy(model)
    resumed = muon(param_groups(resumed_model), model=resumed_model)  # the defaults: the file's settings win
    resumed.load_state_dict(load_tree(tmp_path / "optimizer.safetensors"))

    train_steps(model, [optimizer], 2, seed=2)
    train_steps(resumed_model, [resumed], 2, seed=2)

    assert max_abs_diff(dict(model.named_parameters()), dict(resumed_model.named_parameters())) == 0
    assert [g["lr"] for g in resumed.param_groups] == [2e-2, 1e-2, 1e-2]
    buffers = [(state["momentum_buffer"].shape, p.shape) for p, state in resumed.state.items()
               if "momentum_buffer" in state]
    assert len(buffers) == len(resumed.param_groups[0]["params"]) and all(a == b for a, b in buffers)


def one_rank_of_a_shared_step(rank: int, processes: int, sharded: bool, init_file: str, out: str) -> None:
    """A rank's Muon steps on the same gradients as every rank's (as DDP's all-reduce or FSDP2's reduce-scatter of
    equal gradients gives), its Newton-Schulz calls counted; `sharded`: the model under FSDP2 (fully_shard)."""
    import src.optim.muon as muon_module

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=processes)
    calls, orthogonalise = [], muon_module._zeropower_via_newtonschulz
    muon_module._zeropower_via_newtonschulz = lambda grad, *args: calls.append(grad.shape) or orthogonalise(grad,
                                                                                                           *args)
    model = template_gpt()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = muon(param_groups(model), model=model, lr=1e-2)
    train_steps(model, [optimizer], 2)
    weights = {name: p.full_tensor() if sharded else p for name, p in model.named_parameters()}
    torch.save({"calls": len(calls), "weights": weights}, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp2"])
def test_ranks_share_the_newton_schulz_work_and_apply_the_bits_one_process_computes(tmp_path, sharded):
    """Two ranks each orthogonalise half of the matrices whole (DDP: broadcasting them; FSDP2: gathering each
    one's rows and sending them back): the weights are bitwise those of one process computing every one."""
    alone = template_gpt()
    train_steps(alone, [muon(param_groups(alone), model=alone, lr=1e-2)], 2)
    out = str(tmp_path / "rank")
    torch.multiprocessing.spawn(one_rank_of_a_shared_step, args=(2, sharded, str(tmp_path / "init"), out), nprocs=2)
    ranks = [torch.load(f"{out}.{rank}") for rank in (0, 1)]

    matrices = sum(p.ndim == 2 for name, p in alone.named_parameters() if "emb" not in name)
    assert [r["calls"] for r in ranks] == [matrices, matrices]  # 2 steps, half the matrices each
    for r in ranks:
        assert max_abs_diff(r["weights"], dict(alone.named_parameters())) == 0


def test_a_saved_state_whose_groups_name_other_algorithms_is_refused_before_anything_is_loaded():
    model = template_gpt()
    optimizer = muon(param_groups(model), model=model)
    train_steps(model, [optimizer], 1)
    state = optimizer.state_dict()
    state["param_groups"][0]["algorithm"] = "adamw"  # the hidden matrices' group, edited
    other = template_gpt()
    fresh = muon(param_groups(other), model=other)
    with pytest.raises(ValueError, match=r"\['adamw', 'adamw', 'adamw'\].*\['muon', 'adamw', 'adamw'\]"):
        fresh.load_state_dict(state)
    assert not fresh.state


def test_a_resume_from_a_state_edited_to_step_muons_matrices_with_adamw_is_refused_naming_the_file(tmp_path):
    """The edit passes the checksums (rewritten too, as a hand-made checkpoint would have them)."""
    import json

    from src.checkpointing.checksums import CHECKSUMS, checksum

    run_dir = tmp_path / "run"
    run([*TINY_GPT, *QUIET, "optimizer=muon", "trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    state = load_tree(checkpoint / "optimizer.safetensors")
    state["param_groups"][0]["algorithm"] = "adamw"
    save_tree(state, checkpoint / "optimizer.safetensors")
    sums = json.loads((checkpoint / CHECKSUMS).read_text())
    (checkpoint / CHECKSUMS).write_text(json.dumps({**sums, "optimizer.safetensors": checksum(
        checkpoint / "optimizer.safetensors")}))

    refused(run([*TINY_GPT, *QUIET, "optimizer=muon", "trainer.max_steps=4", f"hydra.run.dir={run_dir}",
                 "resume=auto"], check=False), "optimizer.safetensors", "algorithm='adamw'", "builds has 'muon'")
    assert not (run_dir / "checkpoints" / "step_00000004").exists()


def test_a_model_without_hidden_matrices_is_refused_naming_what_muon_leaves_to_adamw():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    with pytest.raises(UsageError, match=r"no hidden matrices.*0.weight, 1.weight.*optimizer=adamw"):
        muon(param_groups(model), model=model)


def test_a_launched_muon_run_on_a_model_without_hidden_matrices_is_refused_and_leaves_no_run_dir(tmp_path,
                                                                                                   cifar_root):
    """The ResNet's matrices are convolution kernels and its classifier: nothing for Muon."""
    refused(run(["experiment=cifar10_resnet", f"data.root={cifar_root}", "optimizer=muon",
                 f"hydra.run.dir={tmp_path / 'run'}"], check=False), "optimizer=muon", "optimizer=adamw")
    assert not (tmp_path / "run").exists()


MUON_RUN = [*TINY_GPT, *QUIET, "optimizer=muon", "data.batch_size=4", "trainer.max_steps=24",
            "trainer.checkpoint_every=8", "trainer.monitor=null", "trainer.keep_last_checkpoints=5",
            "scheduler.warmup_steps=4", "optimizer.lr=1e-2"]


def test_a_two_process_muon_run_killed_mid_way_resumes_bitwise(tmp_path):
    reference, resumed = tmp_path / "uninterrupted", tmp_path / "killed"
    run([*MUON_RUN, f"hydra.run.dir={reference}"], nproc=2)
    args = [*MUON_RUN, f"hydra.run.dir={resumed}"]
    kill_when(args, 2, ready=lambda: (resumed / "checkpoints" / "step_00000008").is_dir())
    assert not (resumed / "model").exists()
    assert "resumed from" in run([*args, "resume=auto"], nproc=2).stdout

    assert scalars(resumed, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(resumed)) == 0


@pytest.mark.slow
def test_muon_under_fsdp2_orthogonalises_whole_matrices_and_resumes_its_sharded_state_bitwise(tmp_path):
    """FSDP2 shards each matrix; Muon orthogonalises its whole update, so a step of two sharded processes gives the
    weights of one process on the same global batch (1e-6: their gradients' rounding; Newton-Schulz on the shards
    themselves gave 5e-5), and a resume from the sharded optimizer state is bitwise the uninterrupted run. Over
    many steps Muon's bf16 Newton-Schulz amplifies the gradients' last-bit differences between layouts (DDP's
    too), so the step is compared, not a run."""
    one, sharded = tmp_path / "one_process", tmp_path / "fsdp_step"
    run([*MUON_RUN, "trainer.max_steps=1", "trainer.gradient_accumulation_steps=2", f"hydra.run.dir={one}"])
    run([*MUON_RUN, "trainer.max_steps=1", f"hydra.run.dir={sharded}"], nproc=2, **FSDP_ON_CPU)
    assert max_abs_diff(exported_weights(one), exported_weights(sharded)) <= 1e-6

    reference, resumed = tmp_path / "fsdp", tmp_path / "fsdp_killed"
    run([*MUON_RUN, f"hydra.run.dir={reference}"], nproc=2, **FSDP_ON_CPU)
    args = [*MUON_RUN, f"hydra.run.dir={resumed}"]
    kill_when(args, 2, ready=lambda: (resumed / "checkpoints" / "step_00000016").is_dir(), **FSDP_ON_CPU)
    assert "resumed from" in run([*args, "resume=auto"], nproc=2, **FSDP_ON_CPU).stdout
    assert scalars(resumed, "train/loss") == scalars(reference, "train/loss")
    assert max_abs_diff(exported_weights(reference), exported_weights(resumed)) == 0
