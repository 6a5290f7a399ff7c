"""Scheduling benchmark: FCFS vs SSJF (and the SJF oracle, HRRN) on a real server or a simulator.

Real run: replays a trace (JSON lines ``{"arrival_s", "prompt" | "messages", "max_tokens"}``, or a
``"source"`` and ``"prompt_sha256"`` resolved from the fetched prompt sets: :func:`read_trace`)
against an embedded :class:`treeserve.Server` once per ``--policy`` (each policy gets a fresh
server), sending each request at its ``arrival_s`` and timing it from that moment (JCT) until
the last token. Under ``ssjf``/``hrrn`` the server's length-predictor actor predicts each
request's output length (the shipped predictor, or ``--predictor``); the prediction comes back
in each completion and is recorded. With ``--latency-model`` the same trace is also run through
the simulator (true lengths and predictions from the real run) and its mean JCT is reported
next to the real one (``sim_mean_jct_s``, ``sim_error``: the simulator's calibration check).

``--calibrate`` measures the server's verify-step time at batch sizes 1..num_rows for
speculation ``none`` (one-node trees) and ``tree`` and fits ``step_s = base + per_row * rows``
(a :class:`LatencyModel`), saved to ``--latency-model``.

``--simulate`` runs the real policy objects of ``treeserve.actors.scheduler.policy`` (and the SJF oracle,
an offline bound defined here) in a discrete-event
copy of the scheduler's loop (admit in policy order into free rows, prefill, one batched step
for all running requests) driven by that latency model, over Poisson and bursty Gamma
arrivals at several loads, with jobs from a predictions CSV (``treeserve train-predictor
--predictions-out``: held-out prompts with true and predicted lengths).

**A known load** (``--at-load 1.3 --burst``; the issue's benchmark): the trace's requests are
replayed on a real server, first all at once (the *burst*) under FCFS. That first pass gives
every request's true length (greedy decoding is deterministic) and the server's capacity:
requests/s while every row is busy, ``N / makespan`` of the burst. Each later row replays the
same requests (in a seeded shuffled order) as Poisson arrivals at ``load x capacity`` req/s.
Every row runs ``--policy`` side by side (default fcfs, ssjf, hrrn and the SJF oracle), ``--repeats``
times, interleaved (:func:`run_known_loads`; the tables show medians); the
oracle is the server's ``ssjf`` with a ``lookup`` predictor of the first pass's true lengths
and no aging (``treeserve.ops.length_predictor.lookup_predictor``). Each row reports mean / p50 /
p99 JCT, mean and max wait, throughput, the ratios to FCFS and the share of the oracle's mean
JCT gain that ssjf and hrrn reach; ``--plot`` writes one JCT CDF per row and policy.

Usage::

    python bench/scheduling.py --make-trace bench/data/trace_chat512.jsonl --num-jobs 40 --trace-rate 0.2 --seed 1
    python bench/scheduling.py --burst --at-load 1.3 0.8 --repeats 3 --format q4_1 \
        --speculate none --plot bench/out/scheduling_cdf.png --json
    python bench/scheduling.py --trace bench/data/trace_small.jsonl --policy fcfs ssjf --json
    python bench/scheduling.py --calibrate --latency-model bench/out/latency.json
    python bench/scheduling.py --simulate --jobs bench/out/predictions.csv --latency-model bench/out/latency.json
    python bench/scheduling.py --simulate --jobs bench/data/predictor_lengths_512_q4_1.csv --arrival-kinds burst \
        --num-jobs 40 --draws 50 --num-rows 4 --latency-model bench/out/latency.json --noisy-sigmas 0 0.5 1 2

``--noisy-sigmas`` asks how good a predictor ssjf needs (:func:`noisy_predictor_sweep`): the jobs'
true lengths scaled by seeded log-normal errors, each sigma's Kendall tau beside ssjf's share of
the oracle's gain.

``--json`` prints ``{"policies": {name: {"mean_jct_s", ..., "ratio_mean_jct_to_fcfs"}}}`` (and
``"simulation"`` for ``--simulate``); ``--plot PATH`` writes a JCT CDF (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from treeserve.actors.scheduler.policy import (
    POLICY_NAMES,
    PREDICTION_POLICIES,
    PolicyName,
    QueuedRequest,
    SchedulingPolicy,
    SSJFPolicy,
    make_policy,
)
from treeserve.ops.speculation_modes import SpeculationMode

SJF_ORACLE = "sjf-oracle"
SJF_INVERTED = "ljf-oracle"
PREEMPTING = "+preempt"
SSJF_PREEMPTING = PolicyName.SSJF.value + PREEMPTING
"""ssjf with limited preemption over ``--preempt-rows`` park rows, running requests re-predicted from
their hidden states by the shipped head (the oracles preempt too when ``--preempt-rows`` is set, on
their exact lengths; ssjf, hrrn and fcfs never do)."""
TOKENS_ONLY = "-tokens"
SSJF_PREEMPTING_TOKENS = SSJF_PREEMPTING + TOKENS_ONLY
"""The same, running requests re-predicted from their tokens alone (no head): what the head adds."""
"""The control: ssjf over a lookup of *inverted* true lengths, longest job first (a predictor as
wrong as one can be; the share bar must fail for it)."""
SSJF_MAX_TOKENS = "ssjf-max-tokens"
SIMULATED_POLICIES = (*POLICY_NAMES, SJF_ORACLE, SSJF_MAX_TOKENS)
"""What the simulator runs: the server's policies, the oracle bound, and SSJF without a predictor."""
METRICS = ("mean_jct_s", "p50_jct_s", "p99_jct_s", "mean_wait_s", "max_wait_s", "req_per_s", "tokens_per_s")


