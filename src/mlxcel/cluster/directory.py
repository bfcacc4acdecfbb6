"""The live request routers of this process, by app name (spec X).

Ray Serve pickles a custom router's module by value and builds the router inside the
deployment handle, so the entry point cannot hold a reference to it; the router registers
itself here (this module travels by reference) and the entry looks it up.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_routers: dict[str, Any] = {}


def register(app_name: str, router: Any) -> None:
    with _lock:
        _routers[app_name] = router


def find(app_name: str) -> Any | None:
    with _lock:
        return _routers.get(app_name)
