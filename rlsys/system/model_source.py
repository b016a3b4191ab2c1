"""Where `model.path` points: a local checkpoint directory, or a Hugging Face hub id
(`Qwen/Qwen2.5-7B-Instruct`) resolved through huggingface_hub's own cache.

A hub id is resolved once, on the driver, to one commit (`model.revision` names a branch, tag or
commit; `main` when unset) and to that commit's snapshot directory, which then stands in
`model.path` for everything downstream (the trainer ranks, the engines, the memory plan, export).
`model.hub_id` keeps the id. huggingface_hub decides where the cache is (`HF_HOME`,
`HF_HUB_CACHE`) and whether to go online (`HF_HUB_OFFLINE`); online, a snapshot missing from the
cache is downloaded, weights as safetensors only.

Every other node of the run resolves the same id at the same commit in its own process
(rlsys/system/node_checks.py), downloading when it must, and must find it at the driver's path:
the ranks and engines are handed one path, so the nodes' caches must sit at the same place
(a shared HF_HOME, or the same HF_HOME on each node).
"""

from __future__ import annotations

import re
from pathlib import Path

from rlsys.config import ConfigError, RunConfig

# `owner/name` as the hub spells repository ids (huggingface_hub.utils.validate_repo_id's characters).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")
# Other serialisations of the same weights a repository may carry (Llama's `original/`, PyTorch
# pickles, TF/Flax/ONNX/GGUF): never needed when it has safetensors.
_NOT_NEEDED = ["original/*", "*.pth", "*.pt", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot", "*.tflite"]


def is_hub_id(path: str) -> bool:
    """A path that is no local file or directory and is spelt `owner/name`."""
    return _HUB_ID.fullmatch(path) is not None and not Path(path).exists()


def snapshot_of(repo_id: str, revision: str | None, option: str = "model.path") -> Path:
    """The local snapshot directory of `repo_id` at `revision` (huggingface_hub's cache; downloaded
    when the machine is online and the cache lacks it). ConfigError saying what to do otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{option} {repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        # local_files_only when offline: with a commit as revision, snapshot_download would otherwise
        # ask the hub for the commit's file list (OfflineModeIsEnabled) before looking in the cache.
        return Path(snapshot_download(repo_id, revision=revision, ignore_patterns=_NOT_NEEDED,
                                      local_files_only=constants.HF_HUB_OFFLINE))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(
                f"invalid config: {where} is a Hugging Face hub id that is in no hub cache and HF_HUB_OFFLINE is "
                f"set (cache: {constants.HF_HUB_CACHE}); download it on a machine online (`hf download {repo_id}`) "
                "into that cache, set HF_HUB_CACHE/HF_HOME to the cache that holds it, or point the option at a "
                "local checkpoint directory") from None
        raise ConfigError(
            f"invalid config: {where} is a Hugging Face hub id that is not in the hub cache "
            f"({constants.HF_HUB_CACHE}) and the hub could not be reached to download it; connect this machine, "
            "fill the cache, or point the option at a local checkpoint directory") from None
    except GatedRepoError:
        raise ConfigError(f"invalid config: {where} is a gated repository; accept its terms on the hub and log in "
                          "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"invalid config: {where}: no such repository on the hub (or it is private: log in with "
                          "`hf auth login` or HF_TOKEN), and no such local directory") from None
    except RevisionNotFoundError:
        raise ConfigError(f"invalid config: {where}: the repository has no such revision (model.revision: "
                          "a branch, tag or commit)") from None
    except HfHubHTTPError as error:
        raise ConfigError(f"invalid config: {where}: the hub refused the download: {error}") from None


def resolve_model_paths(config: RunConfig) -> RunConfig:
    """`config` with hub ids in model.path / model.tokenizer_path replaced by their local snapshot
    directories, model.revision pinned to the commit resolved and model.hub_id set. Local paths
    pass through untouched (a revision with one is refused)."""
    model = config.model
    updates = {}
    if is_hub_id(model.path):
        snapshot = snapshot_of(model.path, model.revision)
        updates.update(path=str(snapshot), hub_id=model.path, revision=snapshot.name)  # snapshots/<commit>
    elif model.revision is not None and model.hub_id is None:
        raise ConfigError(f"invalid config: model.revision {model.revision!r} is set but model.path {model.path} is "
                          "a local directory (a revision pins a Hugging Face hub id); remove model.revision")
    if model.tokenizer_path and is_hub_id(model.tokenizer_path):
        updates.update(tokenizer_path=str(snapshot_of(model.tokenizer_path, None, "model.tokenizer_path")))
    return config.model_copy(update={"model": model.model_copy(update=updates)}) if updates else config