def _log(message: str) -> None:
    print(f"[bench/scheduling] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class JobResult:
    """One finished request: arrival, admission and finish times (s) and generated tokens."""

    arrival_s: float
    admitted_s: float
    finished_s: float
    num_tokens: int
    predicted_len: float | None = None
    num_prompt_tokens: int = 0

    @property
    def jct_s(self) -> float:
        """Job completion time: arrival to last token."""
        return self.finished_s - self.arrival_s

    @property
    def wait_s(self) -> float:
        """Queueing wait: arrival to admission."""
        return self.admitted_s - self.arrival_s


def summarize(results: Sequence[JobResult]) -> dict[str, float]:
    """Mean/p50/p99 JCT, mean/max wait, requests/s and tokens/s (over first arrival..last finish)."""
    if not results:
        raise ValueError("no results to summarize")
    jct = np.array([r.jct_s for r in results])
    wait = np.array([r.wait_s for r in results])
    span = max(r.finished_s for r in results) - min(r.arrival_s for r in results)
    span = max(span, 1e-9)
    return {
        "num_requests": float(len(results)),
        "mean_jct_s": float(jct.mean()),
        "p50_jct_s": float(np.percentile(jct, 50)),
        "p99_jct_s": float(np.percentile(jct, 99)),
        "mean_wait_s": float(wait.mean()),
        "max_wait_s": float(wait.max()),
        "req_per_s": len(results) / span,
        "tokens_per_s": sum(r.num_tokens for r in results) / span,
    }


def with_ratios(per_policy: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Add ``ratio_<metric>_to_fcfs`` to every policy's summary (when ``fcfs`` is present)."""
    base = per_policy.get("fcfs")
    out = {}
    for name, summary in per_policy.items():
        row = dict(summary)
        if base is not None:
            for metric in METRICS:
                label = metric if metric.endswith("_per_s") else metric.removesuffix("_s")
                row[f"ratio_{label}_to_fcfs"] = summary[metric] / base[metric] if base[metric] else math.nan
        out[name] = row
    return out


# ---------------------------------------------------------------------------------- simulator
class SJFOraclePolicy(SSJFPolicy):
    """Shortest *true* output length first: an offline comparison bound, not deployable.

    Reads ``true_len`` (required on every request). Aging is off by default
    (``max_wait_s=math.inf``, pure SJF); with a finite ``max_wait_s`` it has the same
    promotion rule and wait bound as :class:`~treeserve.actors.scheduler.policy.SSJFPolicy`.
    """

    def __init__(self, max_wait_s: float = math.inf) -> None:
        super().__init__(max_wait_s)

    def _check_request(self, request: QueuedRequest) -> None:
        if request.true_len is None:
            raise ValueError(f"sjf-oracle needs true_len on every request; {request.request_id!r} has none")

    def _job_size(self, request: QueuedRequest) -> float:
        assert request.true_len is not None  # enforced by _check_request on add
        return float(request.true_len)


def make_simulated_policy(name: str, max_wait_s: float) -> SchedulingPolicy:
    """A fresh policy of :data:`SIMULATED_POLICIES`: ``max_wait_s`` is the aging bound of the
    server's length-aware policies; the oracle runs without aging (the bound a perfect
    predictor could reach); ``ssjf-max-tokens`` is SSJF whose jobs carry no prediction."""
    if name == SJF_ORACLE:
        return SJFOraclePolicy()
    name = PolicyName.SSJF.value if name == SSJF_MAX_TOKENS else name
    return make_policy(name, **({"max_wait_s": max_wait_s} if name in PREDICTION_POLICIES else {}))


@dataclass(frozen=True)
class LatencyModel:
    """Cost of the server's loop: one verify step of ``n`` running rows takes
    ``base_s + per_row_s * n`` and emits ``tokens_per_step`` tokens per row on average
    (speculation gain); admitting a request costs ``prefill_per_token_s * prompt_len``."""

    base_s: float = 0.05
    per_row_s: float = 0.02
    tokens_per_step: float = 1.0
    prefill_per_token_s: float = 0.0002
    mode: str = "tree"
    measured: dict[str, Any] = field(default_factory=dict)

    def step_s(self, num_rows: int) -> float:
        """Seconds of one verify step with ``num_rows`` running requests."""
        return self.base_s + self.per_row_s * num_rows


@dataclass(frozen=True)
class SimJob:
    """A simulated request: arrival, prompt/output lengths and the predictor's guess."""

    arrival_s: float
    prompt_len: int
    max_tokens: int
    true_len: int
    predicted_len: float | None = None

    @property
    def served_len(self) -> int:
        """Tokens it is served: its true length within its cap (at least one)."""
        return max(1, min(self.true_len, self.max_tokens))


def simulate(jobs: Sequence[SimJob], policy: str, latency: LatencyModel, *, num_rows: int = 8,
             max_wait_s: float = 30.0) -> list[JobResult]:
    """Replay ``jobs`` through the scheduler's loop with the real ``policy`` object (results in job order).

    Mirrors ``SchedulerActor._run``: requests join the policy when they arrive; at the top of
    each iteration the policy admits into free rows (each admission prefills, advancing the
    clock); then one step advances every running request by ``tokens_per_step`` tokens
    (fractional progress accumulates; at least one token per step) and takes
    ``latency.step_s(rows)``; a request finishes once it has ``min(true_len, max_tokens)``.
    ``policy`` is one of :data:`SIMULATED_POLICIES` (see :func:`make_simulated_policy`).
    """
    without_predictor = policy == SSJF_MAX_TOKENS
    queue = make_simulated_policy(policy, max_wait_s)
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].arrival_s, i))
    next_arrival = 0
    now = 0.0 if not jobs else jobs[order[0]].arrival_s
    running: dict[int, float] = {}  # job index -> tokens emitted so far
    admitted: dict[int, float] = {}
    results: dict[int, JobResult] = {}
    per_step = max(1.0, latency.tokens_per_step)
    while len(results) < len(jobs):
        while next_arrival < len(order) and jobs[order[next_arrival]].arrival_s <= now:
            i = order[next_arrival]
            job = jobs[i]
            queue.add(QueuedRequest(str(i), job.arrival_s, job.prompt_len, job.max_tokens,
                                    predicted_len=None if without_predictor else job.predicted_len,
                                    true_len=job.true_len), now)
            next_arrival += 1
        free = num_rows - len(running)
        for picked in queue.select(now, free) if free and len(queue) else []:
            i = int(picked.request_id)
            admitted[i] = now
            running[i] = 0.0
            now += latency.prefill_per_token_s * jobs[i].prompt_len
        if not running:
            now = max(now, jobs[order[next_arrival]].arrival_s)
            continue
        now += latency.step_s(len(running))
        for i in list(running):
            running[i] += per_step
            target = jobs[i].served_len
            if running[i] >= target:
                del running[i]
                results[i] = JobResult(jobs[i].arrival_s, admitted[i], now, target)
    return [results[i] for i in range(len(jobs))]


def arrivals(kind: str, rate: float, num: int, rng: np.random.Generator, cv: float = 3.0) -> np.ndarray:
    """Arrival times of ``num`` requests at mean ``rate``/s: ``poisson`` or bursty ``gamma``
    (inter-arrival coefficient of variation ``cv``; ``cv > 1`` means bursts and lulls), or
    ``burst`` (all at 0, whatever the rate)."""
    if kind == "burst":
        return np.zeros(num)
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, num)
    elif kind == "gamma":
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num)
    else:
        raise ValueError(f"arrival kind must be poisson, gamma or burst, got {kind!r}")
    return np.cumsum(gaps) - gaps[0]


def capacity_req_per_s(latency: LatencyModel, num_rows: int, mean_len: float) -> float:
    """Requests/s the server sustains with every row busy (the load ``rho = 1`` point)."""
    tokens_per_s = num_rows * max(1.0, latency.tokens_per_step) / latency.step_s(num_rows)
    return tokens_per_s / mean_len


