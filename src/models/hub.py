"""A pretrained model, tokenizer or dataset named by its Hugging Face hub id (`gpt2`, `Qwen/Qwen2.5-0.5B`,
`Salesforce/wikitext`) where a local folder is expected (model.pretrained, data.tokenizer, data.path of
data=hf_dataset).

The id is fetched into the Hugging Face cache ($HF_HOME/hub, the one transformers and `hf download` use) by each
machine's first process while the others wait, then every process reads it from there. Only what is read comes
down: of a model its configs, safetensors weights and tokenizer files (not the repository's copies of the weights
for other frameworks), of a dataset its card and data files. A path that exists always wins over an id. Where
the hub cannot be reached (HF_HUB_OFFLINE=1, compute nodes without a network) the cached copy is used as it is,
so `hf download NAME` on a login node fills the cache for the jobs. Private and gated repositories need `hf auth
login` first.

Revisions are pinned: a run records the commit it fetched of each id (model.revision, data.tokenizer_revision)
in its config, and reads the id at that commit, so a resume or an evaluation reads the files the run started from
even after the hub or the cache has moved on.
"""

import logging
from pathlib import Path
from typing import Optional

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from src.errors import UsageError
from src.launch.first_per_machine import local_main_first

log = logging.getLogger(__name__)

# What from_pretrained reads: config and generation config, safetensors weights (with their index), and the
# tokenizer's files (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, tokenizer.model, ...).
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
OLD_WEIGHTS = ["pytorch_model*.bin"]  # repositories from before safetensors have only these
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken"]
# A dataset repository's data files in the formats data=hf_dataset reads, where its card does not say which
# files are the subset's (a repository can hold many large subsets: its card's `configs` name their files).
DATASET_FILES = ["*.parquet", "*.arrow", "*.json", "*.jsonl", "*.csv"]
CARD = "README.md"


def is_hub_id(name: str) -> bool:
    """A name that is no existing path and has the form of a hub id (NAME or OWNER/NAME)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def local_path(name: str, key: str, files: list[str] = MODEL_FILES, refresh: bool = False,
               repo_type: str = "model", quiet: bool = False, revision: Optional[str] = None) -> Path:
    """The local file or folder a config value names: a path as it is, a hub id as its snapshot in the cache,
    downloaded where the cache has none. `refresh` (one process per machine): ask the hub for its newest
    revision first, and log which one it is. `revision`: that branch, tag or commit (else the one pinned)."""
    if not is_hub_id(name):
        return Path(name).expanduser()
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    def snapshot(patterns: list[str], **options) -> Path:
        return Path(snapshot_download(name, repo_type=repo_type, revision=revision, allow_patterns=patterns,
                                      **options))

    try:
        if not refresh:
            try:
                return snapshot(files, local_files_only=True)
            except LocalEntryNotFoundError:
                pass  # not cached yet: download
        folder = snapshot(files)
        if files is MODEL_FILES and not any(folder.glob("*.safetensors")):
            folder = snapshot(files + OLD_WEIGHTS)
        if not quiet:
            log.info("%s=%s: the Hugging Face hub's revision %s, in %s", key, name, folder.name, folder)
        return folder
    except RevisionNotFoundError:
        raise UsageError(f"{key}={name}: the Hugging Face hub has no revision {revision!r} of it (model.revision: a "
                         "branch, tag or commit of the repository)") from None
    except RepositoryNotFoundError as error:  # a gated repository's error is one too
        raise UsageError(f"{key}={name}: no such local path (relative paths are relative to {Path.cwd()}), and "
                         f"the Hugging Face hub has no {repo_type} of that name that this machine may read ("
                         f"{type(error).__name__}): check the name, and for a private or gated {repo_type} log in "
                         "(`hf auth login`) after accepting its terms on its hub page") from None
    except LocalEntryNotFoundError as error:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _first_line(error)
        download = f"hf download {name}" + (f" --repo-type {repo_type}" if repo_type != "model" else "")
        raise UsageError(f"{key}={name}: no such local path (relative paths are relative to {Path.cwd()}), and "
                         f"the Hugging Face hub cannot be reached ({why}) while its cache ({constants.HF_HUB_CACHE}) "
                         f"has no copy: run `{download}` on a machine with a network (it fills the same "
                         f"cache), or give {key} a local path") from None
    except OSError as error:  # the hub's other HTTP errors, a full disk
        raise UsageError(f"{key}={name}: fetching it from the Hugging Face hub failed: {_first_line(error)}") from None


def dataset_path(name: str, subset: Optional[str], refresh: bool = False, key: str = "data.path") -> Path:
    """data.path of data=hf_dataset (`key`: what the caller calls it): a path as it is; a hub id as the snapshot of
    its card and of the data files the card gives the subset (all data files where it does not say)."""
    if not is_hub_id(name):
        return Path(name).expanduser()
    card = local_path(name, key, [CARD], refresh, "dataset", quiet=True) / CARD
    files = subset_files(card, subset) or DATASET_FILES
    return local_path(name, key, [CARD, *files], refresh, "dataset")


def subset_files(card: Path, subset: Optional[str]) -> list[str]:
    """The path patterns of a subset's data files, as a dataset card's metadata (`configs`) gives them; without
    a subset, the default or only one's. [] where the card does not say."""
    from huggingface_hub import metadata_load

    metadata = metadata_load(card) if card.is_file() else None
    configs = (metadata or {}).get("configs") or []
    if subset is None:
        configs = [c for c in configs if c.get("default")] or (configs if len(configs) == 1 else [])
    chosen = next((c for c in configs if subset is None or c.get("config_name") == subset), {})
    patterns = []
    for entry in _as_list(chosen.get("data_files")):
        patterns += _as_list(entry.get("path") if isinstance(entry, dict) else entry)
    return patterns


