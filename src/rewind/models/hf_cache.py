"""Models in the Hugging Face hub cache (the layout huggingface_hub writes), and `pull`.

The cache holds `models--ORG--NAME/` with `refs/main` (a commit hash), `snapshots/<commit>/`
(the files, as links into `blobs/`). A repo is servable when its snapshot is an mlx-lm folder
(config.json and *.safetensors) or holds a GGUF (converted to bf16 on first load).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rewind.models.conversion import is_model_folder

if TYPE_CHECKING:
    from rewind.models.pull_progress import PullProgress

# What a pull downloads: weights, configs, tokenizers and chat templates (no PyTorch or ONNX
# copies that some repos carry beside the safetensors).
PULL_PATTERNS = ["*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja", "*.tiktoken",
                 "*.py"]


def hub_cache() -> Path:
    """Where huggingface_hub keeps repos: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read at each call: tests and users set them after import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME")
                                                 or Path.home() / ".cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot refs/main names, else the newest one."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if candidate.is_dir():
            return candidate
    if not snapshots.is_dir():
        return None
    folders = [folder for folder in snapshots.iterdir() if folder.is_dir()]
    return max(folders, key=lambda folder: folder.stat().st_mtime) if folders else None


def servable_path(snapshot: Path) -> Path | None:
    if is_model_folder(snapshot):
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    return ggufs[0] if ggufs else None


def cached_models(cache: Path | None = None) -> Iterator[tuple[str, Path]]:
    """(ORG/NAME, model folder or GGUF file) of every servable repo in the hub cache."""
    cache = cache or hub_cache()
    if not cache.is_dir():
        return
    for repo_dir in sorted(cache.glob("models--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/")
        snapshot = _snapshot(repo_dir)
        path = servable_path(snapshot) if snapshot is not None else None
        if path is not None:
            yield repo, path


class PullError(RuntimeError):
    """A pull that cannot finish; the message says what to do."""


def check_repo_id(repo_id: str) -> None:
    """PullError unless `repo_id` has the hub's ORG/NAME shape (what its API accepts)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    shape = f"{repo_id!r} is not a Hugging Face repo id (ORG/NAME, e.g. mlx-community/Qwen3-0.6B-4bit)"
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PullError(shape)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise PullError(f"{shape}: {exc}") from None


def _download_counted(repo_id: str, revision: str | None, progress: PullProgress) -> None:
    """The files, fetched with their bytes counted. Where the hub cannot be reached this does
    nothing: snapshot_download, next, serves a cached copy or says the repo is not there."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    from rewind.models.pull_progress import download_files

    try:
        download_files(repo_id, revision, PULL_PATTERNS, str(hub_cache()), progress)
    except (OfflineModeIsEnabled, ConnectionError, TimeoutError):
        return  # snapshot_download tells these states apart, with the cache in view
    except Exception as exc:  # noqa: BLE001 - httpx's transport errors are not ConnectionError
        if not _is_transport_error(exc):
            raise


def _is_transport_error(exc: BaseException) -> bool:
    """A failure to reach the hub at all (connection refused, DNS, timeout), as opposed to
    an answer from it; named by module, as huggingface_hub's HTTP client has changed."""
    return any(cls.__module__.startswith("httpx") and cls.__name__ == "TransportError"
               for cls in type(exc).__mro__)


def pull(repo_id: str, revision: str | None = None, show_progress: bool = True,
         progress: PullProgress | None = None) -> Path:
    """Download `repo_id` into the hub cache (what is already there is not fetched again) and
    return the servable folder or GGUF. Offline (HF_HUB_OFFLINE=1, or no network), a repo
    already cached is returned as it is; one that is not raises PullError. With `progress`,
    bytes are counted there file by file (rewind.models.pull_progress)."""
    import huggingface_hub
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    check_repo_id(repo_id)
    if not show_progress:
        huggingface_hub.utils.disable_progress_bars()
    try:
        if progress is not None:
            _download_counted(repo_id, revision, progress)
        folder = huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                   allow_patterns=PULL_PATTERNS,
                                                   cache_dir=str(hub_cache()))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise PullError(f"the hub has no repo {repo_id!r}"
                        + (f" at revision {revision!r}" if revision else "")
                        + " (or it is private: log in with `hf auth login`)") from exc
    except GatedRepoError as exc:
        raise PullError(f"{repo_id!r} is gated: accept its terms on huggingface.co and log in "
                        "with `hf auth login`") from exc
    except LocalEntryNotFoundError as exc:
        # What snapshot_download raises offline (HF_HUB_OFFLINE=1 or no connection) for a repo
        # that is not in the cache.
        raise PullError(
            f"cannot download {repo_id!r}: the Hugging Face Hub is not reachable from here and "
            f"the repo is not in the cache ({hub_cache()}). Connect to the network (or set "
            "HF_ENDPOINT to a mirror, and unset HF_HUB_OFFLINE), or copy the model folder here "
            "and serve it with `rewind serve --model FOLDER`.") from exc
    path = servable_path(Path(folder))
    if path is None:
        raise PullError(f"{repo_id!r} downloaded to {folder}, but it holds neither an MLX model "
                        "(config.json and *.safetensors) nor a GGUF file; look for an MLX "
                        "conversion of it (e.g. under mlx-community/)")
    return path