def sweep(pool: Sequence[SimJob], latency: LatencyModel, policies: Sequence[str], *, num_rows: int,
          max_wait_s: float, loads: Sequence[float], num_jobs: int, seed: int,
          kinds: Sequence[str] = ("poisson", "gamma")) -> list[dict[str, Any]]:
    """Simulate every (arrival kind, load) pair with jobs drawn from ``pool``; one row per pair."""
    rng = np.random.default_rng(seed)
    mean_len = float(np.mean([j.served_len for j in pool]))
    capacity = capacity_req_per_s(latency, num_rows, mean_len)
    rows = []
    for kind in kinds:
        for load in loads:
            picks = rng.integers(0, len(pool), num_jobs)
            times = arrivals(kind, load * capacity, num_jobs, rng)
            jobs = [replace(pool[p], arrival_s=float(t)) for p, t in zip(picks, times)]
            per_policy = {name: summarize(simulate(jobs, name, latency, num_rows=num_rows, max_wait_s=max_wait_s))
                          for name in policies}
            rows.append({"arrivals": kind, "load": load, "rate_req_per_s": load * capacity,
                         "policies": with_ratios(per_policy)})
    return rows


def noisy_predictor_sweep(pool: Sequence[SimJob], latency: LatencyModel, sigmas: Sequence[float], *,
                          num_rows: int, max_wait_s: float, loads: Sequence[float], num_jobs: int, seed: int,
                          kinds: Sequence[str], draws: int = 1) -> list[dict[str, Any]]:
    """How good a predictor ssjf needs: for each ``sigma``, every job's prediction is its true length
    (capped) times ``exp(sigma * z)``, ``z`` standard normal and fixed per job (so a larger ``sigma``
    only scales the same errors), clipped to the cap as the scheduler clips it. Reports the
    predictions' Kendall tau against the true lengths over the pool, and per arrival row ssjf's
    share of the oracle's mean-JCT gain and its p99 against FCFS: medians over ``draws`` draws of
    :func:`sweep` (seeds ``seed``, ``seed + 1``, ...; the same draws for every ``sigma``)."""
    from treeserve.ops.length_metrics import kendall_tau

    z = np.random.default_rng([seed, 1]).standard_normal(len(pool))  # a stream apart from the draws' seeds
    out = []
    for sigma in sigmas:
        noisy = [replace(j, predicted_len=float(np.clip(j.served_len * math.exp(sigma * e),
                                                        1.0, j.max_tokens))) for j, e in zip(pool, z)]
        tau = kendall_tau([j.predicted_len for j in noisy], [j.served_len for j in noisy])
        runs = [sweep(noisy, latency, [PolicyName.FCFS.value, PolicyName.SSJF.value, SJF_ORACLE], num_rows=num_rows,
                      max_wait_s=max_wait_s, loads=loads, num_jobs=num_jobs, seed=seed + d, kinds=kinds)
                for d in range(draws)]
        out.append({"sigma": sigma, "kendall_tau": tau, "draws": draws, "rows": [
            {"arrivals": r["arrivals"], "load": r["load"],
             "ssjf_share_of_oracle_gain": float(np.nanmedian(
                 [oracle_gain_share(run[k]["policies"], PolicyName.SSJF.value) for run in runs])),
             "ssjf_p99_to_fcfs": float(np.median(
                 [run[k]["policies"][PolicyName.SSJF.value]["ratio_p99_jct_to_fcfs"] for run in runs]))}
            for k, r in enumerate(runs[0])]})
    return out


def read_jobs_csv(path: Path, max_tokens: int, sets: Sequence[str] | None = None) -> list[SimJob]:
    """Jobs from a predictions CSV (``num_prompt_tokens,num_output_tokens,predicted_len`` columns),
    or from a lengths CSV of ``bench/predictor_data.py`` (no ``predicted_len``: the jobs carry no
    prediction, which is enough for fcfs and the oracle, e.g. to bound what any predictor can win).
    ``sets``: only the rows whose ``dataset`` column is one of them."""
    with path.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(line for line in handle if not line.startswith("#")))
    if sets is not None:
        rows = [r for r in rows if r.get("dataset") in sets]
        if not rows:
            raise SystemExit(f"{path} has no rows of the sets {', '.join(sets)}")
    return [SimJob(0.0, int(r["num_prompt_tokens"]), max_tokens, int(r["num_output_tokens"]),
                   float(r["predicted_len"]) if r.get("predicted_len") else None) for r in rows]


# ---------------------------------------------------------------------------------- real server
DATA_DIR = Path(__file__).parent / "data"


def read_trace(path: Path, *, resolve: bool = True, data_dir: Path = DATA_DIR) -> list[dict[str, Any]]:
    """A trace file: one ``{"arrival_s", "prompt" | "messages", "max_tokens"}`` object per line,
    sorted by arrival.

    An entry may instead name its prompt by ``"source": "<set>/<id>"`` with its
    ``"prompt_sha256"`` and no text (prompts whose text must not be committed: Arena-Hard,
    AlpacaEval). With ``resolve`` those are filled in from ``<data_dir>/<set>.jsonl``
    (``python bench/data/fetch.py``) as one-turn chat ``messages``, each checked against its hash.
    """
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    for n, e in enumerate(entries):
        is_reference = "prompt" not in e and "messages" not in e and "prompt_sha256" in e and "source" in e
        if "arrival_s" not in e or "max_tokens" not in e or (("prompt" in e) == ("messages" in e) and not is_reference):
            raise ValueError(f"{path}:{n + 1}: needs arrival_s, max_tokens and one of prompt/messages "
                             f"(or source and prompt_sha256)")
    if resolve:
        entries = [resolve_prompt(e, data_dir) for e in entries]
    return sorted(entries, key=lambda e: float(e["arrival_s"]))


def resolve_prompt(entry: dict[str, Any], data_dir: Path = DATA_DIR) -> dict[str, Any]:
    """``entry`` with ``messages`` filled in from its ``source`` when it carries no text (see
    :func:`read_trace`); an entry with text comes back unchanged."""
    if "prompt" in entry or "messages" in entry:
        return entry
    dataset, _, prompt_id = str(entry["source"]).partition("/")
    path = data_dir / f"{dataset}.jsonl"
    if not path.exists():
        raise ValueError(f"the trace names {entry['source']}, but {path} is missing: "
                         f"run python bench/data/fetch.py {dataset}")
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            record = json.loads(line)
            if str(record["id"]) == prompt_id:
                if hashlib.sha256(record["prompt"].encode("utf-8")).hexdigest() != entry["prompt_sha256"]:
                    raise ValueError(f"{entry['source']} in {path} differs from the prompt the trace recorded")
                return {**entry, "messages": [{"role": "user", "content": record["prompt"]}]}
    raise ValueError(f"{entry['source']} is not in {path}")


