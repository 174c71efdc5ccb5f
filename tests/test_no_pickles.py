"""A checkpoint or an export from someone else cannot run code here: nothing in them is unpickled beyond tensors
and plain values, and their configs are data. A planted pickle that would run code is refused, naming the file, or
never read at all; a config naming a callable that config/ does not offer (torch.load, subprocess.run ...) is
refused before anything of it is imported or built, whatever the checksums say; a file the layout does not know
is refused by name."""

import json
import pickle

import pytest
import torch
from safetensors import safe_open

import sample
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
    assert sample.main([str(export), "--prompt", "To be", "--tokens", "4"]) == 0  # sample.py, in this process
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
    # Tensors whose keys read alike as text keep apart: an int key and its string, a "/" in a key and a nesting.
    alike = {1: torch.zeros(2), "1": torch.ones(2), "a/b": torch.full((2,), 2.0), "a": {"b": torch.full((2,), 3.0)}}
    save_tree(alike, tmp_path / "alike.safetensors")
    back = load_tree(tmp_path / "alike.safetensors")
    assert [back[1][0], back["1"][0], back["a/b"][0], back["a"]["b"][0]] == [0, 1, 2, 3]
    with pytest.raises(TypeError) as error:
        save_tree({"param_groups": [{"lr": Planted(tmp_path / "ran")}]}, tmp_path / "bad.json")
    named(str(error.value), "Planted", "['param_groups'][0]['lr']")


def gadgets(plant, marker) -> dict:
    """Configs whose building runs someone else's code or reads what they chose: each names a callable of the
    standard library or an installed package that Hydra's blocklist lets through."""
    path = {"_target_": "pathlib.Path", "_args_": [str(plant)]}
    torch.save(Planted(marker), plant.with_suffix(".pt"))  # torch.load reads its own format only
    return {
        "torch.load": {"_target_": "torch.load", "f": str(plant.with_suffix(".pt")), "weights_only": False},
        "numpy.load": {"_target_": "numpy.load", "file": str(plant), "allow_pickle": True},
        "pickle.loads": {"_target_": "pickle.loads", "_args_": [{"_target_": "pathlib.Path.read_bytes",
                                                                 "_args_": [path]}]},
        "importlib.import_module": {"_target_": "importlib.import_module", "name": "antigravity"},
        "subprocess.run": {"_target_": "subprocess.run", "args": ["touch", str(marker)]},
        "a package's loader": {"_target_": "torch.hub.load", "repo_or_dir": str(plant.parent), "model": "x",
                               "source": "local"},
    }


@pytest.mark.parametrize("gadget", ["torch.load", "numpy.load", "pickle.loads", "importlib.import_module",
                                    "subprocess.run", "a package's loader"])
def test_a_config_from_a_checkpoint_naming_a_callable_config_does_not_offer_is_refused_unless_trusted(tmp_path,
                                                                                                   gadget):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from src.schema.trusted import check_targets, targets_in

    plant, marker = tmp_path / "plant.pkl", tmp_path / "ran"
    plant.write_bytes(pickle.dumps(Planted(marker)))
    config = OmegaConf.create({"model": gadgets(plant, marker)[gadget], "data": {"_target_": "src.data.text.TextData"}})
    with pytest.raises(UsageError) as error:
        check_targets(config, "checkpoint X/run_config.yaml")
    trusted = [value for key, value in targets_in(config) if key != "data._target_"]
    named(str(error.value), "checkpoint X/run_config.yaml", "model._target_=" + config.model._target_,
          *trusted)  # a callable nested in another's arguments too
    assert "data._target_" not in str(error.value)  # offered by config/data/text.yaml
    assert not marker.exists()
    check_targets(config, "checkpoint X/run_config.yaml", trusted)  # named on this run's command line: accepted
    if gadget in ("torch.load", "numpy.load"):  # the plant is live: what the check refuses would have run
        instantiate(config.model)
        assert marker.exists()


def test_a_node_building_interpolation_in_a_saved_config_is_refused():
    from omegaconf import OmegaConf

    from src.schema.trusted import check_targets

    config = OmegaConf.create({"model": "${oc.create:'{_target_: subprocess.run, args: [touch, x]}'}"})
    with pytest.raises(UsageError) as error:
        check_targets(config, "export Y/config.yaml")
    named(str(error.value), "export Y/config.yaml", "model=${oc.create:")


def test_resume_eval_sample_and_load_exported_model_build_nothing_a_planted_config_names(tmp_path, capsys):
    """Gadgets in a checkpoint's run_config.yaml (its checksums.json rewritten to match, as whoever plants a file
    can) and in an export's config.yaml: every reader refuses them, naming the key and the value, and nothing runs.
    The same run's own targets, named on the command line, are accepted."""
    from omegaconf import OmegaConf

    from src.checkpointing.checksums import write_checksums

    run_dir, marker, plant = tmp_path / "run", tmp_path / "ran", tmp_path / "plant.pkl"
    plant.write_bytes(pickle.dumps(Planted(marker)))
    args = [*TINY_GPT, *QUIET, "data.batch_size=4", "trainer.eval_batches=2", f"hydra.run.dir={run_dir}"]
    run([*args, "trainer.max_steps=1"])
    checkpoint, export = run_dir / "checkpoints" / "step_00000001", run_dir / "model"
    config = OmegaConf.load(checkpoint / "run_config.yaml")
    config.model = gadgets(plant, marker)["torch.load"]
    OmegaConf.save(config, checkpoint / "run_config.yaml")
    write_checksums(checkpoint)
    refused(run([*args, "trainer.max_steps=2", "resume=auto"], check=False), "model._target_=torch.load")
    refused(run([f"path={checkpoint}", "eval_batches=2"], script="eval.py", check=False),
            "model._target_=torch.load", "+model._target_=torch.load")
    OmegaConf.save(gadgets(plant, marker)["numpy.load"], export / "config.yaml")
    refused(run([f"path={export}", "eval_batches=2"], script="eval.py", check=False),
            "_target_=numpy.load", "+model._target_=numpy.load")
    assert sample.main([str(export), "--tokens", "4"]) == 2  # sample.py, in this process
    named(capsys.readouterr().err, "numpy.load", "--trust-target numpy.load")
    with pytest.raises(UsageError) as error:
        load_exported_model(export)
    named(str(error.value), "numpy.load", "trusted=['numpy.load']")
    assert not marker.exists()


def test_a_file_a_checkpoint_does_not_hold_is_refused_by_name(tmp_path):
    from src.checkpointing.integrity import check_readable
    from tests.test_checkpoint import fsdp_shaped_checkpoint

    checkpoint = fsdp_shaped_checkpoint(tmp_path)
    check_readable(checkpoint)
    for stranger in (checkpoint / "evil.py", checkpoint / "optimizer_0" / "notes.json", checkpoint / "extra"):
        stranger.mkdir() if stranger.name == "extra" else stranger.write_text("{}")
        with pytest.raises(UsageError) as error:
            check_readable(checkpoint)
        named(str(error.value), str(stranger))
        stranger.rmdir() if stranger.is_dir() else stranger.unlink()
    check_readable(checkpoint)
