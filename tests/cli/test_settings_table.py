"""The settings table (issue 13): every setting parses the same from its flag and its environment
mirrors, a bad value gets one message wherever it comes from, --help and the README agree with
the table, and the environment is a snapshot read once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.command_line import OPTIONS, resolve_values, serve_parser
from mlxcel.env import Environment, EnvError
from mlxcel.settings import BOOL, SETTINGS, Setting, SettingError, markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"
# A valid and an invalid text per kind phrase; text settings take anything.
_GOOD = {"integer": "3", "number": "2.5", "boolean": "true"}
_BAD = {"integer": "many", "number": "fast", "boolean": "maybe"}


def _good_text(setting: Setting, tmp: Path) -> str:
    if setting.kind.enum:
        return setting.kind.enum[-1]
    if setting.name == "loop_detection":
        return "min_count=3"
    if setting.name == "video_dir_allowlist":
        return str(tmp)
    if "JSON" in setting.kind.accepted:
        return '{"enable_thinking": false}'
    if "size" in setting.kind.accepted:
        return "2M"
    if setting.kind.accepted.endswith("<= 1"):  # a probability (--top-p, --min-p)
        return "0.5"
    return _GOOD.get(setting.kind.json_type, "text-value")


def _bad_text(setting: Setting) -> str | None:
    if setting.kind.enum or setting.kind.json_type in _BAD:
        return _BAD.get(setting.kind.json_type, "not-a-choice")
    if "size" in setting.kind.accepted or "JSON" in setting.kind.accepted or setting.name == "loop_detection":
        return "{lots"
    return None  # free text: nothing is invalid


def _from_flag(setting: Setting, text: str) -> dict[str, object]:
    flag = setting.flags[0]
    argv = {"value": [flag.names[0], text], "bool": [f"{flag.names[0]}={text}"]}.get(flag.action, [flag.names[0]])
    return resolve_values(serve_parser("mlxcel serve", "server").parse_args(argv), OPTIONS, Environment.read({}))


def _from_env(setting: Setting, env: str, text: str) -> dict[str, object]:
    return resolve_values(serve_parser("mlxcel serve", "server").parse_args([]), OPTIONS, Environment.read({env: text}))


def test_names_flags_and_variables_are_unique() -> None:
    names = [s.name for s in SETTINGS]
    flags = [n for s in SETTINGS for f in s.flags for n in f.names]
    envs = [e for s in SETTINGS for e in s.env]
    assert len(set(names)) == len(names) and len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    assert all(s.flags or s.env for s in SETTINGS), "a setting nothing can set"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.env], ids=lambda s: s.name)
def test_flag_and_env_mirror_give_the_same_value_and_error(setting: Setting, tmp_path: Path) -> None:
    text = _good_text(setting, tmp_path)
    for env in setting.env:
        from_env = _from_env(setting, env, text)[setting.name]
        assert from_env == setting.parse(text)
        if setting.flags and setting.flags[0].action in ("value", "bool"):
            assert _from_flag(setting, text)[setting.name] == from_env
    bad = _bad_text(setting)
    if bad is None:
        return
    with pytest.raises(EnvError) as from_env_error:
        _from_env(setting, setting.env[0], bad)
    assert setting.name in str(from_env_error.value) and setting.kind.accepted in str(from_env_error.value)
    if setting.flags and setting.flags[0].action in ("value", "bool"):
        with pytest.raises(SettingError) as from_flag_error:
            _from_flag(setting, bad)
        assert str(from_flag_error.value) == str(from_env_error.value)


@pytest.mark.parametrize("setting", [s for s in SETTINGS if any(f.action in ("on", "off") for f in s.flags)],
                         ids=lambda s: s.name)
def test_switch_flags_and_mirrors(setting: Setting) -> None:
    for flag in setting.flags:
        if flag.action in ("on", "off"):
            argv = [flag.names[-1]]
            got = resolve_values(serve_parser("x", "serve").parse_args(argv), OPTIONS, Environment.read({}))
            assert got[setting.name] is (flag.action == "on")
    for env in setting.env:
        assert _from_env(setting, env, "off")[setting.name] is False
        assert _from_env(setting, env, "enabled")[setting.name] is True


def test_cli_wins_over_mirror() -> None:
    got = resolve_values(serve_parser("x", "serve").parse_args(["--port", "1"]), OPTIONS,
                         Environment.read({"LLAMA_ARG_PORT": "2", "LLAMA_ARG_HOST": "h"}))
    assert (got["port"], got["host"]) == (1, "h")


@pytest.mark.parametrize("text", ["0", "", "none", "-1G", "1e400", "99999999999999999999T"])
def test_o_request_memory_budget_invalid_values_refuse_startup(text: str) -> None:
    with pytest.raises(EnvError, match="MLXCEL_REQUEST_MEMORY_BUDGET"):
        Environment.read({"MLXCEL_REQUEST_MEMORY_BUDGET": text})
    assert Environment.read({"MLXCEL_REQUEST_MEMORY_BUDGET": "24G"})["MLXCEL_REQUEST_MEMORY_BUDGET"] == 24 << 30


def test_snapshot_is_not_live(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_DEFAULT_ORG", "first")
    env = Environment.read()
    monkeypatch.setenv("MLXCEL_DEFAULT_ORG", "second")
    assert env["MLXCEL_DEFAULT_ORG"] == "first"
    with pytest.raises(KeyError):
        env["NOT_A_VARIABLE"]


def test_help_lists_every_setting() -> None:
    text = serve_parser("mlxcel serve", "serve").format_help()
    for setting in SETTINGS:
        for flag in setting.flags:
            assert all(name in text for name in flag.names), flag.names
        for env in setting.env:
            assert env in text, env


def test_readme_settings_table_is_the_generated_one() -> None:
    """Regenerate with `python -m mlxcel.settings` and paste between the markers."""
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- settings-table -->\n(.*?)<!-- /settings-table -->", text, re.S)
    assert found is not None and found.group(1) == markdown_table()


def test_readme_main_flags_exist() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Main flags", 1)[1].split("\n## ", 1)[0]
    known = {n for s in SETTINGS for f in s.flags for n in f.names}
    named = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", section.split("<!-- settings-table -->")[0]))
    assert named <= known, named - known


def test_bad_value_exits_2_with_one_line() -> None:
    run = subprocess.run([sys.executable, "-m", "mlxcel.cli", "serve", "--max-queue-depth", "lots"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "mlxcel serve: error: max_queue_depth (--max-queue-depth, LLAMA_ARG_MAX_QUEUE_DEPTH): 'lots' is not valid; "
        "expected a whole number >= 0"]


# a valid and an invalid text per sampling default (--temp, --top-k, ...)
_SAMPLING = {"default_temperature": ("0.7", "-0.1"), "default_top_k": ("-1", "1.5"), "default_top_p": ("0.9", "0"),
             "default_min_p": ("0.1", "1.01"), "default_repeat_last_n": ("-1", "-2"),
             "default_repeat_penalty": ("1.1", "0"), "default_presence_penalty": ("-0.5", "inf"),
             "default_frequency_penalty": ("0.25", "nan")}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.group == "sampling"], ids=lambda s: s.name)
def test_sampling_defaults_parse_from_each_spelling_with_one_error(setting: Setting) -> None:
    """--temp, --top-k, ...: unset unless given; every spelling (and LLAMA_ARG_TOP_K) gives one value, a bad
    text the one message naming the setting."""
    good, bad = _SAMPLING[setting.name]
    assert setting.default is None and setting.is_mutable
    assert _from_env(setting, "UNRELATED", "x")[setting.name] is None  # unset unless given
    for name in [n for flag in setting.flags for n in flag.names]:
        got = resolve_values(serve_parser("x", "serve").parse_args([name, good]), OPTIONS, Environment.read({}))
        assert got[setting.name] == setting.parse(good)
    for env in setting.env:
        assert _from_env(setting, env, good)[setting.name] == setting.parse(good)
    with pytest.raises(SettingError) as from_flag:
        _from_flag(setting, bad)
    assert str(from_flag.value).startswith(f"{setting.name} ({setting.flags[0].names[0]}")
    assert setting.kind.accepted in str(from_flag.value)


def test_a_bad_sampling_default_exits_2() -> None:
    run = subprocess.run([sys.executable, "-m", "mlxcel.cli", "serve", "--temperature", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "mlxcel serve: error: default_temperature (--temp, LLAMA_ARG_TEMP): '-1' is not valid; expected a finite number >= 0"]


@pytest.mark.parametrize("setting", [s for s in SETTINGS if isinstance(s.default, str) and s.default], ids=lambda s: s.name)
def test_a_text_default_is_what_its_own_parser_gives(setting: Setting) -> None:
    """Defaults are used unparsed: a size default written as "0" reached the engine as a string (issue 29)."""
    assert setting.kind.parse(setting.default) == setting.default


def test_issue47_help_says_where_the_disk_prefix_cache_lives_how_big_it_grows_and_how_to_clear_it() -> None:
    text = " ".join(serve_parser("mlxcel serve", "serve").format_help().split())  # argparse's wrapping undone
    for phrase in ("<models dir>/prefix-cache", "~/.cache/mlxcel/prefix-cache", "auto = 20G on the CPU",
                   "0 = no disk tier", "POST /v1/cache/reset"):
        assert phrase in text, phrase
