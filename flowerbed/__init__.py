"""flowerbed: reference implementations of recent federated-learning methods on Flower."""

import logging as _logging
import os as _os
from pathlib import Path as _Path

__version__ = "0.1.0"

# Our own handler on the "flowerbed" logger: configuring the root logger would also print
# Flower's DEBUG and httpx's per-request INFO lines.
_log = _logging.getLogger("flowerbed")
if not _log.handlers:
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(levelname)s flowerbed: %(message)s"))
    _log.addHandler(_h)
    _log.setLevel(_logging.INFO)
    _log.propagate = False


def cache_root() -> _Path:
    """Where flowerbed keeps what it can recompute (pre-trained weights, partitions):
    ``$FLOWERBED_CACHE``, else ``~/.cache/flowerbed``."""
    return _Path(_os.environ.get("FLOWERBED_CACHE", _Path.home() / ".cache" / "flowerbed"))
