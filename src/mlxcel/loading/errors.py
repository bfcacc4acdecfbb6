"""The one error type loading raises: its message is the single line the CLI prints."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model argument could not be resolved or read; the message names what was tried."""
