"""The loopback test for the network guards of the media and loading tests: no test may reach
(or let the server reach) an address outside 127.0.0.0/8 and ::1."""

from __future__ import annotations

import ipaddress
from typing import Any


class NonLoopbackAccess(BaseException):
    """Raised by a guard; a BaseException so no `except Exception` in the code under test hides it."""


def is_loopback(host: Any) -> bool:
    if host in (None, "localhost", b"localhost"):
        return True
    try:
        text = host.decode() if isinstance(host, bytes) else str(host)
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
