"""The server's composition root: every actor's typed config, built from a
:class:`~treeserve.server_config.ServerConfig` (and what the start found out: devices, the
model's vocabulary) in this one place, so :class:`~treeserve.server.Server` only starts things.

The scheduler's own settings travel whole (``ServerConfig.scheduling``, a
:class:`~treeserve.actors.scheduler.types.SchedulerSettings`), so a new one is wired nowhere
here; a shape that ``ServerConfig`` shares with other actors reaches their configs by its field
name (:func:`shared_fields`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from treeserve.actors.gateway.config import GatewayConfig
from treeserve.actors.scheduler.types import SchedulerConfig
from treeserve.actors.speculator_factory import SpeculatorSpec
from treeserve.actors.verifier_config import VerifierConfig
from treeserve.ops.remaining_head import RemainingHead, load_remaining_head
from treeserve.runtime import RestartStrategy, RuntimeConfig, SupervisorConfig
from treeserve.server_config import ServerConfig

RUNTIME_CLOSE_TIMEOUT_S = 15.0
"""How long closing the runtime waits for actors and children to stop."""


def shared_fields(cfg: ServerConfig, target: type[Any], renames: dict[str, str] | None = None) -> dict[str, Any]:
    """``cfg``'s values for ``target``'s dataclass fields that ``ServerConfig`` has too, by the
    same name or by ``renames`` (target field -> ``ServerConfig`` field)."""
    own = {f.name for f in fields(ServerConfig)}
    renames = renames or {}
    return {f.name: getattr(cfg, renames.get(f.name, f.name)) for f in fields(target)
            if renames.get(f.name, f.name) in own}


def supervisor_config(cfg: ServerConfig, strategy: RestartStrategy = RestartStrategy.ONE_FOR_ONE) -> SupervisorConfig:
    """Every supervisor's restart budget and heartbeat watch (``one_for_all`` for the verifier
    shards: a tensor-parallel group cannot survive the loss of one rank)."""
    return SupervisorConfig(strategy=strategy, max_restarts=cfg.max_restarts, within_s=cfg.restart_window_s,
                            heartbeat_interval_s=cfg.heartbeat_interval_s, start_timeout_s=cfg.start_timeout_s)


def runtime_config(cfg: ServerConfig) -> RuntimeConfig:
    """The head runtime: bound for other hosts only when ``num_nodes`` join it."""
    return RuntimeConfig(bind=cfg.cluster_bind if cfg.num_nodes > 0 else None, allow_public_bind=cfg.allow_public_bind,
                         supervisor=supervisor_config(cfg), heartbeat_interval_s=cfg.heartbeat_interval_s,
                         close_timeout_s=RUNTIME_CLOSE_TIMEOUT_S)


def verifier_configs(cfg: ServerConfig, devices: tuple[str, ...], dist_init: str | None,
                     num_threads: int) -> list[VerifierConfig]:
    """One shard's config per tensor-parallel rank, on ``devices[rank]``. Its cache holds the
    scheduler's running rows and, after them, the rows where preempted requests wait
    (``scheduling.preempt_rows``)."""
    same = shared_fields(cfg, VerifierConfig, {"tp_size": "tp"})
    same["num_rows"] = cfg.num_rows + cfg.scheduling.preempt_rows
    return [VerifierConfig(**{**same, "tp_rank": rank, "device": devices[rank], "dist_init": dist_init,
                              "num_threads": num_threads})
            for rank in range(cfg.tp)]


def speculator_configs(cfg: ServerConfig, devices: tuple[str, ...],
                       speculators: tuple[SpeculatorSpec, ...]) -> list[dict[str, Any]]:
    """One speculator actor's constructor dict per device."""
    return [{"model": cfg.model, "cache_dir": cfg.cache_dir, "dtype": cfg.dtype, "device": device,
             "speculators": [s.to_wire() for s in speculators], "capacity": cfg.row_capacity,
             "num_threads": cfg.speculator_threads} for device in devices]


def predictor_config(cfg: ServerConfig, device: str) -> dict[str, Any]:
    """The length-predictor actor's constructor dict (one thread, beside the verifier)."""
    return {"model": cfg.model, "cache_dir": cfg.cache_dir, "device": device, "predictor": cfg.predictor,
            "num_threads": 1, "online": cfg.online_predictor}


def scheduler_config(cfg: ServerConfig, vocab_size: int, use_states: bool,
                     remaining_head: RemainingHead | None = None) -> SchedulerConfig:
    """The scheduler's own settings (``cfg.scheduling``), the shapes ``ServerConfig`` shares with
    it by name, what the verifier reported (``vocab_size``), what the speculators need
    (``use_states``) and the re-prediction head (:func:`remaining_head`)."""
    settings = {f.name: getattr(cfg.scheduling, f.name) for f in fields(cfg.scheduling)}
    return SchedulerConfig(**{**settings, **shared_fields(cfg, SchedulerConfig), "vocab_size": vocab_size,
                              "use_states": use_states, "remaining_head": remaining_head})


def remaining_head(cfg: ServerConfig, dim: int) -> tuple[RemainingHead | None, str | None]:
    """The head that re-predicts running requests (with preemption only), and a line to report
    when the shipped one does not fit the model. A given head that does not fit raises."""
    if not cfg.scheduling.preempt_rows or cfg.remaining_head == "none":
        return None, None
    head = load_remaining_head(cfg.remaining_head)
    if cfg.remaining_head is None and (head.model != cfg.model or head.dim != dim):
        return None, (f"no re-prediction head for {cfg.model!r} (the shipped one is for {head.model!r}): "
                      "running requests are re-predicted from their tokens")
    if head.dim != dim:
        raise ValueError(f"remaining head {cfg.remaining_head} reads states of {head.dim} values; "
                         f"model {cfg.model!r} has {dim}")
    return head, None


def gateway_config(cfg: ServerConfig, vocab_size: int) -> GatewayConfig:
    """The front ends' limits (the ZeroMQ gateway's, which the HTTP API applies too): the
    context a request may fill is a row less the slots one token tree takes."""
    return GatewayConfig(
        bind=cfg.bind or "tcp://127.0.0.1:0",  # unbound without a ZeroMQ gateway: its limits serve HTTP
        model_name=cfg.model, context_length=cfg.row_capacity - cfg.max_tree_nodes, vocab_size=vocab_size,
        max_concurrent_streams=cfg.max_concurrent_streams, allow_public_bind=cfg.allow_public_bind,
        scheduler_timeout_s=cfg.step_timeout_s,
    )