def _as_list(value) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def fetch_from_hub(accelerator: Accelerator, model_cfg, data_cfg, built_in_tokenizers: tuple,
                   objective_cfg=None) -> dict[str, str]:
    """Fetch the hub ids that model.pretrained, data.tokenizer and objective.teacher name, once per machine, before
    any process reads them: the first process of each machine asks the hub for model.revision /
    data.tokenizer_revision / objective.teacher_revision (or the newest), the others then find it in the cache.
    Returns key -> the commit fetched (the same on every rank), for the keys that name a hub id."""
    objective_cfg = objective_cfg or {}
    wanted: dict[str, tuple[list[str], list[str], Optional[str]]] = {}  # hub id -> (keys, files, revision)
    for key, name, files, revision in (
            ("model.pretrained", model_cfg.get("pretrained"), MODEL_FILES, model_cfg.get("revision")),
            ("data.tokenizer", data_cfg.get("tokenizer"), TOKENIZER_FILES, data_cfg.get("tokenizer_revision")),
            ("objective.teacher", objective_cfg.get("teacher"), MODEL_FILES, objective_cfg.get("teacher_revision"))):
        if isinstance(name, str) and name not in built_in_tokenizers and is_hub_id(name):
            keys, _, asked = wanted.setdefault(name, ([], files, revision))
            keys.append(key)  # a model's id serves its tokenizer too (the data's default): one fetch
            if revision and asked and revision != asked:
                raise UsageError(f"{' and '.join(keys)} name {name} at two revisions: {asked} and {revision}")
            wanted[name] = (keys, files, asked or revision)
    commits: dict[str, str] = {}  # hub id -> commit
    with local_main_first():
        for name, (keys, files, revision) in wanted.items():
            folder = local_path(name, " and ".join(keys), files, refresh=accelerator.is_local_main_process,
                                revision=revision)
            commits[name] = folder.name  # a snapshot's folder is named by its commit
    if accelerator.num_processes > 1:  # machines fetch at their own moment: all read the commit rank 0 got
        agreed = broadcast_object_list([commits])[0]
        for name, (keys, files, _) in wanted.items():
            if agreed[name] != commits[name]:
                commits[name] = local_path(name, " and ".join(keys), files, revision=agreed[name]).name
    return {key: commits[name] for name, (keys, _, _) in wanted.items() for key in keys}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

