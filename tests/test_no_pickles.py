"""A checkpoint or an export from someone else cannot run code here: nothing in them is unpickled beyond tensors
and plain values. A planted pickle that would run code is refused, naming the file, or never read at all."""

import pickle
import re
import sys

import pytest
import torch

from src.checkpointing.export import load_exported_model
from src.errors import UsageError
from tests.conftest import QUIET, TINY_GPT, refused, run


class Planted:
    """Unpickled by anything but a weights-only loader, this runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def pickles_in(directory) -> list:
    return [f for f in sorted(directory.rglob("*")) if f.suffix in (".pkl", ".bin")]


def plant(files: list, marker) -> list:
    for file in files:
        torch.save(Planted(marker), file)
    return files


def test_the_planted_pickle_runs_code_when_unpickled(tmp_path):
    """The plant is live: what the tests below prove is refused would otherwise have run."""
    marker = tmp_path / "ran"
    plant([tmp_path / "x.pkl"], marker)
    torch.load(tmp_path / "x.pkl", weights_only=False)
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
    planted = plant(pickles_in(checkpoint), marker)
    assert {f.name for f in planted} >= {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
    resumed = run([*args, "trainer.max_steps=4", "resume=auto", f"hydra.run.dir={run_dir}"], check=False)
    refused(resumed)
    assert not marker.exists() and any(str(file) in resumed.stdout for file in planted), resumed.stdout[-3000:]

    export = run_dir / "model"
    plant([export / name for name in ("pytorch_model.bin", "training_args.bin", "vocabulary.pkl")], marker)
    run([f"path={checkpoint}", "eval_batches=2"], script="eval.py")  # reads model.safetensors alone
    run([f"path={export}", "eval_batches=2"], script="eval.py")
    run([str(export), "--prompt", "To be", "--tokens", "4"], command=[sys.executable, "sample.py"])
    load_exported_model(export)
    assert not marker.exists()


def test_a_planted_sharded_checkpoint_metadata_is_refused_before_torch_unpickles_it(tmp_path):
    """torch.distributed.checkpoint reads `.metadata` with a plain pickle.load; the integrity check reads it
    first, allowing only the metadata's own classes."""
    from src.checkpointing.integrity import check_readable
    from tests.test_checkpoint import fsdp_shaped_checkpoint

    checkpoint, marker = fsdp_shaped_checkpoint(tmp_path), tmp_path / "ran"
    check_readable(checkpoint)  # real metadata passes
    metadata = checkpoint / "optimizer_0" / ".metadata"
    metadata.write_bytes(pickle.dumps(Planted(marker)))  # laid out as torch's own writer lays it out
    with pytest.raises(UsageError, match=rf"{re.escape(str(metadata.parent))}.*builtins.exec"):
        check_readable(checkpoint)
    assert not marker.exists()


def test_a_pickle_planted_among_a_sharded_checkpoints_values_is_refused_before_torch_unpickles_it(tmp_path):
    """torch.distributed.checkpoint keeps what is not a tensor (the optimizer's param_groups) as pickled bytes in
    its shards and loads them with weights_only=False; the integrity check reads each with the weights-only loader
    first."""
    import torch.distributed.checkpoint as dcp

    from src.checkpointing.integrity import check_readable
    from tests.test_checkpoint import fsdp_shaped_checkpoint

    checkpoint, marker = fsdp_shaped_checkpoint(tmp_path), tmp_path / "ran"
    optimizer = checkpoint / "optimizer_0"
    state = {"optimizer": {"exp_avg": torch.zeros(4), "param_groups": [{"lr": 0.1, "params": ["weight"]}]}}
    dcp.save(state, checkpoint_id=str(optimizer))
    check_readable(checkpoint)  # plain values pass
    dcp.save({"optimizer": {**state["optimizer"], "param_groups": [{"lr": Planted(marker), "params": ["weight"]}]}},
             checkpoint_id=str(optimizer))
    with pytest.raises(UsageError) as error:
        check_readable(checkpoint)
    assert not marker.exists()
    assert re.search(rf"{re.escape(str(optimizer))}/__\d+_\d+\.distcp, value optimizer\.param_groups\.0\.lr "
                     r"names exec", str(error.value)), error.value
    dcp.load(state, checkpoint_id=str(optimizer))  # the plant is live: torch's own load runs it
    assert marker.read_text() == "ran"
