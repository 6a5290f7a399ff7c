"""``ServerConfig``: everything an embedded :class:`~treeserve.server.Server` needs, validated on
construction without I/O. Its defaults are the command line's (``treeserve serve`` reads them
from here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from treeserve.actors.gateway.http_config import HttpConfig
from treeserve.actors.model_host import check_device
from treeserve.actors.scheduler.types import SchedulerConfig, SchedulerSettings
from treeserve.actors.speculator_factory import SpeculatorSpec, default_speculators
from treeserve.ops.formats import FORMAT_NAMES, WeightFormat
from treeserve.ops.loaders.registry import DEFAULT_MODEL


CPU_ONLY_FORMATS = tuple(f.value for f in WeightFormat if f.is_int)
"""Formats whose kernels are CPU ones (``ops/formats.py`` refuses them on CUDA at load; the
config refuses them before any process starts)."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything an embedded server needs; validated on construction, no I/O.

    ``model``: registry name, ``.gguf`` path or HF folder. ``bind``: the public ZeroMQ gateway
    endpoint (loopback by default; ``tcp://127.0.0.1:0`` picks a free port; None: no ZeroMQ
    gateway, only the HTTP API). ``http``: ``HOST:PORT`` of the OpenAI-compatible HTTP API
    (None: none; port 0 picks a free one); it needs ``api_key`` (bearer token) unless ``HOST``
    is loopback, and serves the model as ``served_model_name`` (None: ``model``). ``tp``: tensor
    parallel verifier ranks. ``device``: ``cpu``, or ``cuda[:N]``: rank ``r`` on GPU ``N + r``, the
    speculator actors on the GPUs no rank holds first (:func:`~treeserve.server_devices.place_devices`;
    more ranks than GPUs fail at start). ``num_rows``: concurrent requests (KV-cache rows);
    ``row_capacity``: tokens per row (prompt + max_tokens + one token tree must fit).
    ``speculators``: the speculators every speculator actor runs, in order, as config entries
    (:meth:`~treeserve.actors.speculator_factory.SpeculatorSpec.from_wire`; validated here);
    empty disables speculation; None: :func:`~treeserve.actors.speculator_factory.default_speculators`. ``num_speculator_actors``:
    one per device (on CPU: one per process). ``num_nodes``: other hosts that join with
    ``treeserve node --join <cluster_bind>``; the server waits for them, then places
    tensor-parallel ranks 1.. and the speculators on them (rank 0, the scheduler and the
    gateway stay on this head). ``cluster_bind`` is the head runtime's endpoint for nodes.
    ``compile_in_background``: a decode step compiled for the first time (minutes) compiles
    while the verifier serves eagerly (``treeserve serve``), instead of before it serves (the
    default, and ``treeserve generate``'s: a short process would end before the compile is
    saved). ``compile_decode`` False: the verifier runs its decode steps eagerly and never
    loads a compiled one (``treeserve generate`` of a few hundred tokens finishes sooner
    without the 3-4 s load). ``reuse_prefixes``: a prompt reuses the K/V of what its row held
    before where they start alike (the verifier's ``reuse_prefixes``). ``verifier_threads``/``speculator_threads``: torch threads per child process (None: this
    host's cores divided by the shards on it). Processes that share cores must not each use
    them all: oversubscribed OpenMP threads spin against each other and run many times slower.
    ``scheduling``: the scheduler's own settings
    (:class:`~treeserve.actors.scheduler.types.SchedulerSettings`: the admission ``policy`` and
    its aging bound ``max_wait_s``, adaptive speculation, prefill and decode-ahead sizes). The
    policies ``ssjf`` and ``hrrn`` order by the output length a proxy model predicts, run by a
    length-predictor actor (a child process with one thread): ``predictor`` is a ``.npz`` from
    ``treeserve train-predictor`` (None: the shipped one, which is used only for the model it
    was trained on; for other models these policies order by ``max_tokens``);
    ``online_predictor`` refines it from completed requests. ``remaining_head``: with preemption,
    the ``.npz`` of the head that re-predicts running requests from their hidden states
    (``python -m treeserve.training.remaining``; None: the shipped one, for the model it was fitted
    on; ``"none"``: re-predict from the tokens alone).
    """

    model: str = DEFAULT_MODEL
    cache_dir: str | None = None
    bind: str | None = "tcp://127.0.0.1:5555"
    http: str | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    tp: int = 1
    # What the scheduler is given takes the scheduler's own defaults (one definition each).
    num_rows: int = SchedulerConfig.num_rows
    row_capacity: int = SchedulerConfig.row_capacity
    scheduling: SchedulerSettings = field(default_factory=SchedulerSettings)
    max_tree_nodes: int = SchedulerConfig.max_tree_nodes
    speculators: tuple[Mapping[str, Any], ...] | None = None
    num_speculator_actors: int = 1
    max_concurrent_streams: int = 256
    max_restarts: int = 3
    restart_window_s: float = 60.0
    heartbeat_interval_s: float = 0.5
    start_timeout_s: float = 300.0
    step_timeout_s: float = SchedulerConfig.step_timeout_s
    allow_public_bind: bool = False
    verifier_threads: int | None = None
    compile_in_background: bool = False
    compile_decode: bool = True
    reuse_prefixes: bool = True
    speculator_threads: int = 1
    num_nodes: int = 0
    cluster_bind: str = "tcp://127.0.0.1:5556"
    node_wait_timeout_s: float = 300.0
    predictor: str | None = None
    online_predictor: bool = True
    remaining_head: str | None = None

    def resolved_speculators(self) -> tuple[Mapping[str, Any], ...]:
        """``speculators``, or the defaults for ``model`` when it is None (config entries)."""
        if self.speculators is None:
            return tuple(spec.to_wire() for spec in default_speculators(self.model, self.dtype, self.device))
        return self.speculators

    def speculator_specs(self) -> tuple[SpeculatorSpec, ...]:
        """:meth:`resolved_speculators`, validated."""
        return tuple(SpeculatorSpec.from_wire(entry) for entry in self.resolved_speculators())

    def http_config(self) -> HttpConfig | None:
        """The HTTP API's config (None without ``http``); ``ValueError`` for a bad address or a
        non-loopback one without an API key."""
        if self.http is None:
            return None
        return HttpConfig.from_address(self.http, api_key=self.api_key, model_name=self.served_model_name or self.model,
                                       max_concurrent_requests=self.max_concurrent_streams)

    def __post_init__(self) -> None:
        if self.dtype not in FORMAT_NAMES:
            raise ValueError(f"dtype (the weight format) must be one of {', '.join(FORMAT_NAMES)}, got {self.dtype!r}")
        check_device(self.device)
        if self.device != "cpu" and self.dtype in CPU_ONLY_FORMATS:
            raise ValueError(f"the {self.dtype} format has CPU kernels only; on {self.device} use float32 or bfloat16 "
                             f"(auto is bfloat16 there)")
        if not isinstance(self.scheduling, SchedulerSettings):
            raise ValueError(f"scheduling must be a SchedulerSettings, got {type(self.scheduling).__name__}")
        if self.speculators is not None:
            self.speculator_specs()  # ValueError names the bad entry
        for name in ("tp", "num_rows", "row_capacity", "max_tree_nodes", "max_concurrent_streams"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_nodes < 0:
            raise ValueError(f"num_nodes must be >= 0, got {self.num_nodes}")
        if self.num_nodes and not self.cluster_bind.startswith("tcp://"):
            raise ValueError(f"cluster_bind must be a tcp:// endpoint, got {self.cluster_bind!r}")
        if self.num_speculator_actors < 0:
            raise ValueError(f"num_speculator_actors must be >= 0, got {self.num_speculator_actors}")
        if self.row_capacity <= self.max_tree_nodes:
            raise ValueError(f"row_capacity ({self.row_capacity}) must exceed max_tree_nodes ({self.max_tree_nodes})")
        if self.bind is not None and not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind must be a tcp://, ipc:// or inproc:// endpoint, got {self.bind!r}")
        if self.bind is None and self.http is None:
            raise ValueError("nothing to serve on: set bind (the ZeroMQ gateway), http (the HTTP API), or both")
        if self.api_key is not None and self.http is None:
            raise ValueError("api_key protects the HTTP API: set http too")
        self.http_config()  # ValueError names the problem


__all__ = ["ServerConfig"]