SERVER_COUNTS: dict[str, int] = {}
"""The last replayed server's scheduler counters (``num_preempted``, ``num_resumed``), read after each run."""
ORACLE_MAX_WAIT_S = 1e9
"""The real-server oracle's aging bound: none in effect (the simulator's oracle does not age either)."""


def _server_config(args: argparse.Namespace, policy: str, bind: str, oracle: Path | None = None) -> Any:
    from treeserve.actors.scheduler.types import SchedulerSettings
    from treeserve.server import ServerConfig

    if oracle is not None:  # the SJF oracle: ssjf over a lookup table of true lengths, no aging
        return ServerConfig(model=args.model, bind=bind, num_rows=args.num_rows, row_capacity=args.row_capacity,
                            dtype=args.format, heartbeat_interval_s=args.heartbeat_s,
                            verifier_threads=args.verifier_threads, scheduling=SchedulerSettings(policy=PolicyName.SSJF.value, max_wait_s=ORACLE_MAX_WAIT_S,
                                                                   preempt_rows=args.preempt_rows), predictor=str(oracle),
                            remaining_head="none",
                            online_predictor=False, speculators=() if args.speculate == SpeculationMode.NONE else None)
    head = "none" if policy.endswith(TOKENS_ONLY) else None
    policy = policy.removesuffix(TOKENS_ONLY)
    preempts = policy.endswith(PREEMPTING)
    policy = policy.removesuffix(PREEMPTING)
    return ServerConfig(model=args.model, bind=bind, num_rows=args.num_rows, row_capacity=args.row_capacity,
                        dtype=args.format, heartbeat_interval_s=args.heartbeat_s,
                        verifier_threads=args.verifier_threads, scheduling=SchedulerSettings(policy=policy, max_wait_s=args.max_wait_s,
                                                                   preempt_rows=args.preempt_rows if preempts else 0),
                        predictor=args.predictor, remaining_head=head,
                        online_predictor=not args.no_online_predictor,
                        speculators=() if args.speculate == SpeculationMode.NONE else None)


async def replay(args: argparse.Namespace, trace: Sequence[dict[str, Any]], policy: str,
                 oracle: Path | None = None, *, num_tries: int = 2) -> list[JobResult]:
    """Replay ``trace`` against a fresh embedded server running ``policy`` (results in trace order);
    with ``oracle`` (a lookup predictor file) the server runs the SJF oracle instead. A run that
    fails (a child declared dead on a loaded machine) is logged and run again on a fresh server,
    up to ``num_tries`` runs in all."""
    from treeserve.client_errors import UnavailableError

    for attempt in range(1, num_tries + 1):
        try:
            return await _replay(args, trace, policy, oracle)
        except UnavailableError as exc:
            if attempt == num_tries:
                raise
            _log(f"{policy}: run {attempt} failed ({exc}); running it again on a fresh server")
    raise AssertionError("unreachable")


async def _replay(args: argparse.Namespace, trace: Sequence[dict[str, Any]], policy: str,
                  oracle: Path | None = None) -> list[JobResult]:
    from treeserve.client import Client
    from treeserve.server import Server

    with tempfile.TemporaryDirectory(prefix="treeserve-sched-") as tmp:
        async with Server(_server_config(args, policy, f"ipc://{tmp}/gw.sock", oracle)) as server, \
                Client(server.endpoint) as client:
            await client.generate("Hello", max_tokens=4, speculate=args.speculate)  # warm-up
            loop = asyncio.get_running_loop()
            start = loop.time()

            async def one(entry: dict[str, Any]) -> JobResult:
                arrival = start + float(entry["arrival_s"])
                await asyncio.sleep(max(0.0, arrival - loop.time()))
                prompt = entry["messages"] if "messages" in entry else entry["prompt"]
                done = await client.generate(prompt, max_tokens=int(entry["max_tokens"]), speculate=args.speculate)
                finished = loop.time()
                sent = finished - done.client_total_s
                return JobResult(sent - start, sent - start + done.queue_s, finished - start, done.num_generated_tokens,
                                 done.predicted_len, done.num_prompt_tokens)

            results = await asyncio.gather(*(one(e) for e in trace))
            assert server.scheduler is not None
            stats = await server.scheduler.ask("stats")
            SERVER_COUNTS.clear()
            SERVER_COUNTS.update({k: int(stats.get(k, 0)) for k in ("num_preempted", "num_resumed", "num_repredicted")})
    return list(results)


