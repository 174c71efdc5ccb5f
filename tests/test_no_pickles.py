"""A checkpoint or an export from someone else cannot run code here: nothing in them is unpickled beyond tensors
and plain values. A planted pickle that would run code is refused, naming the file, or never read at all."""

import json
import pickle
import sys

import pytest
import torch
from safetensors import safe_open

from src.checkpointing.export import load_exported_model
from src.errors import UsageError
from tests.conftest import QUIET, TINY_GPT, named, refused, run


class Planted:
    """Unpickled by anything but a weights-only loader, this runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def plain_files_only(directory) -> list:
    """Every file of `directory` is what its name says and none is a pickle: safetensors (its header parsed), JSON
    or YAML text. Returns them."""
    files = [f for f in sorted(directory.rglob("*")) if f.is_file()]
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt"):
                pass
        elif file.suffix == ".json":
            json.loads(file.read_text())
        else:
            assert file.suffix == ".yaml" and file.read_bytes().isascii(), file
    return files


def plant(files: list, marker) -> list:
    """A pickle as torch.distributed.checkpoint writes its .metadata."""
    for file in files:
        file.write_bytes(pickle.dumps(Planted(marker)))
    return files


def test_the_planted_pickle_runs_code_when_unpickled(tmp_path):
    """The plant is live: what the tests below prove is refused would otherwise have run."""
    marker = tmp_path / "ran"
    plant([tmp_path / "x.pkl"], marker)
    with open(tmp_path / "x.pkl", "rb") as planted:
        pickle.load(planted)  # as torch.distributed.checkpoint reads its .metadata
    assert marker.read_text() == "ran"


def test_resume_eval_sample_and_load_exported_model_never_run_a_planted_pickle(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.ema_decay=0.9", "trainer.eval_batches=2"]
    run([*args, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    assert not [f.name for f in checkpoint.iterdir() if f.name.startswith("custom_checkpoint")]  # the EMA: safetensors
    # Where accelerate keeps an object given to register_for_checkpointing, and unpickles it with
    # weights_only=False: a checkpoint of ours never has one, and a resume refuses one planted there unread.
    plant([checkpoint / "custom_checkpoint_0.pkl"], marker)
    refused(run([*args, "trainer.max_steps=3", "resume=auto", f"hydra.run.dir={run_dir}"], check=False),
            str(checkpoint / "custom_checkpoint_0.pkl"), f"trainer.init_weights={checkpoint}")
    assert not marker.exists()
    run([*args, "trainer.max_steps=1", f"trainer.init_weights={checkpoint}", f"hydra.run.dir={tmp_path / 'anew'}"])
    (checkpoint / "custom_checkpoint_0.pkl").unlink()
    run([*args, "trainer.max_steps=3", "resume=auto", f"hydra.run.dir={run_dir}"])
    assert not marker.exists()

    checkpoint = run_dir / "checkpoints" / "step_00000003"
    ours = plain_files_only(checkpoint)  # no pickle-format file: nothing to unpickle
    assert {f.name for f in ours} >= {"model.safetensors", "optimizer.safetensors", "scheduler.json",
                                      "random_states_0.safetensors", "ema.safetensors", "train_state.json"}
    # A pickle in place of every file the checkpoint holds, and at every name accelerate's save_state uses.
    accelerates = [checkpoint / name for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                                                  "scaler.pt", "pytorch_model.bin")]
    planted = plant([*ours, *accelerates], marker)
    resumed = run([*args, "trainer.max_steps=4", "resume=auto", f"hydra.run.dir={run_dir}"], check=False)
    refused(resumed)
    assert not marker.exists() and any(str(file) in resumed.stdout for file in planted), resumed.stdout[-3000:]
    evaluated = run([f"path={checkpoint}", "eval_batches=2"], script="eval.py", check=False)
    refused(evaluated)
    assert not marker.exists() and any(str(file) in evaluated.stdout for file in planted), evaluated.stdout[-3000:]

    export = run_dir / "model"
    plain_files_only(export)
    plant([export / name for name in ("pytorch_model.bin", "training_args.bin", "vocabulary.pkl")], marker)
    run([f"path={export}", "eval_batches=2"], script="eval.py")  # reads model.safetensors alone
    run([str(export), "--prompt", "To be", "--tokens", "4"], command=[sys.executable, "sample.py"])
    load_exported_model(export)
    assert not marker.exists()


@pytest.mark.parametrize("planted_as", ["optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "scheduler.bin",
                                        "random_states_1.pkl", "custom_checkpoint_0.pkl"])
def test_a_pickle_format_file_in_a_checkpoint_is_refused_by_name_before_anything_is_read(tmp_path, planted_as):
    """What torch.distributed.checkpoint's default writer and accelerate's save_state write, planted beside a
    checkpoint's own files: never read, refused by name."""
    from src.checkpointing.integrity import check_readable
    from tests.test_checkpoint import fsdp_shaped_checkpoint

    checkpoint, marker = fsdp_shaped_checkpoint(tmp_path), tmp_path / "ran"
    check_readable(checkpoint)
    plant([checkpoint / planted_as], marker)
    with pytest.raises(UsageError) as error:
        check_readable(checkpoint)
    named(str(error.value), str(checkpoint / planted_as), "pickle format")
    assert not marker.exists()


def test_state_trees_round_trip_exactly_and_refuse_what_only_pickle_could_store(tmp_path):
    """An optimizer's state (int keys, tuples, tensors), Python's and numpy's random states come back equal; an
    object of any other type is refused when saved, naming where it sits."""
    import random

    import numpy as np

    from src.checkpointing.plain_state import load_tree, save_tree

    weight = torch.nn.Parameter(torch.randn(3, 4))
    optimizer = torch.optim.AdamW([weight], betas=(0.9, 0.95))
    weight.grad = torch.randn(3, 4)
    optimizer.step()
    tree = {"optimizer": optimizer.state_dict(), "python": random.getstate(), "numpy": np.random.get_state(),
            "nan": float("nan"), "none": None}
    save_tree(tree, tmp_path / "state.safetensors")
    back = load_tree(tmp_path / "state.safetensors")
    assert back["optimizer"]["param_groups"] == tree["optimizer"]["param_groups"]  # betas a tuple, params ints
    assert all(torch.equal(back["optimizer"]["state"][0][k], v) for k, v in tree["optimizer"]["state"][0].items())
    assert back["python"] == tree["python"] and back["none"] is None and back["nan"] != back["nan"]
    assert all(np.array_equal(a, b) for a, b in zip(back["numpy"], tree["numpy"]))
    with pytest.raises(TypeError) as error:
        save_tree({"param_groups": [{"lr": Planted(tmp_path / "ran")}]}, tmp_path / "bad.json")
    named(str(error.value), "Planted", "['param_groups'][0]['lr']")
