"""sglang-sidecar: admission control in front of one SGLang engine."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("sglang-sidecar")
except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
