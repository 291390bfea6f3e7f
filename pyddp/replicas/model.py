"""`pyddp.wrap(model, devices)`: persistent replicas driven from one process.
Forward scatters the batch, runs every replica on its own persistent worker and
gathers outputs on devices[0]; backward through the gathered output (or the
per-replica loss) runs every replica's backward and reduces gradients during it
through GradSync."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Type, Union

import torch
from torch import nn

from .._link.control import Ranks
from ..engine.faces import ReplicaDriver
from ..engine.options import Options
from ..engine.params import assemble, refuse_unready
from ..engine.reducer import Reducer
from ..optim.clipping import clip_norm, clip_values, finite_check, flat_grads
from ..optim.factory import ParamsFn, make_optimizer
from ..optim.unsynced import watch_steps
from ..runtime.compiled import EagerUnderDynamo
from ..runtime.devices import DeviceLike, parse_devices, process_devices
from ..runtime.libraries import timeout_s
from ..runtime.torchrun import refuse_training_alone
from .ddp_args import StateDictKeys, wrap_options
from .mirror import ReplicaMirror, planned_as_trainable, replica_copies
from .scatter import batch_size
from .staged import StagedBuffers
from .steps import ReplicaSteps, StepFlags, release
from .syncbn import SyncBatchNorms, refuse_full_graph, sync_layers
from .uneven import STAGE2_UNDER_JOIN, Joinable, Joining
from .watch import OneReplicaWatch
from .workers import ReplicaWorkers


class DistributedModel(StateDictKeys, nn.Module, Joining, ReplicaSteps):
    """A model replicated over `devices`; see `pyddp.wrap`."""

    def __init__(
        self,
        module: nn.Module,
        devices: Optional[Sequence[DeviceLike]] = None,
        *,
        _options: Optional[Options] = None,
        **options: Any,
    ):
        super().__init__()
        Joinable.__init__(self)  # torch's Join: disabled until a Join enables it
        if isinstance(module, DistributedModel):
            raise TypeError(
                "the model is already wrapped (a pyddp DistributedModel): use it as it is, or "
                "wrap its .module after closing it"
            )
        refuse_unready(module)  # a module, none of it lazy (before it is copied)
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise TypeError(
                f"the model is already wrapped in torch's {type(module).__name__}: wrap its "
                ".module instead (two data-parallel wrappers would reduce every gradient twice)"
            )
        opts = _options or Options.for_wrap(wrap_options(options, "pyddp.wrap", placed=False))
        if opts.group is None:
            refuse_training_alone()  # before any replica is copied to a device
        self.devices: List[torch.device] = (
            process_devices(opts.group) if devices is None else parse_devices(devices)
        )
        self.module = module.to(self.devices[0])
        replicas = replica_copies(self.module, self.devices)
        # A plain list, not submodules: parameters() and state_dict() show one copy.
        self._replicas: List[nn.Module] = replicas
        self._callables: List[Callable[..., Any]] = list(replicas)  # compiled by compile()
        self._compiled_replicas = False  # by compile() or torch.compile(self): compiled.py
        # opts has check_replicas=False: deep copies of replica 0. The link, the work
        # record and the GPU placement are the model's as much as the reducer's.
        with planned_as_trainable(replicas, opts.follow_unfreezing):  # mirror.py
            parts = assemble(replicas, opts, "pyddp.wrap")
            self._link, self._work = parts.link, parts.work
            self._join = parts.link.joining  # torch's Join's exchanges and state (uneven.py)
            self._gpus, self._streams = parts.gpu_devices, parts.streams
            self.broadcast_buffers = opts.broadcast_buffers
            threads_per_replica = opts.threads_per_replica
            if threads_per_replica is None and len(replicas) > 1 and self.devices[0].type == "cpu":
                # CPU replicas compute at once: share the cores instead of every
                # replica using torch's full intra-op count (oversubscription).
                threads_per_replica = max(1, torch.get_num_threads() // len(replicas))
            self._workers = ReplicaWorkers(
                len(replicas), threads_per_replica, self.devices, streams=self._streams
            )
            # One replica in a process of several: a backward may bypass the
            # model's outputs; the first gradient hook queues its end then.
            one = len(replicas) == 1 and parts.reduces
            # _begin prepares every replica; no hook on the user's model (a hook
            # there would also sit inside `dmodel.compile()`'s graphs).
            self._reducer: ReplicaDriver = Reducer(
                parts,
                prepare_on_forward=False,
                run_per_replica=self._workers.run,
                in_turn=self._workers.runs_in_turn,
                on_backward_start=weakref.WeakMethod(self._backward_began) if one else None,
            )
        try:
            if len(replicas) > 1:  # (before the mirror looks)
                self._workers.guard_replicas(replicas, self.devices[0].type == "cpu")
            self._mirror = ReplicaMirror(replicas, parts.names) if len(replicas) > 1 else None
            self._params_moved = lambda m=self._mirror: m.storage.moved_ids()  # (with replicas)
            # One replica across processes: no parameter trains unreduced (watch.py).
            self._watch = OneReplicaWatch(self.module, parts.params[0]) if one else None
            if one:  # a step of the user's optimizer after no_sync() backwards only
                watch_steps(parts.params[0], weakref.WeakMethod(self._reducer.gradients))
        except BaseException:
            self._reducer.close()  # no hooks left behind on the user's model
            self._workers.close()
            raise
        # CPU replicas: autograd would run every replica's backward on the one
        # calling thread, so backward is dispatched to the replica workers.
        # CUDA replicas get a thread per device from autograd itself.
        self._parallel_backward = len(replicas) > 1 and self.devices[0].type == "cpu"
        # One replica and one process: nothing to scatter, join or reduce.
        self._passthrough = not self._reducer.reduces
        self._flags = StepFlags()
        self._staged = StagedBuffers(self._gpus is not None)  # rank 0's, for the next forward
        self._syncbn: Optional[SyncBatchNorms] = None
        self._optimizers: List[weakref.ref] = []  # dmodel.optimizer's, for Join's end
        self._apart_after_join = ""  # why training is refused after Join (optim/after_join.py)
        if sync_layers(self.module) and not self._passthrough:
            self._syncbn = self._bind_sync_batchnorm(replicas, opts)
        # Dropped while an optimizer holds the reducer: nothing left on the model.
        weakref.finalize(self, release, self._workers, self._reducer, self._syncbn, False)
        self._direct = one and self.devices[0].type == "cpu"  # forward: _forward_direct
        try:
            self._workers.set_mode(
                opts.run_replicas, self.devices, self._syncbn is not None, self._gpus
            )
        except ValueError:
            self.close()
            raise

    def run_replicas(self) -> Dict[str, str]:
        """How each kind of the replicas' work runs now (wrap's run_replicas),
        e.g. {"forward": "in_turn", "backward": "in_turn"} ("auto" keeps one
        way for all); "trying" while "auto" times both ways; {"*": mode}
        where the mode is fixed."""
        return self._workers.choices()

    def _bind_sync_batchnorm(self, replicas: List[nn.Module], opts: Options) -> SyncBatchNorms:
        gpus, stats = self._gpus, self._link.statistics
        try:
            return SyncBatchNorms(
                replicas,
                self.devices[0],
                # On GPUs the statistics are summed on the devices instead.
                stats.summer() if gpus is None else None,
                opts.timeout_s or timeout_s(),
                None
                if gpus is None
                else (
                    gpus,
                    self._streams,
                    lambda: stats.backend(gpus, opts.timeout_s),
                ),
            )
        except BaseException:
            self._reducer.close()
            raise

    # ---------------------------------------------------------------- access
    @property
    def replicas(self) -> List[nn.Module]:
        return list(self._replicas)

    @property
    def ranks(self) -> Ranks:
        """The processes this model spans (`pyddp.Ranks`): this
        rank, the world, and the collective exchanges the Trainer makes."""
        return self._link.ranks

    @property
    def last_global_loss(self) -> Optional[float]:
        """Across processes, on CPU replicas: the global batch's loss of the
        last training step's dmodel.loss (reduction "mean"), known once its
        backward finished (None after a "sum" step, in one process, and on
        GPUs, where reading it would make the host wait)."""
        return self._link.global_loss

    def optimizer(
        self,
        cls: Optional[Type[torch.optim.Optimizer]] = None,
        params: Optional[ParamsFn] = None,
        *,
        shard: Union[bool, str] = False,
        optimizer_class: Optional[Type[torch.optim.Optimizer]] = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """One optimizer stepping every replica (an instance of `cls`'s subclass).
        `params`, if given, maps a replica module to its parameters or groups.
        `shard=True` (or "state"): ZeRO stage 1 (pyddp.optim.zero): each replica
        of each process holds optimizer state for its share of the parameters
        only, and state_dict() is the unsharded one's. `shard="gradients"`:
        ZeRO stage 2: buckets are reduce-scattered, each replica keeps the
        reduced gradient of its share only (clip with dmodel.clip_grad_norm_)."""
        self._check_open()
        if (cls is None) == (optimizer_class is None):
            raise TypeError(
                "dmodel.optimizer takes the optimizer class once: as its first argument, or "
                "as optimizer_class= (torch's ZeroRedundancyOptimizer spelling)"
            )
        if shard == "gradients" and self._join.before_sharded_step is not None:
            raise NotImplementedError(STAGE2_UNDER_JOIN)  # made inside a Join block
        self._follow_model()  # (the replicas' `params` see the user's changes: requires_grad)
        shards = self._reducer.gradients()
        if self._mirror is not None:  # (replicas here: a sharded step follows edits first)
            shards.follow_model_with(self._mirror.follow_at_step)
        opt = make_optimizer(shards, cls or optimizer_class, params, shard, **kwargs)
        self._work.shard = {"state": True}.get(shard, shard)  # type: ignore[call-overload]
        self._work.note_made(opt)
        self._link.settings_changed()
        self._optimizers.append(weakref.ref(opt))
        return opt

    def _optimizers_made(self) -> List[torch.optim.Optimizer]:
        """The optimizers dmodel.optimizer made that are still alive, in the
        order made (Join aligns them to the last joiner's at its end)."""
        alive = [o for o in (ref() for ref in self._optimizers) if o is not None]
        self._optimizers = [weakref.ref(o) for o in alive]
        return alive

    def no_sync(self):
        """Backwards inside accumulate without reducing; the next synced backward
        reduces the accumulated sum."""
        self._check_open()
        return self._reducer.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reducer.gradients().zero_grad(set_to_none)  # (drops a backward cut short)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's register_comm_hook (see GradSync.register_comm_hook):
        e.g. `dmodel.register_comm_hook(None, "bf16")`."""
        self._check_open()
        self._reducer.register_comm_hook(state, hook)

    def stats(self) -> Dict[str, Any]:
        """Last iteration's communication figures and running means (GradSync.stats)."""
        return self._reducer.stats()

    def reset_stats(self) -> None:
        """Forgets the running means of stats() (e.g. after a warm-up)."""
        self._reducer.reset_stats()

    def export_timeline(self, path: Any) -> Any:
        """Chrome trace JSON of the kept iterations (wrap(..., timeline=N))."""
        return self._reducer.export_timeline(path)

    def ready_times(self) -> Any:
        """When each gradient became ready in the last kept iteration
        (GradSync.ready_times; wrap with timeline=N)."""
        return self._reducer.ready_times()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:  # fmt: skip
        """Clips every replica's gradients by their global norm and returns that
        norm: the norm of the full-batch gradient, not sqrt(N) times it. What
        the user did to the gradients since backward counts, as at the step."""
        self._check_open()
        gradients = self._reducer.gradients()
        return clip_norm(gradients, self.module, max_norm, norm_type, error_if_nonfinite, foreach)

    def clip_grad_value_(self, clip_value: float, foreach: Optional[bool] = None) -> None:
        """Clamps every replica's gradients into [-clip_value, clip_value] (torch's
        clip_grad_value_, which under shard='gradients' cannot write them)."""
        self._check_open()
        clip_values(self._reducer.gradients(), clip_value, foreach)

    def _flat_grads(self) -> List[List[torch.Tensor]]:  # the Trainer's loss scaling
        return flat_grads(self._reducer.gradients())

    def _sharded_finite(self) -> Optional[Callable[[], bool]]:  # (optim/clipping.py)
        return finite_check(self._reducer.gradients())

    def _drop_interrupted_step(self) -> None:
        """After a step cut short (Ctrl-C): the replicas' queued work ends,
        then the backward still open in the engine is dropped."""
        self._map_replicas(lambda r, m, s: None, [None] * len(self._replicas), "wait")
        self._reducer.abort()

    def train(self, mode: bool = True) -> DistributedModel:
        super().train(mode)
        for m in self._replicas[1:]:
            m.train(mode)
        return self

    def load_state_dict(
        self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False
    ):
        self._check_open()
        if assign:
            raise ValueError("assign=True would detach the replicas from their gradient buffers")
        state_dict = self._own_keys(state_dict)  # (torch DDP's checkpoints: `module.` keys)
        result = self.module.load_state_dict(state_dict, strict=strict)
        for m in self._replicas[1:]:
            m.load_state_dict(state_dict, strict=strict)
        return result

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Every replica through `torch.compile(replica, *args, **kwargs)` from now on
        (scatter, threads and gather stay eager; `.module` alone stays uncompiled):
        as wrapping a compiled model, or `torch.compile(dmodel, ...)` (runtime/compiled.py)."""
        self._check_open()
        refuse_full_graph(self._syncbn, kwargs)
        self._callables = [torch.compile(m, *args, **kwargs) for m in self._replicas]
        self._compiled_replicas = True
        self._workers.compiled()

    def close(self) -> None:
        """Stops the worker threads, removes the gradient hooks and releases the
        backend (threads, GPU communicators). The model (`.module`) stays usable
        on its own; this wrapper raises if used again. Idempotent; dropping the
        last reference, or leaving a `with pyddp.wrap(...) as dmodel:` block,
        does the same."""
        release(self._workers, self._reducer, getattr(self, "_syncbn", None))

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a wrapped model holds threads and per-replica state and cannot be pickled, copied "
            "or torch.save()d: save dmodel.state_dict() (or dmodel.module), copy dmodel.module"
        )

    def _check_open(self) -> None:
        if self._reducer.closed:
            raise RuntimeError(
                "pyddp: this wrapped model was closed; use .module on its own, or wrap it again"
            )

    # --------------------------------------------------------------- forward
    @EagerUnderDynamo
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Scatters tensors along dim 0, runs the replicas in parallel, gathers
        outputs on devices[0]. Reduce the loss with a mean over the whole batch and
        gradients equal single-device training on it."""
        self._check_open()
        if self._passthrough:
            return self._callables[0](*args, **kwargs)
        self._notify_join()
        if self._direct:
            return self._forward_direct(args, kwargs)
        with self._abandon_on_error("forward"):
            shards, sizes, cut = self._start((args, kwargs))
            with self._sync_batchnorm(len(shards)):
                outs = self._workers.run(
                    [self._call(r, a, kw) for r, (a, kw) in enumerate(shards)], "forward", sizes
                )
        if torch.is_grad_enabled():
            self._reducer.note_forward_end()
        return self._gathered(outs, sizes, cut, (args, kwargs), shards)

    def _forward_direct(self, args: Any, kwargs: Any) -> Any:
        """One CPU replica in this process (across processes, as torch DDP
        runs): the model runs on the inputs as given, with no scatter, no
        worker hand-off and no combining node; the first gradient hook
        queues the end of backward (_backward_began)."""
        with self._abandon_on_error("forward"):
            self._begin(batch_size((args, kwargs)) if self._join_config.enable else 0)
            with self._sync_batchnorm(1):
                out = self._call(0, args, kwargs)()
        if torch.is_grad_enabled():
            self._reducer.note_forward_end()
        return out

    def _map_replicas(
        self, fn: Callable[[int, nn.Module, Any], Any], shards: Sequence[Any], what: str = "map"
    ) -> List[Any]:
        """Runs fn(r, replica r, shards[r]) on every replica's worker, in parallel
        (e.g. sharded evaluation); returns the results in replica order."""
        self._check_open()
        if self._mirror is not None:
            self._follow_model()
        return self._workers.run(
            [partial(fn, r, self._callables[r], shard) for r, shard in enumerate(shards)], what
        )

    def _follow_model(self) -> None:
        """Brings the other replicas in line with the user's model (replica 0)."""
        if self._mirror is None:
            watching = self._watch is not None and torch.is_grad_enabled()
            # (An assigned gradient is adopted by its hook: only new storage counts.)
            if watching and (self._watch.follow() or self._reducer.grads_moved(False)):
                self._reducer.reattach()  # new storage behind parameters or gradients
            return
        moved = self._mirror.follow()
        if moved or self._reducer.grads_moved():
            # Module._apply gave parameters new storage (share_memory(), .half().float()),
            # and gradients with them: every parameter is copied (first: reattach may refuse
            # a window's gradients), the gradients point into the buckets again.
            self._mirror.copy_all()
            self._reducer.reattach(lambda: self._mirror.moved_now)

    def sync_replicas(self) -> None:
        """Copies replica 0's parameters and buffers to every other replica.
        Needed only after changing values where torch's version counters do not
        see it (`p.data.normal_()`, writes through `.data` or numpy); every other
        change to the model is followed at the next forward."""
        self._check_open()
        if self._mirror is not None:
            self._mirror.copy_all()
            self._copy_buffers()

    def _broadcast_buffers_now(self, now: bool = False) -> None:
        """Before every forward: rank 0's buffers (BatchNorm statistics) if
        the last synced training backward received them, or sent `now`
        (staged.py), then replica 0's to this process's others."""
        self._staged.put_in(self._link, self.module, now)
        if len(self._replicas) > 1:  # (broadcast_buffers=False: the user's changes alone)
            self._copy_buffers(changed_only=not self.broadcast_buffers)

    def _copy_buffers(self, changed_only: bool = False) -> None:
        self._check_open()
        if self._mirror is not None:  # (one replica: nothing to copy to)
            self._mirror.copy_buffers(changed_only)


def wrap(
    model: nn.Module, devices: Optional[Sequence[DeviceLike]] = None, **options: Any
) -> DistributedModel:
    """Replicates `model` over `devices` (duplicates allowed: several replicas on
    one device). Replica 0 is `model` itself, moved to devices[0]; the others are
    deep copies. Default devices: every GPU (else two CPU replicas); after
    `pyddp.init()`, this process's `cuda:LOCAL_RANK` (else one CPU replica).

    Across processes (torch.distributed initialised, or `group=` a process
    group): every rank must wrap the same model (checked: a ValueError names
    the first difference); rank 0's parameters and buffers are broadcast at
    wrap and its buffers after each synced training step; gradients are summed
    over this process's replicas and averaged over processes, as torch DDP.

    `options`: the fields of `pyddp.engine.options.Options`, each documented
    there (bucket_cap_mb, first_bucket_cap_mb, taper_buckets, reduce_order,
    rebuild_buckets, broadcast_buffers, threads_per_replica, timeout_s,
    timeline, group, find_unused_parameters, static_graph); an unknown or
    invalid one raises, naming itself. torch DDP's other keywords are
    accepted where they mean something here (replicas/ddp_args.py)."""
    return DistributedModel(model, devices, **options)
