"""The HTTP API's pieces without a server: the OpenAI request mapping, error statuses, the
address and API-key rules, the per-server metrics registry, the load-log line and the
``serve`` flags that refuse bad combinations."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from treeserve.actors.gateway.http_config import HttpConfig, ServingState, is_loopback_host, parse_http_address
from treeserve.actors.gateway.openai_api import ApiError, Endpoint, api_error_from, default_max_tokens, parse_openai
from treeserve.actors.gateway.request import InvalidRequest
from treeserve.actors.load_log import LoadLog, log_load_every
from treeserve.actors.metrics import ServingMetrics, ServingTotals
from treeserve.actors.scheduler.observer import StepSample
from treeserve.runtime.errors import ActorError, OverloadedError
from treeserve.transport.wire import ErrorCode


def samples(metrics: ServingMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = asyncio.run(metrics.render()).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---------------------------------------------------------------- the OpenAI mapping
def test_chat_maps_onto_the_wire_body_with_openais_defaults() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}]}
    request = parse_openai(Endpoint.CHAT, body, "m")
    assert request.wire == {"messages": [{"role": "user", "content": "ab"}], "temperature": 1.0}
    assert not request.has_max_tokens and not request.stream and not request.include_usage
    full = parse_openai(Endpoint.CHAT, {**body, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                                        "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                                        "treeserve": {"speculate": "none", "top_k": 4}}, "m")
    assert full.wire == {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 7, "temperature": 0,
                         "top_p": 0.5, "seed": 3, "stop": "x", "speculate": "none", "top_k": 4}
    assert full.has_max_tokens and full.stream and full.include_usage
    nulls = parse_openai(Endpoint.CHAT, {**body, "max_tokens": None, "seed": None, "stop": None, "top_p": None,
                                         "temperature": None, "n": None, "treeserve": None}, "m")
    assert nulls.wire == request.wire  # null is the default, everywhere


def test_completion_prompts() -> None:
    assert parse_openai(Endpoint.COMPLETIONS, {"model": "m", "prompt": "hi"}, "m").wire["prompt"] == "hi"
    assert parse_openai(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["hi"]}, "m").wire["prompt"] == "hi"
    assert parse_openai(Endpoint.COMPLETIONS, {"model": "m", "prompt": [5, 6]}, "m").wire["prompt_ids"] == [5, 6]
    with pytest.raises(ApiError, match="batched"):
        parse_openai(Endpoint.COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}, "m")
    with pytest.raises(ApiError, match="messages"):  # a chat field on the completions endpoint
        parse_openai(Endpoint.COMPLETIONS, {"model": "m", "prompt": "a", "messages": []}, "m")


def test_refusals_name_the_field_and_the_status() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}]}
    with pytest.raises(ApiError) as unknown_model:
        parse_openai(Endpoint.CHAT, {**chat, "model": "other"}, "m")
    assert unknown_model.value.status == 404 and unknown_model.value.code == "model_not_found"
    for field, value in (("n", 2), ("presence_penalty", 1.0), ("logprobs", True), ("tools", [{"type": "x"}])):
        with pytest.raises(ApiError) as refused:
            parse_openai(Endpoint.CHAT, {**chat, field: value}, "m")
        assert refused.value.status == 400 and refused.value.param == field
    with pytest.raises(ApiError, match="got string"):  # JSON's type names, not Python's
        parse_openai(Endpoint.CHAT, {**chat, "messages": "hi"}, "m")
    with pytest.raises(ApiError, match="differ"):
        parse_openai(Endpoint.CHAT, {**chat, "max_tokens": 3, "max_completion_tokens": 4}, "m")


def test_default_max_tokens() -> None:
    assert default_max_tokens(Endpoint.CHAT, 10, 100) == 90
    assert default_max_tokens(Endpoint.COMPLETIONS, 10, 100) == 16
    assert default_max_tokens(Endpoint.COMPLETIONS, 95, 100) == 5
    assert default_max_tokens(Endpoint.CHAT, 100, 100) == 1  # refused later, as too long a prompt


@pytest.mark.parametrize(("exc", "status", "retry_after"), [
    (InvalidRequest("bad"), 400, None),
    (OverloadedError("full"), 429, 1),
    (ActorError("gone", code=ErrorCode.UNAVAILABLE), 503, 7),
    (ActorError("dead", code=ErrorCode.ACTOR_DEAD), 503, 7),
    (ActorError("no scheduler", code=ErrorCode.NO_SUCH_ACTOR), 503, 7),  # wiring: unavailable, as on the wire
    (TimeoutError(), 504, None),
    (ActorError("bug", code=ErrorCode.INTERNAL), 500, None),
    (RuntimeError("bug"), 500, None),
])
def test_errors_map_to_statuses(exc: Exception, status: int, retry_after: int | None) -> None:
    error = api_error_from(exc, overloaded_retry_after_s=1, unavailable_retry_after_s=7)
    assert (error.status, error.retry_after_s) == (status, retry_after)
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- addresses and keys
def test_http_addresses_and_the_api_key_rule() -> None:
    assert parse_http_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_http_address("[::1]:0") == ("::1", 0)
    for bad in ("8000", ":8000", "host:port", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            parse_http_address(bad)
    assert is_loopback_host("localhost") and is_loopback_host("127.5.0.1") and is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("example.com")
    with pytest.raises(ValueError, match="API key"):
        HttpConfig.from_address("0.0.0.0:8000")
    assert HttpConfig.from_address("0.0.0.0:8000", api_key="k3y").api_key == "k3y"
    with pytest.raises(ValueError, match="printable"):
        HttpConfig(api_key="has space")
    assert HttpConfig.from_address("[::1]:80").address == "[::1]:80"


def test_server_config_http_rules() -> None:
    from treeserve.server_config import ServerConfig

    assert ServerConfig().http_config() is None
    config = ServerConfig(http="127.0.0.1:0", bind=None, served_model_name="x")
    http = config.http_config()
    assert http is not None and http.model_name == "x" and http.port == 0
    with pytest.raises(ValueError, match="nothing to serve"):
        ServerConfig(bind=None)
    with pytest.raises(ValueError, match="API key"):
        ServerConfig(http="0.0.0.0:8000")
    with pytest.raises(ValueError, match="set http"):
        ServerConfig(api_key="k")


def test_serve_flags_refuse_what_cannot_work(tmp_path: Path) -> None:
    from treeserve.cli import build_parser
    from treeserve.cli_common import UserError
    from treeserve.cli_serve import api_key_from_flags, cmd_serve

    parser = build_parser()
    with pytest.raises(UserError, match="--no-zmq"):
        cmd_serve(parser.parse_args(["serve", "--no-zmq"]))
    with pytest.raises(UserError, match="API key"):
        cmd_serve(parser.parse_args(["serve", "--http", "0.0.0.0:0"]))
    with pytest.raises(UserError, match="--log-every-s"):
        cmd_serve(parser.parse_args(["serve", "--log-every-s", "-1"]))
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n", encoding="utf-8")
    assert api_key_from_flags(None, key_file) == "s3cret"
    with pytest.raises(UserError, match="not both"):
        api_key_from_flags("a", key_file)
    args = parser.parse_args(["serve"])
    assert args.http is None and args.api_key is None and not args.no_zmq and args.log_every_s == 10.0


# ---------------------------------------------------------------- metrics and the load log
def test_metrics_record_steps_and_requests_in_a_registry_of_their_own() -> None:
    first, second = ServingMetrics(), ServingMetrics()  # two servers in one process do not collide
    first.on_step(StepSample(0.02, (1, 3), 4))
    first.on_step(StepSample(0.04, (2,), 2))
    first.on_finished({"finish_reason": "stop", "num_prompt_tokens": 5, "num_generated_tokens": 6,
                       "queue_s": 0.5, "ttft_s": 1.0, "total_s": 2.0})
    first.on_http_request("chat", "error", "overloaded")
    got = samples(first)
    assert got[("treeserve_accepted_tokens_per_step_count", ())] == 3
    assert got[("treeserve_accepted_tokens_per_step_sum", ())] == 6
    assert got[("treeserve_accepted_tokens_per_step_bucket", (("le", "2.0"),))] == 2
    assert got[("treeserve_scheduler_step_seconds_sum", ())] == pytest.approx(0.06)
    assert got[("treeserve_generated_tokens_total", ())] == 6
    assert got[("treeserve_prompt_tokens_total", ())] == 5
    assert got[("treeserve_time_to_first_token_seconds_sum", ())] == 1.0
    assert got[("treeserve_request_latency_seconds_sum", ())] == 2.0
    assert got[("treeserve_time_per_output_token_seconds_sum", ())] == pytest.approx(1.0 / 5)
    assert got[("treeserve_requests_finished_total", (("finish_reason", "stop"),))] == 1
    assert got[("treeserve_http_requests_total", (("code", "overloaded"), ("endpoint", "chat"),
                                                  ("outcome", "error")))] == 1
    assert got[("treeserve_state", (("state", "starting"),))] == 1
    assert first.totals == ServingTotals(num_steps=2, step_s=pytest.approx(0.06), num_row_steps=3,
                                         num_row_tokens=6, num_emitted_tokens=6, num_finished=1)
    assert samples(second)[("treeserve_generated_tokens_total", ())] == 0


def test_metrics_read_their_sources_at_scrape_time() -> None:
    metrics = ServingMetrics()
    stats = {"num_queued": 3, "num_running": 2, "num_free_rows": 6, "num_parked": 1, "num_preempted": 5,
             "num_resumed": 4, "num_repredicted": 12}

    async def scheduler_stats() -> dict[str, int]:
        return stats

    metrics.watch(scheduler_stats=scheduler_stats, restarts=lambda: {"verifier-supervisor": 2},
                  zmq_stats=lambda: {"num_completed": 4, "num_cancels": 1, "num_requests": 9},
                  state=lambda: ServingState.READY)
    got = samples(metrics)
    assert got[("treeserve_queue_length", ())] == 3 and got[("treeserve_running_rows", ())] == 2
    assert got[("treeserve_free_rows", ())] == 6 and got[("treeserve_parked_requests", ())] == 1
    assert got[("treeserve_preemptions_total", ())] == 5 and got[("treeserve_resumptions_total", ())] == 4
    assert got[("treeserve_repredictions_total", ())] == 12
    assert got[("treeserve_child_restarts_total", (("supervisor", "verifier-supervisor"),))] == 2
    assert got[("treeserve_zmq_requests_total", (("outcome", "completed"),))] == 4
    assert got[("treeserve_zmq_requests_total", (("outcome", "cancelled"),))] == 1
    assert got[("treeserve_state", (("state", "ready"),))] == 1 and got[("treeserve_state", (("state", "failed"),))] == 0
    stats = {"num_queued": 0, "num_running": 0, "num_free_rows": 8}
    assert samples(metrics)[("treeserve_queue_length", ())] == 0  # read again at the next scrape


def test_load_log_line_gives_rates_over_the_period() -> None:
    log = LoadLog(start_s=100.0)
    totals = ServingTotals(num_steps=50, step_s=2.0, num_row_steps=80, num_row_tokens=160, num_emitted_tokens=150,
                           num_finished=4)
    scheduler = {"num_running": 2, "num_queued": 1, "num_free_rows": 6, "num_completed": 4, "num_failed": 1,
                 "num_cancelled": 0}
    assert log.line(110.0, totals, scheduler, 0) == (
        "load: 2 running, 1 queued, 6/8 rows free | 15.0 tok/s, 2.00 tok/step, 5.0 steps/s, step 40.0 ms | "
        "last 10s: 4 done, 1 failed, 0 cancelled | restarts 0")
    idle = log.line(115.0, totals, {**scheduler, "num_running": 0, "num_queued": 0, "num_free_rows": 8}, 1)
    assert idle == ("load: 0 running, 0 queued, 8/8 rows free | 0.0 tok/s, 0.00 tok/step, 0.0 steps/s, step 0.0 ms | "
                    "last 5s: 0 done, 0 failed, 0 cancelled | restarts 1")
    assert LoadLog(0.0).line(1.0, ServingTotals(), {}, 0).startswith("load: rows unknown |")


def test_an_idle_server_says_so_once() -> None:
    log = LoadLog(start_s=0.0)
    busy = {"num_running": 1, "num_queued": 0, "num_free_rows": 1, "num_completed": 0}
    idle = {**busy, "num_running": 0, "num_free_rows": 2}
    assert log.line(1.0, ServingTotals(num_steps=3), busy, 0) is not None
    assert log.line(2.0, ServingTotals(num_steps=3), idle, 0) is not None  # the first idle period is told
    assert log.line(3.0, ServingTotals(num_steps=3), idle, 0) is None
    assert log.line(4.0, ServingTotals(num_steps=3), idle, 1) == (  # a restart is news
        "load: 0 running, 0 queued, 2/2 rows free | 0.0 tok/s, 0.00 tok/step, 0.0 steps/s, step 0.0 ms | "
        "last 1s: 0 done, 0 failed, 0 cancelled | restarts 1")
    assert log.line(5.0, ServingTotals(num_steps=3), idle, 1) is not None  # idle again: once
    assert log.line(6.0, ServingTotals(num_steps=3), idle, 1) is None
    assert log.line(7.0, ServingTotals(num_steps=4), idle, 1) is not None


async def test_log_load_every_emits_until_cancelled() -> None:
    lines: list[str] = []
    ticks: list[float] = []

    def clock() -> float:
        ticks.append(float(len(ticks)))
        return ticks[-1]

    metrics = ServingMetrics()
    task = asyncio.ensure_future(log_load_every(0.001, metrics, lines.append, clock))
    while len(lines) < 1:
        await asyncio.sleep(0.001)
    metrics.on_step(StepSample(0.01, (2,), 2))  # news: the next period gets a line
    while len(lines) < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lines[0].startswith("load: rows unknown | 0.0 tok/s") and "last 1s" in lines[0]
    assert "2.00 tok/step" in lines[1]
    with pytest.raises(ValueError, match="interval"):
        await log_load_every(0, ServingMetrics(), lines.append, lambda: 0.0)
