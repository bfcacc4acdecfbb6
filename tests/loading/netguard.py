"""The loopback-only network guard: in this process (the conftest fixture) and, as a
sitecustomize.py, in CLI subprocesses. No loading test may reach a non-loopback address."""

from __future__ import annotations

from tests.netguard import NonLoopbackAccess, is_loopback  # noqa: F401 - re-exported for the loading tests


# The guard, for CLI subprocesses: a sitecustomize.py on PYTHONPATH installs it at start-up.
SUBPROCESS_GUARD = '''
import ipaddress, os, socket, sys
def _loopback(host):
    if host in (None, "localhost", b"localhost"):
        return True
    try:
        text = host.decode() if isinstance(host, bytes) else str(host)
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
def _check(host):
    if not _loopback(host):
        sys.stderr.write(f"NON-LOOPBACK ACCESS: {host!r}\\n")
        sys.stderr.flush()
        os._exit(99)  # no except clause in the code under test can swallow this
_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo
def _guarded_connect(self, address):
    if isinstance(address, tuple):
        _check(address[0])
    return _connect(self, address)
def _guarded_getaddrinfo(host, *args, **kwargs):
    _check(host)
    return _getaddrinfo(host, *args, **kwargs)
socket.socket.connect, socket.getaddrinfo = _guarded_connect, _guarded_getaddrinfo
'''
