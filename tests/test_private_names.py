"""The private names of torch, accelerate, lm-eval and datasets that the code relies on, each still there: an
upgrade that removes or renames one fails here, naming it, before a run fails somewhere deep. docs/development.md
lists the same names (checked below), with where each is used."""

import importlib

import pytest

from tests.conftest import ROOT

# (module, attribute path) -> where the code uses it. An attribute path starting with "()" is read from an
# instance (made without arguments, or as noted in `instance` below).
PRIVATE_NAMES = {
    ("torch.distributed.checkpoint._hf_utils", "CUSTOM_METADATA_KEY"): "plain_state.sharded_writer, integrity",
    ("torch.distributed.checkpoint._hf_utils", "SAVED_OFFSETS_KEY"): "plain_state.sharded_writer, integrity",
    ("torch.distributed.checkpoint._hf_utils", "DCP_VERSION_KEY"): "plain_state.sharded_writer",
    ("torch.distributed.checkpoint._hf_utils", "FORMAT_KEY"): "plain_state.sharded_writer",
    ("torch.distributed.checkpoint._hf_utils", "FORMAT_VALUE"): "plain_state.sharded_writer",
    ("torch.distributed.checkpoint._hf_utils", "HF_DCP_VERSION"): "plain_state.sharded_writer",
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "shard_written.ShardWritten",
    ("torch.distributed.checkpoint", "HuggingFaceStorageReader.read_data"): "plain_state.sharded_reader",
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"): "pretrained_slices",
    ("torch.distributed.distributed_c10d", "_get_default_store"): "faults/hang_watch",
    ("torch.nn.modules.batchnorm", "_BatchNorm"): "loop/sync_batchnorm",
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"): "objectives/grpo._gathered",
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState()._fsdp_param_groups"): "objectives/grpo._gathered",
    ("torch._dynamo", "maybe_mark_dynamic"): "loop/forward",
    ("torch.optim._muon", "_zeropower_via_newtonschulz"): "optim/muon.WholeMatrixMuon",
    ("torch.optim._muon", "_adjust_lr"): "optim/muon.WholeMatrixMuon",
    ("torch.optim", "Muon._init_group"): "optim/muon.WholeMatrixMuon",
    ("torch.nn", "Module()._parameters"): "launch/sharded_start",
    ("accelerate", "Accelerator()._models"): "checkpointing/training_state, load",
    ("accelerate", "Accelerator()._optimizers"): "checkpointing/training_state, checkpointer",
    ("accelerate", "Accelerator()._schedulers"): "checkpointing/training_state",
    ("accelerate.state", "AcceleratorState._shared_state"): "tests/fsdp_on_cpu.py",
    ("lm_eval.api.model", "TemplateLM._loglikelihood_tokens"): "loop/harness_model (overridden)",
    ("datasets", "Dataset._fingerprint"): "data/hf_dataset (its map cache key)",
}


def resolve(module: str, path: str):
    value = importlib.import_module(module)
    for part in path.split("."):
        if part.endswith("()"):
            value = getattr(value, part[:-2])
            value = value(cpu=True) if value.__name__ == "Accelerator" else value()
        elif part == "_fingerprint":  # set on each dataset, not on the class
            value = value.from_dict({"a": [1]})._fingerprint
        else:
            value = getattr(value, part)
    return value


@pytest.mark.parametrize("module, path", sorted(PRIVATE_NAMES), ids=[f"{m}.{p}" for m, p in sorted(PRIVATE_NAMES)])
def test_a_private_name_the_code_relies_on_is_still_there(module, path):
    pytest.importorskip(module.split(".")[0])
    try:
        resolve(module, path)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{module}.{path} (used by {PRIVATE_NAMES[module, path]}) is gone after an upgrade: {error}")


def test_the_development_page_lists_every_private_name():
    page = (ROOT / "docs" / "development.md").read_text()
    assert [f"{m}.{p}" for m, p in PRIVATE_NAMES if f"`{m}.{p}`" not in page] == []
