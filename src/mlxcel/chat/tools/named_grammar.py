"""Call grammars for formats that write a call's name outside its arguments JSON (harmony,
DeepSeek, Mistral's `name[ARGS]{...}`): one rule per declared tool, the name as a literal and
the arguments as that tool's JSON Schema. chat/grammar.py calls a format module's `lark_tools`
where it has one, instead of the JSON call-object grammar the other formats share.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Tools = Sequence[tuple[str, Mapping[str, Any]]]  # (name, parameters schema), as grammar.py reads them
Literal = Callable[[str], str]  # a marker in Lark: its text, or its special token
Arguments = Callable[[Mapping[str, Any]], str]  # an arguments schema in Lark (`%json {...}`)


def named_calls(tools: Tools, arguments: Arguments, spell: Callable[[str, str], str]) -> str:
    """Lark rules: `call` is one of the tools, each spelled by `spell(name literal, arguments rule)`."""
    lines = ["call: " + " | ".join(f"tool_{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools):
        lines.append(f"tool_{i}: {spell(json.dumps(name), f'args_{i}')}")
        lines.append(f"args_{i}: {arguments(parameters)}")
    return "\n".join(lines) + "\n"
