"""pyddp: data-parallel training for PyTorch with a C++ per-parameter all-reduce
engine that reduces each gradient during backward, as soon as every replica has it.

Public API: `wrap` / `DistributedModel` (one-line data parallelism), `GradSync`
(gradient sync for other training loops), `Trainer` / `TrainConfig` (the training
loop), `all_reduce`, `broadcast`, `all_gather`, `reduce_scatter` (collectives),
`init`/`rank`/`world` (across processes under torchrun), `Ranks` (`dmodel.ranks`:
the processes a model spans, and their small exchanges), errors."""

from importlib.metadata import PackageNotFoundError, version

from ._source_tree import use_installed_build

# Run from a clone's root, `import pyddp` finds this source folder, which has no
# compiled _C: the rest of the package then comes from the installed build.
__path__ = use_installed_build(__path__)

from ._link.control import Ranks
from .engine.collectives import all_gather, all_reduce, broadcast, reduce_scatter
from .engine.plan import plan_buckets
from .engine.sync import GradSync
from .errors import ReduceError, ReplicaError, TrainingError, UnsafePathError
from .optim import zero  # dmodel.optimizer(..., shard=True); zero.state_bytes
from .replicas.model import DistributedModel, wrap
from .replicas.syncbn import convert_sync_batchnorm
from .runtime.devices import default_devices, parse_devices
from .runtime.torchrun import init, is_main, local_rank, rank, world
from .train.callbacks import Callback, MetricsLogger, ProgressBar
from .train.config import TrainConfig
from .train.trainer import FitResult, LoopState, Trainer

try:
    # The distribution's name (pyproject.toml), not the import name: "pyddp"
    # on the package index is another project.
    __version__ = version("pyddp-engine")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "Callback",
    "DistributedModel",
    "FitResult",
    "LoopState",
    "MetricsLogger",
    "ProgressBar",
    "Ranks",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "UnsafePathError",
    "GradSync",
    "ReduceError",
    "ReplicaError",
    "all_gather",
    "all_reduce",
    "broadcast",
    "reduce_scatter",
    "convert_sync_batchnorm",
    "default_devices",
    "init",
    "is_main",
    "local_rank",
    "rank",
    "world",
    "parse_devices",
    "plan_buckets",
    "wrap",
    "zero",
    "__version__",
]