async def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Measure verify-step time vs running rows for speculation ``none`` and ``tree``; fit each."""
    from treeserve.client import Client
    from treeserve.server import Server

    prompt = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}]
    fits: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="treeserve-cal-") as tmp:
        async with Server(_server_config(args, PolicyName.FCFS.value, f"ipc://{tmp}/gw.sock")) as server, \
                Client(server.endpoint) as client:
            assert server.scheduler is not None
            await client.generate("Hello", max_tokens=4)
            for mode in (SpeculationMode.NONE.value, SpeculationMode.TREE.value):
                points, gains, prefill = [], [], []
                for rows in sorted({1, 2, max(1, args.num_rows // 2), args.num_rows}):
                    before = await server.scheduler.ask("stats")
                    started = time.perf_counter()
                    done = await asyncio.gather(*(client.generate(prompt, max_tokens=args.calibrate_tokens,
                                                                  speculate=mode) for _ in range(rows)))
                    wall = time.perf_counter() - started
                    after = await server.scheduler.ask("stats")
                    # Step time from the scheduler's own timers (propose + verify), so admission
                    # (prefill) and client round trips do not inflate it; they make the rest.
                    steps = max(1, after["num_decode_steps"] - before["num_decode_steps"])
                    in_steps = sum(after[k] - before[k] for k in ("propose_s", "verify_s"))
                    points.append((rows, in_steps / steps))
                    prefill.append(max(0.0, wall - in_steps) / sum(d.num_prompt_tokens for d in done))
                    gains.extend(d.mean_accepted_per_step for d in done)
                    _log(f"calibrate {mode}: {rows} rows -> {in_steps / steps * 1000:.0f} ms/step, "
                         f"{prefill[-1] * 1e3:.2f} ms/prompt token outside the steps")
                x = np.array([[1.0, r] for r, _ in points])
                (base, per_row), *_ = np.linalg.lstsq(x, np.array([s for _, s in points]), rcond=None)
                fits[mode] = asdict(LatencyModel(max(0.0, float(base)), max(0.0, float(per_row)),
                                                 float(np.mean(gains)), float(np.median(prefill)), mode=mode,
                                                 measured={"rows_vs_step_s": points}))
    return fits


TRACE_SETS = ("mtbench", "humaneval", "gsm8k")
"""Sets whose prompt text a committed trace may carry: MIT / Apache-2.0 (``bench/data/fetch.py``)."""
REFERENCE_SETS = ("arenahard", "alpacaeval")
"""Sets a committed trace names only by id and hash (AlpacaEval is CC BY-NC; Arena-Hard's prompts
come from Chatbot Arena users, whose terms are upstream's): resolved from the fetched files."""
CHAT_TRACE_SETS = ("mtbench", "arenahard", "alpacaeval", "humaneval", "gsm8k")
"""The default trace mix: chat prompts of real users (Arena-Hard, AlpacaEval), MT-Bench's
multi-category questions, code (HumanEval) and math (GSM8K)."""


API_TRACE_SETS = ("synthetic", "synthetic", "synthetic", "mtbench", "arenahard", "alpacaeval", "humaneval", "gsm8k")
"""The API-style trace mix (``--trace-caps api``): three in eight synthetic prompts (labels, extractions, short
answers, lists, code, essays: ``bench/data/synthetic.py``), the rest public chat, code and math."""


def make_trace(num: int, rate: float, max_tokens: int, seed: int, cv: float = 3.0,
               sets: Sequence[str] = CHAT_TRACE_SETS, max_prompt_tokens: int = 384,
               tokenizer: Any = None, caps: str = "fixed") -> list[dict[str, Any]]:
    """``num`` prompts from the held-out test split (``treeserve.training.length_data.is_test_prompt``) of
    ``sets``, as one-turn chat ``messages``, with bursty Gamma arrivals (mean ``rate``/s, CV
    ``cv``). The predictor never trained on them. The sets share ``num`` as evenly as their test
    splits allow (seeded random picks within each), and with ``tokenizer`` prompts longer than
    ``max_prompt_tokens`` chat-templated are skipped (as ``bench/predictor_data.py`` skips them).
    Prompts of :data:`REFERENCE_SETS` are written by source and hash only (:func:`read_trace`).
    A set named several times gets that many shares. ``caps="api"``: each request's
    ``max_tokens`` is the one an API client sends for its kind (``bench/data/api_caps.py``)
    instead of ``max_tokens``."""
    from treeserve.training.length_data import is_test_prompt

    sys.path.insert(0, str(DATA_DIR))
    from api_caps import api_cap

    rng = np.random.default_rng(seed)
    pools: dict[str, list[tuple[str, str]]] = {}
    weights = {name: sets.count(name) for name in sets}
    sets = list(dict.fromkeys(sets))
    for name in sets:
        pools[name] = []
        for line in (DATA_DIR / f"{name}.jsonl").read_text(encoding="utf-8").split("\n"):
            if line.strip():
                record = json.loads(line)
                if not is_test_prompt(name, str(record["id"])):
                    continue
                messages = [{"role": "user", "content": record["prompt"]}]
                if tokenizer is not None and len(tokenizer.encode_chat(messages)) > max_prompt_tokens:
                    continue
                pools[name].append((f"{name}/{record['id']}", record["prompt"]))
        rng.shuffle(pools[name])  # type: ignore[arg-type]
    if num > sum(len(p) for p in pools.values()):
        raise ValueError(f"the test split of {', '.join(sets)} holds {sum(len(p) for p in pools.values())} prompts, "
                         f"not {num}")
    share = {name: 0 for name in sets}
    while sum(share.values()) < num:  # round robin over the sets that still have prompts
        for name in sets:
            for _ in range(weights[name]):
                if sum(share.values()) < num and share[name] < len(pools[name]):
                    share[name] += 1
    picked = [pools[name][i] for name in sets for i in range(share[name])]
    picked = [picked[i] for i in rng.permutation(len(picked))]
    times = arrivals("gamma", rate, num, rng, cv=cv)
    out = []
    for (source, prompt), t in zip(picked, times):
        dataset, _, prompt_id = source.partition("/")
        cap = api_cap(dataset, prompt_id) if caps == "api" else max_tokens
        entry: dict[str, Any] = {"arrival_s": round(float(t), 3), "max_tokens": cap, "source": source}
        if source.split("/")[0] in REFERENCE_SETS:
            entry["prompt_sha256"] = hashlib.sha256(prompt.encode("utf-8")).hexdigest()
        else:
            entry["messages"] = [{"role": "user", "content": prompt}]
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------- known load
def burst_of(trace: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same requests, all arriving at 0 (in trace order; ``trace_index`` says which)."""
    return [{**e, "arrival_s": 0.0, "trace_index": i} for i, e in enumerate(trace)]


def at_rate(trace: Sequence[dict[str, Any]], rate: float, seed: int) -> list[dict[str, Any]]:
    """The same requests in a seeded shuffled order, as Poisson arrivals at ``rate`` req/s."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(trace))
    times = arrivals("poisson", rate, len(trace), rng)
    return [{**trace[int(i)], "arrival_s": round(float(t), 3), "trace_index": int(i)} for i, t in zip(order, times)]


def capacity_from_burst(results: Sequence[JobResult], num_rows: int) -> float:
    """Requests/s of a saturated server, from a burst: completions per second up to the
    ``(N - num_rows)``-th one, while every row is still busy. (``N / makespan`` would count the
    tail, where fewer requests than rows are left, and underestimate it: on this model's
    burst of 32 requests on 4 rows that was 0.250 against 0.30-0.33 req/s.)"""
    finished = sorted(r.finished_s for r in results)
    start = min(r.arrival_s for r in results)
    count = max(1, len(finished) - num_rows)
    return count / max(1e-9, finished[count - 1] - start)


def oracle_gain_share(per_policy: dict[str, dict[str, float]], name: str) -> float:
    """``(FCFS - name) / (FCFS - oracle)`` mean JCT: the share of the oracle's gain ``name`` reaches."""
    fcfs, oracle = per_policy["fcfs"]["mean_jct_s"], per_policy[SJF_ORACLE]["mean_jct_s"]
    gain = fcfs - oracle
    return (fcfs - per_policy[name]["mean_jct_s"]) / gain if gain > 0 else math.nan


def write_oracle(args: argparse.Namespace, trace: Sequence[dict[str, Any]], lengths: Sequence[int], path: Path) -> None:
    """A ``lookup`` predictor of each trace prompt's true length, keyed by the ids the server computes."""
    from treeserve.models import load_model
    from treeserve.ops.length_predictor import lookup_predictor

    tokenizer = load_model(args.model).tokenizer

    def ids(entry: dict[str, Any]) -> list[int]:
        # As the gateway encodes them: special-token text in user content stays text (tokenizers
        # older than that option encode it the same way for prompts without such text).
        encode = tokenizer.encode_chat if "messages" in entry else tokenizer.encode
        text = entry["messages"] if "messages" in entry else entry["prompt"]
        try:
            return [int(t) for t in encode(text, split_special_tokens=True)]
        except TypeError:
            return [int(t) for t in encode(text)]

    lookup_predictor([ids(e) for e in trace], list(lengths), max(int(e["max_tokens"]) for e in trace)).save(path)


def median_table(tables: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per policy and metric, the median over repeats (NaNs ignored; a metric that is NaN in
    every repeat stays NaN). Ratios are medians of each repeat's own ratio (a paired comparison),
    not ratios of medians."""
    out: dict[str, dict[str, float]] = {}
    for name in tables[0]:
        keys = tables[0][name].keys()
        out[name] = {}
        for key in keys:
            values = np.array([t[name][key] for t in tables if name in t and key in t[name]], dtype=np.float64)
            finite = values[~np.isnan(values)]
            out[name][key] = float(np.median(finite)) if finite.size else math.nan
        out[name]["num_repeats"] = float(len(tables))
    return out


def rotated(policies: Sequence[str], repeat: int) -> list[str]:
    """``policies`` rotated left by ``repeat``: each repeat runs a row's policies in another order,
    so that a slow or fast stretch of a shared machine does not always hit the same policy."""
    k = repeat % max(1, len(policies))
    return [*policies[k:], *policies[:k]]


def run_known_loads(args: argparse.Namespace, trace: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The burst first pass (FCFS: true lengths and capacity), then ``--repeats`` rounds of every
    row of ``--burst`` and ``--at-load`` with every ``--policy`` (see the module docstring).

    Repeats are interleaved (round r runs every row once, each row's policies rotated by r) and
    each round draws fresh Poisson arrivals (seed ``--seed + r``, the same for every policy of
    the round). The first pass is round 0's FCFS burst. Each row reports the median over rounds
    of every metric and of every round's own ratios to FCFS and share of the oracle's gain."""
    _log(f"first pass: {len(trace)} requests at once under fcfs")
    first = asyncio.run(replay(args, burst_of(trace), PolicyName.FCFS.value))
    lengths = [r.num_tokens for r in first]
    capacity = capacity_from_burst(first, args.num_rows)
    _log(f"capacity {capacity:.4f} req/s ({sum(lengths) / len(lengths):.1f} tokens per request on average)")
    oracle_path = args.oracle_out
    oracle_path.parent.mkdir(parents=True, exist_ok=True)
    write_oracle(args, trace, lengths, oracle_path)
    lookups = {SJF_ORACLE: oracle_path}
    if SJF_INVERTED in args.policy:
        lookups[SJF_INVERTED] = oracle_path.with_name(oracle_path.stem + "_inverted.npz")
        write_oracle(args, trace, [max(lengths) + 1 - n for n in lengths], lookups[SJF_INVERTED])
    labels = (["burst"] if args.burst else []) + [f"load {x:g}" for x in args.at_load]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for repeat in range(args.repeats):
        for label in labels:
            load = None if label == "burst" else float(label.split()[1])
            entries = burst_of(trace) if load is None else at_rate(trace, load * capacity, args.seed + repeat)
            results: dict[str, list[JobResult]] = {}
            preemptions: dict[str, int] = {PolicyName.FCFS.value: 0}
            for policy in rotated(args.policy, repeat):
                if load is None and policy == PolicyName.FCFS.value and repeat == 0:
                    results[policy] = first  # the first pass is round 0's FCFS burst
                    continue
                _log(f"round {repeat + 1}/{args.repeats}, {label}: {policy} (load average {_loadavg()})")
                results[policy] = asyncio.run(replay(args, entries, policy,
                                                     lookups.get(policy)))
                preemptions[policy] = SERVER_COUNTS.get("num_preempted", 0)
                _log(f"{label}: {policy}: " + json.dumps({**summarize(results[policy]), **SERVER_COUNTS}))
            results = {p: results[p] for p in args.policy}  # table order: as asked
            per_policy = with_ratios({p: summarize(r) for p, r in results.items()})
            if PolicyName.FCFS.value in per_policy and SJF_ORACLE in per_policy:
                for name in per_policy:
                    per_policy[name]["share_of_oracle_gain"] = oracle_gain_share(per_policy, name)
            for name in per_policy:
                per_policy[name]["num_preemptions"] = float(preemptions.get(name, 0))
            for name, rs in results.items():  # greedy decoding: every policy should see the first pass's lengths
                per_policy[name]["num_length_mismatches"] = float(sum(
                    r.num_tokens != lengths[int(e["trace_index"])] for r, e in zip(rs, entries)))
            runs[label].append({"policies": per_policy, "rate_req_per_s": None if load is None else load * capacity,
                                "jobs": {p: [asdict(r) for r in rs] for p, rs in results.items()}})
            _log(f"round {repeat + 1}, {label}\n" + _table(per_policy))
        if args.partial_json is not None:  # every finished round, so a stopped run keeps its data
            args.partial_json.parent.mkdir(parents=True, exist_ok=True)
            args.partial_json.write_text(json.dumps({"capacity_req_per_s": capacity, "true_lengths": lengths,
                                                     "num_rounds": repeat + 1, "runs": runs}), encoding="utf-8")
        if args.plot is not None:  # rewritten after every round, so a later failure keeps the plot
            curves = {label: {p: [j["finished_s"] - j["arrival_s"] for run in runs[label] for j in run["jobs"][p]]
                              for p in args.policy} for label in labels if runs[label]}
            plot_cdf_rows(curves, args.plot, f"{args.trace.name}, {args.num_rows} rows, {args.format}, "
                                             f"{repeat + 1} round(s) pooled")
    rows = []
    for label in labels:
        load = None if label == "burst" else float(label.split()[1])
        table = median_table([run["policies"] for run in runs[label]])
        _log(f"{label}, median of {len(runs[label])} round(s)\n" + _table(table))
        rows.append({"row": label, "load": load, "rate_req_per_s": None if load is None else load * capacity,
                     "policies": table, "rounds": runs[label]})
    return {"capacity_req_per_s": capacity, "true_lengths": lengths, "rows": rows}


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text(encoding="utf-8").split(" ", 3)[0]
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------- output
def plot_cdf(curves: dict[str, Sequence[float]], path: Path, title: str) -> bool:
    """Write a JCT CDF (one curve per policy) to ``path``; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed (pip install matplotlib); no plot written")
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in curves.items():
        xs = np.sort(np.asarray(values))
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=name)
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_cdf_rows(rows: dict[str, dict[str, Sequence[float]]], path: Path, title: str) -> bool:
    """One JCT CDF panel per row (burst, each load), one curve per policy, in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed (pip install matplotlib); no plot written")
        return False
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
    for ax, (label, curves) in zip(axes[0], rows.items()):
        for name, values in curves.items():
            xs = np.sort(np.asarray(values))
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=name)
        ax.set_xlabel("job completion time (s)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _table(per_policy: dict[str, dict[str, float]]) -> str:
    lines = [f"{'policy':<11} {'mean JCT':>9} {'p50':>7} {'p99':>7} {'mean wait':>9} {'max wait':>9} "
             f"{'req/s':>6} {'tok/s':>7} {'mean/FCFS':>9} {'p99/FCFS':>8} {'oracle gain':>11} {'preempted':>9}"]
    for name, m in per_policy.items():
        lines.append(f"{name:<11} {m['mean_jct_s']:>9.2f} {m['p50_jct_s']:>7.2f} {m['p99_jct_s']:>7.2f} "
                     f"{m['mean_wait_s']:>9.2f} {m['max_wait_s']:>9.2f} {m['req_per_s']:>6.3f} "
                     f"{m['tokens_per_s']:>7.1f} {m.get('ratio_mean_jct_to_fcfs', math.nan):>9.3f} "
                     f"{m.get('ratio_p99_jct_to_fcfs', math.nan):>8.3f} {m.get('share_of_oracle_gain', math.nan):>11.2f} "
                     f"{m.get('num_preemptions', 0):>9.0f}")
    return "\n".join(lines)


def _load_latency(args: argparse.Namespace) -> LatencyModel:
    """The ``--calibrate`` fit for the ``--speculate`` mode (chain uses the tree fit)."""
    fit = json.loads(args.latency_model.read_text(encoding="utf-8"))[args.speculate if args.speculate != "chain" else "tree"]
    fit["measured"] = {}
    return LatencyModel(**fit)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="FCFS vs SSJF scheduling benchmark (real server or simulator)")
    parser.add_argument("--trace", type=Path, default=DATA_DIR / "trace_chat512.jsonl")
    parser.add_argument("--policy", nargs="+", default=None, choices=[*POLICY_NAMES, SSJF_PREEMPTING, SSJF_PREEMPTING_TOKENS, SJF_ORACLE, SJF_INVERTED],
                        help=f"default: fcfs ssjf (fcfs ssjf hrrn {SJF_ORACLE} with --burst / --at-load); "
                             f"{SJF_ORACLE} needs the true lengths of a first pass: --burst / --at-load or --simulate")
    parser.add_argument("--burst", action="store_true",
                        help="known-load mode: replay the trace's requests all at once (also the first pass)")
    parser.add_argument("--at-load", type=float, nargs="*", default=[],
                        help="known-load mode: replay them as Poisson arrivals at these multiples of the capacity")
    parser.add_argument("--oracle-out", type=Path, default=Path("bench/out/sjf_oracle_lookup.npz"),
                        help="where the known-load mode writes the oracle's lookup predictor")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-rows", type=int, default=4, help="concurrent requests (KV rows)")
    parser.add_argument("--row-capacity", type=int, default=1024)
    parser.add_argument("--max-wait-s", type=float, default=30.0,
                        help="SSJF/HRRN aging bound: the latest aging deadline after arrival (the server's default)")
    parser.add_argument("--speculate", default="tree", choices=[m.value for m in SpeculationMode])
    parser.add_argument("--format", default="float32", choices=["q4_1", "int8", "bfloat16", "float32"],
                        help="the served weight format (ServerConfig.dtype; float32 is its default, q4_1 the CLI's "
                             "and about 4x faster here, its compiled step loaded from the cache)")
    parser.add_argument("--partial-json", type=Path, default=None,
                        help="known-load mode: rewrite every finished round's runs here (JSON)")
    parser.add_argument("--verifier-threads", type=int, default=None,
                        help="torch threads of the verifier (default: the server's, this host's cores); 1 keeps a "
                             "step from stalling when another process takes a core (a 2-thread step ran many "
                             "times slower on this shared 2-core machine)")
    parser.add_argument("--heartbeat-s", type=float, default=2.0,
                        help="the server's heartbeat interval (its default 0.5 s declared a verifier dead on a "
                             "machine loaded by other work; this only delays the detection of a hung child)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="known-load mode: run every row and policy this many times, interleaved (repeat r "
                             "runs each row's policies in an order rotated by r); tables show medians")
    parser.add_argument("--preempt-rows", type=int, default=0,
                        help=f"park rows of limited preemption, for {SSJF_PREEMPTING} and the oracles (0: off)")
    parser.add_argument("--predictor", default=None, help="length predictor .npz (default: the shipped one)")
    parser.add_argument("--no-online-predictor", action="store_true", help="do not refine the predictor online")
    parser.add_argument("--make-trace", type=Path, default=None,
                        help="write a trace of --num-jobs test-split prompts of --trace-sets here and exit")
    parser.add_argument("--trace-rate", type=float, default=1.0, help="mean arrivals/s of --make-trace")
    parser.add_argument("--trace-max-tokens", type=int, default=512)
    parser.add_argument("--trace-sets", nargs="+", default=None,
                        help="prompt sets of --make-trace (their test splits; shared evenly, a set named twice "
                             "gets two shares; default: the chat mix, or the API mix with --trace-caps api)")
    parser.add_argument("--trace-caps", choices=["fixed", "api"], default="fixed",
                        help="--make-trace's max_tokens: --trace-max-tokens for all, or each prompt's API cap "
                             "(bench/data/api_caps.py)")
    parser.add_argument("--calibrate", action="store_true", help="measure the latency model on the real server")
    parser.add_argument("--calibrate-tokens", type=int, default=64)
    parser.add_argument("--latency-model", type=Path, default=None, help="JSON written by --calibrate")
    parser.add_argument("--simulate", action="store_true", help="sweep arrivals in the simulator")
    parser.add_argument("--jobs", type=Path, default=None, help="predictions CSV (train-predictor --predictions-out)")
    parser.add_argument("--jobs-sets", nargs="+", default=None, metavar="SET",
                        help="only --jobs rows of these datasets (a lengths CSV's dataset column)")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 0.95])
    parser.add_argument("--num-jobs", type=int, default=400)
    parser.add_argument("--arrival-kinds", nargs="+", default=["poisson", "gamma"], choices=["poisson", "gamma", "burst"],
                        help="arrival processes of --simulate")
    parser.add_argument("--max-tokens", type=int, default=512, help="max_tokens of simulated jobs")
    parser.add_argument("--draws", type=int, default=1, help="--noisy-sigmas: draws of jobs per row (medians)")
    parser.add_argument("--noisy-sigmas", type=float, nargs="+", default=None, metavar="SIGMA",
                        help="--simulate: instead of the CSV's predictions, give every job its true length times "
                             "exp(SIGMA * z) for each SIGMA, and report the predictions' tau beside ssjf's share of "
                             "the oracle's gain (how good a predictor has to be)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, help="write a JCT CDF PNG here")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    known_load = args.burst or bool(args.at_load)
    if args.policy is None:
        args.policy = ([PolicyName.FCFS.value, PolicyName.SSJF.value, PolicyName.HRRN.value, SJF_ORACLE] if known_load
                       else [PolicyName.FCFS.value, PolicyName.SSJF.value])
    if {SSJF_PREEMPTING, SSJF_PREEMPTING_TOKENS} & set(args.policy) and not (known_load and args.preempt_rows > 0):
        parser.error(f"--policy {SSJF_PREEMPTING}[{TOKENS_ONLY}] needs --preempt-rows N and --burst / --at-load")
    if SJF_INVERTED in args.policy and not known_load:
        parser.error(f"--policy {SJF_INVERTED} needs the true lengths of a first pass: --burst / --at-load")
    if SJF_ORACLE in args.policy and not (args.simulate or known_load):
        parser.error(f"--policy {SJF_ORACLE} needs the true lengths of a first pass: --burst / --at-load, or --simulate")
    out: dict[str, Any] = {}
    if args.make_trace is not None:
        from treeserve.models import load_model

        sets = args.trace_sets or (API_TRACE_SETS if args.trace_caps == "api" else CHAT_TRACE_SETS)
        entries = make_trace(args.num_jobs, args.trace_rate, args.trace_max_tokens, args.seed,
                             sets=sets, tokenizer=load_model(args.model).tokenizer, caps=args.trace_caps)
        args.make_trace.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
        _log(f"wrote {len(entries)} requests to {args.make_trace}")
        return 0
    if args.calibrate:
        fits = asyncio.run(calibrate(args))
        out["latency_model"] = fits
        if args.latency_model is not None:
            args.latency_model.parent.mkdir(parents=True, exist_ok=True)
            args.latency_model.write_text(json.dumps(fits, indent=1), encoding="utf-8")
    elif known_load:
        trace = read_trace(args.trace)
        out["known_load"] = run_known_loads(args, trace)
        out["config"] = {"trace": str(args.trace), "num_rows": args.num_rows, "speculate": args.speculate,
                         "max_wait_s": args.max_wait_s, "model": args.model, "seed": args.seed,
                         "format": args.format, "repeats": args.repeats, "load_average_at_start": _loadavg(),
                         "predictor": args.predictor or "shipped", "online_predictor": not args.no_online_predictor}
    elif args.simulate:
        latency = LatencyModel() if args.latency_model is None else _load_latency(args)
        if args.jobs is None:
            raise SystemExit("--simulate needs --jobs (a predictions CSV from treeserve train-predictor --predictions-out)")
        pool = read_jobs_csv(args.jobs, args.max_tokens, args.jobs_sets)
        if args.noisy_sigmas:
            out["noisy_predictor"] = noisy_predictor_sweep(
                pool, latency, args.noisy_sigmas, num_rows=args.num_rows, max_wait_s=args.max_wait_s,
                loads=args.loads, num_jobs=args.num_jobs, seed=args.seed, kinds=args.arrival_kinds, draws=args.draws)
            for entry in out["noisy_predictor"]:
                _log(f"sigma {entry['sigma']}: tau {entry['kendall_tau']:.3f}; " + "; ".join(
                    f"{r['arrivals']} {r['load']}: share {r['ssjf_share_of_oracle_gain']:.2f}, "
                    f"p99/fcfs {r['ssjf_p99_to_fcfs']:.2f}" for r in entry["rows"]))
            if args.json:
                print(json.dumps(out, indent=1))
            return 0
        policies = list(dict.fromkeys([*args.policy, SSJF_MAX_TOKENS, SJF_ORACLE]))
        rows = sweep(pool, latency, policies, num_rows=args.num_rows, max_wait_s=args.max_wait_s,
                     loads=args.loads, num_jobs=args.num_jobs, seed=args.seed, kinds=args.arrival_kinds)
        out["simulation"] = {"latency_model": asdict(latency), "num_rows": args.num_rows, "sweep": rows}
        out["policies"] = rows[-1]["policies"]
        for row in rows:
            _log(f"{row['arrivals']} load {row['load']} ({row['rate_req_per_s']:.3f} req/s)\n" + _table(row["policies"]))
        if args.plot is not None:
            jobs = [replace(pool[p], arrival_s=float(t)) for p, t in zip(
                np.random.default_rng(args.seed).integers(0, len(pool), args.num_jobs),
                arrivals("gamma", args.loads[-1] * capacity_req_per_s(latency, args.num_rows, float(np.mean(
                    [min(j.true_len, j.max_tokens) for j in pool]))), args.num_jobs, np.random.default_rng(args.seed)))]
            plot_cdf({p: [r.jct_s for r in simulate(jobs, p, latency, num_rows=args.num_rows,
                                                     max_wait_s=args.max_wait_s)] for p in policies},
                     args.plot, f"simulated, gamma arrivals, load {args.loads[-1]}")
    else:
        trace = read_trace(args.trace)
        results: dict[str, list[JobResult]] = {}
        for policy in args.policy:
            _log(f"replaying {len(trace)} requests with {policy}")
            results[policy] = asyncio.run(replay(args, trace, policy))
            _log(f"{policy}: " + json.dumps(summarize(results[policy])))  # partial results survive a later failure
        out["policies"] = with_ratios({p: summarize(r) for p, r in results.items()})
        out["jobs"] = {p: [asdict(r) for r in rows] for p, rows in results.items()}  # per request, trace order
        if args.latency_model is not None:
            latency = _load_latency(args)
            for policy, rows in results.items():
                jobs = [SimJob(r.arrival_s, r.num_prompt_tokens, int(e["max_tokens"]), r.num_tokens, r.predicted_len)
                        for r, e in zip(rows, trace)]
                simulated = summarize(simulate(jobs, policy, latency, num_rows=args.num_rows,
                                               max_wait_s=args.max_wait_s))["mean_jct_s"]
                real = out["policies"][policy]["mean_jct_s"]
                out["policies"][policy]["sim_mean_jct_s"] = simulated
                out["policies"][policy]["sim_error"] = simulated / real - 1.0
                _log(f"{policy}: simulator mean JCT {simulated:.2f} s vs real {real:.2f} s ({simulated / real - 1:+.1%})")
        out["config"] = {"trace": str(args.trace), "num_rows": args.num_rows, "speculate": args.speculate,
                         "max_wait_s": args.max_wait_s, "model": args.model}
        _log("\n" + _table(out["policies"]))
        if args.plot is not None:
            plot_cdf({p: [x.jct_s for x in r] for p, r in results.items()}, args.plot, f"real server, {args.trace.name}")
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
