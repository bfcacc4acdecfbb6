"""The process environment, read once at startup through the settings table.

`Environment.read()` takes a snapshot of `os.environ` (or any mapping, for tests) and parses
every variable that `mlxcel.settings.SETTINGS` declares as a mirror (`LLAMA_ARG_*`, `MLXCEL_*`,
`LLAMA_API_KEY`, `LLAMA_LOG_FILE`); a malformed value refuses startup with the setting's one
message (`SettingError`, also exported as `EnvError`). `media_policy` reads a snapshot's MLXCEL_*
media variables through the same settings into a `MediaPolicy`. Nothing reads `os.environ` at
import time (DESIGN.md anti-patterns).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel.settings import BY_ENV, SettingError, parse_bool, read_environment

if TYPE_CHECKING:
    from mlxcel.media.limits import MediaPolicy

EnvError = SettingError  # a variable has a value its setting cannot hold; startup is refused
__all__ = ["EnvError", "Environment", "media_policy", "parse_bool"]


@dataclass(frozen=True, slots=True)
class Environment:
    """A parsed snapshot of the process environment."""

    values: Mapping[str, Any] = field(default_factory=dict)  # setting name -> value, for the mirrors set
    raw: Mapping[str, str] = field(default_factory=dict)  # the whole snapshot

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """Parse `environ` (default os.environ) once; raises EnvError naming a bad variable."""
        raw = dict(os.environ if environ is None else environ)
        return cls(read_environment(raw), raw)

    def __getitem__(self, name: str) -> Any:
        """The value of the setting that variable `name` mirrors (its default when unset)."""
        if name not in BY_ENV:
            raise KeyError(f"{name} is not an environment mirror in mlxcel.settings.SETTINGS")
        setting = BY_ENV[name]
        return self.values.get(setting.name, setting.default)


def media_policy(environ: Mapping[str, str], **cli: Any) -> MediaPolicy:
    """The media policy (C2-C5) of `environ`'s MLXCEL_* media variables, each parsed by its setting,
    with the `cli` values (None: not given) over them; raises MediaConfigError naming what is bad."""
    from mlxcel.media.errors import MediaConfigError  # the media package loads only when asked for
    from mlxcel.media.limits import ENV_FIELDS, ENV_VIDEO_DIR_ALLOWLIST, MediaPolicy, parse_dir_allowlist

    values: dict[str, Any] = {}
    try:
        for name in ENV_FIELDS.keys() & environ.keys():
            values[ENV_FIELDS[name]] = BY_ENV[name].parse(environ[name])
    except SettingError as exc:
        raise MediaConfigError(str(exc)) from None
    if isinstance(values.get("video_dir_allowlist"), str):
        values["video_dir_allowlist"] = parse_dir_allowlist(ENV_VIDEO_DIR_ALLOWLIST, values["video_dir_allowlist"])
    return MediaPolicy.from_values(**{**values, **{k: v for k, v in cli.items() if v is not None}})
