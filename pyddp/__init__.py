"""pyddp: data-parallel training for PyTorch with a C++ per-parameter all-reduce
engine that reduces each gradient during backward, as soon as every replica has it.

Public API: `wrap` / `DistributedModel` (one-line data parallelism), `GradSync`
(gradient sync for other training loops), `all_reduce` (collectives), errors."""

from importlib.metadata import PackageNotFoundError, version

from ._workers import ReplicaError
from .collectives import all_reduce
from .devices import default_devices, parse_devices
from .model import DistributedModel, wrap
from .sync import GradSync, ReduceError

try:
    __version__ = version("pyddp")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "DistributedModel",
    "GradSync",
    "ReduceError",
    "ReplicaError",
    "all_reduce",
    "default_devices",
    "parse_devices",
    "wrap",
    "__version__",
]
