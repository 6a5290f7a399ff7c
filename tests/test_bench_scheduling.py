"""bench/scheduling.py without a server: the simulator (hand-checked timings, SSJF vs FCFS with
an oracle predictor, a reversed predictor that must lose), summaries, arrivals, the trace file."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treeserve_testing.scripts import load_script

SCHEDULING_PY = Path(__file__).resolve().parents[1] / "bench" / "scheduling.py"
TRACE = SCHEDULING_PY.parent / "data" / "trace_small.jsonl"


sched = load_script("treeserve_bench_scheduling", SCHEDULING_PY)
UNIT = sched.LatencyModel(base_s=1.0, per_row_s=0.0, tokens_per_step=1.0, prefill_per_token_s=0.0)


def test_simulate_matches_hand_computed_timings() -> None:
    jobs = [sched.SimJob(0.0, 5, 100, 3, predicted_len=3.0), sched.SimJob(0.0, 5, 100, 1, predicted_len=1.0)]
    fcfs = sched.simulate(jobs, "fcfs", UNIT, num_rows=1)
    assert [(r.admitted_s, r.finished_s) for r in fcfs] == [(0.0, 3.0), (3.0, 4.0)]
    ssjf = sched.simulate(jobs, "ssjf", UNIT, num_rows=1)
    assert [(r.admitted_s, r.finished_s) for r in ssjf] == [(1.0, 4.0), (0.0, 1.0)]
    # Two rows: both run together; a step costs per_row_s more per running row.
    two = sched.simulate(jobs, "fcfs", replace(UNIT, per_row_s=0.5), num_rows=2)
    assert [r.finished_s for r in two] == [2.0 + 1.5 + 1.5, 2.0]
    # Speculation gain: 2 tokens per step halves the steps; max_tokens caps the output.
    fast = sched.simulate([sched.SimJob(0.0, 5, 3, 10)], "fcfs", replace(UNIT, tokens_per_step=2.0), num_rows=1)
    assert fast[0].finished_s == 2.0 and fast[0].num_tokens == 3


def test_simulate_idles_until_the_next_arrival_and_charges_prefill() -> None:
    jobs = [sched.SimJob(10.0, 100, 50, 2)]
    (result,) = sched.simulate(jobs, "fcfs", replace(UNIT, prefill_per_token_s=0.01), num_rows=4)
    assert result.admitted_s == 10.0 and result.finished_s == pytest.approx(10.0 + 1.0 + 2.0)


def _heavy_tailed_jobs(predict: str, seed: int = 0, num: int = 300) -> list:
    rng = np.random.default_rng(seed)
    true = np.where(rng.random(num) < 0.7, rng.integers(10, 60, num), rng.integers(300, 512, num))
    latency = sched.LatencyModel(base_s=0.05, per_row_s=0.01, tokens_per_step=1.0, prefill_per_token_s=0.0)
    rate = 0.95 * sched.capacity_req_per_s(latency, 4, float(true.mean()))
    times = sched.arrivals("gamma", rate, num, rng, cv=2.0)
    jobs = []
    for t, n in zip(times, true):
        guess = {"oracle": float(n), "reversed": 1e4 / float(n), "none": None}[predict]
        jobs.append(sched.SimJob(float(t), 20, 512, int(n), guess))
    return jobs, latency


def test_ssjf_with_an_oracle_predictor_beats_fcfs_and_a_reversed_one_loses() -> None:
    # Aging off: under this much queueing a finite bound would promote most jobs (FCFS order).
    jobs, latency = _heavy_tailed_jobs("oracle")
    fcfs = sched.summarize(sched.simulate(jobs, "fcfs", latency, num_rows=4))
    ssjf = sched.summarize(sched.simulate(jobs, "ssjf", latency, num_rows=4, max_wait_s=1e9))
    assert ssjf["mean_jct_s"] < 0.7 * fcfs["mean_jct_s"]
    assert ssjf["num_requests"] == fcfs["num_requests"] == 300
    # Same work either way: throughput is the same up to the last job's finish.
    assert ssjf["tokens_per_s"] == pytest.approx(fcfs["tokens_per_s"], rel=0.1)
    bad_jobs, _ = _heavy_tailed_jobs("reversed")
    bad = sched.summarize(sched.simulate(bad_jobs, "ssjf", latency, num_rows=4, max_wait_s=1e9))
    assert bad["mean_jct_s"] > fcfs["mean_jct_s"]
    # No prediction: every job's service is max_tokens, so SSJF orders like FCFS.
    none_jobs, _ = _heavy_tailed_jobs("none")
    same = sched.summarize(sched.simulate(none_jobs, "ssjf", latency, num_rows=4, max_wait_s=1e9))
    assert same["mean_jct_s"] == pytest.approx(fcfs["mean_jct_s"])


def test_aging_bounds_the_wait_of_long_jobs() -> None:
    jobs, latency = _heavy_tailed_jobs("oracle", seed=1)
    no_aging = sched.summarize(sched.simulate(jobs, "ssjf", latency, num_rows=4, max_wait_s=1e9))
    aging = sched.summarize(sched.simulate(jobs, "ssjf", latency, num_rows=4, max_wait_s=5.0))
    assert aging["max_wait_s"] < no_aging["max_wait_s"]


def test_summarize_and_ratios() -> None:
    results = [sched.JobResult(0.0, 1.0, 3.0, 10), sched.JobResult(1.0, 1.0, 5.0, 30)]
    s = sched.summarize(results)
    assert s["mean_jct_s"] == 3.5 and s["max_wait_s"] == 1.0 and s["mean_wait_s"] == 0.5
    assert s["req_per_s"] == pytest.approx(2 / 5) and s["tokens_per_s"] == pytest.approx(40 / 5)
    ratios = sched.with_ratios({"fcfs": s, "ssjf": {**s, "mean_jct_s": 1.75}})
    assert ratios["ssjf"]["ratio_mean_jct_to_fcfs"] == 0.5 and ratios["fcfs"]["ratio_p99_jct_to_fcfs"] == 1.0
    with pytest.raises(ValueError):
        sched.summarize([])


@pytest.mark.parametrize("kind,cv", [("poisson", 1.0), ("gamma", 3.0)])
def test_arrivals_have_the_asked_rate_and_burstiness(kind: str, cv: float) -> None:
    times = sched.arrivals(kind, 2.0, 20000, np.random.default_rng(0), cv=cv)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_sweep_reports_every_policy_with_ratios() -> None:
    pool = [sched.SimJob(0.0, 10, 512, n, float(n)) for n in (5, 20, 400)]
    rows = sched.sweep(pool, UNIT, ["fcfs", "ssjf"], num_rows=2, max_wait_s=30.0, loads=[0.5], num_jobs=20, seed=0)
    assert [(r["arrivals"], r["load"]) for r in rows] == [("poisson", 0.5), ("gamma", 0.5)]
    assert "ratio_mean_jct_to_fcfs" in rows[0]["policies"]["ssjf"]


def test_noisy_predictions_lose_the_oracles_gain_as_their_tau_falls() -> None:
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(200) < 0.5, rng.integers(10, 200, 200), 512)
    pool = [sched.SimJob(0.0, 10, 512, int(n)) for n in lengths]
    latency = sched.LatencyModel(base_s=0.01, per_row_s=0.001, tokens_per_step=1.0, prefill_per_token_s=0.0)
    rows = sched.noisy_predictor_sweep(pool, latency, [0.0, 1.0, 4.0], num_rows=4, max_wait_s=1e9, loads=[1.0],
                                       num_jobs=40, seed=0, kinds=["burst"], draws=3)
    taus = [r["kendall_tau"] for r in rows]
    shares = [r["rows"][0]["ssjf_share_of_oracle_gain"] for r in rows]
    # Exact predictions are the oracle; the same errors scaled up rank worse and win less.
    assert taus[0] == pytest.approx(1.0) and shares[0] == pytest.approx(1.0)
    assert taus[0] > taus[1] > taus[2] and shares[0] > shares[1] > shares[2]
    assert all(j.predicted_len is None for j in pool)  # the pool is not modified


def test_read_trace_validates(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 1, "prompt": "a", "max_tokens": 4}\n{"arrival_s": 0, "messages": '
                    '[{"role": "user", "content": "b"}], "max_tokens": 4}\n', encoding="utf-8")
    assert [e["arrival_s"] for e in sched.read_trace(path)] == [0, 1]
    path.write_text('{"arrival_s": 1, "max_tokens": 4}\n', encoding="utf-8")
    with pytest.raises(ValueError):
        sched.read_trace(path)


def test_shipped_trace_is_valid_and_from_permissive_sets() -> None:
    entries = sched.read_trace(TRACE)
    assert len(entries) >= 16
    assert {e["source"].split("/")[0] for e in entries} <= {"mtbench", "humaneval", "gsm8k"}
    assert all(1 <= e["max_tokens"] <= 512 for e in entries)
    json.dumps(entries)


def test_the_max_tokens_ablation_ignores_predictions() -> None:
    jobs = [sched.SimJob(0.0, 5, 100, 3, predicted_len=3.0), sched.SimJob(0.0, 5, 100, 1, predicted_len=1.0)]
    ablation = sched.simulate(jobs, "ssjf-max-tokens", UNIT, num_rows=1)
    # Equal max_tokens and no predictions: SSJF falls back to arrival order, like FCFS...
    assert ablation == sched.simulate(jobs, "fcfs", UNIT, num_rows=1)
    # ...while with the predictions it runs the shorter job first.
    assert ablation != sched.simulate(jobs, "ssjf", UNIT, num_rows=1)


# The SJF oracle moved here from treeserve.actors.scheduler.policy (it reads true lengths, which no server
# knows); these were its tests there.
def _req(rid: str, arrival: float, predicted: float | None = None, true_len: int | None = None) -> Any:
    return sched.QueuedRequest(rid, arrival, 8, 512, predicted, true_len)


def _drain(policy: Any, now: float) -> list[str]:
    out: list[str] = []
    while (r := policy.pop_next(now)) is not None:
        out.append(r.request_id)
    return out


def test_oracle_uses_true_len_and_ignores_prediction() -> None:
    p = sched.SJFOraclePolicy()
    p.add(_req("a", 0.0, predicted=1, true_len=500), 0.0)
    p.add(_req("b", 1.0, predicted=900, true_len=3), 1.0)
    p.add(_req("c", 2.0, predicted=50, true_len=40), 2.0)
    assert _drain(p, now=5.0) == ["b", "c", "a"]
    s = sched.SSJFPolicy(max_wait_s=math.inf)
    for r in (_req("a", 0.0, 1, 500), _req("b", 1.0, 900, 3), _req("c", 2.0, 50, 40)):
        s.add(r, 2.0)
    assert _drain(s, now=5.0) == ["a", "c", "b"]  # SSJF follows the (wrong) prediction
    with pytest.raises(ValueError, match="true_len"):
        p.add(_req("no-truth", 0.0, predicted=3), 0.0)
    assert isinstance(sched.make_simulated_policy("sjf-oracle", 30.0), sched.SJFOraclePolicy)


def test_sjf_oracle_without_aging_starves_the_long_job() -> None:
    # One long job amid short ones arriving 2.5 per served request (test_policy_aging's stream).
    policy = sched.SJFOraclePolicy()
    stream = sorted([*(_req(f"s{i}", round(0.4 * i, 6), 10.0, 10) for i in range(501)),
                     _req("long", 0.1, 5000.0, 5000)], key=lambda r: r.arrival_s)
    served, pending = [], iter(stream)
    nxt = next(pending, None)
    for step in range(200):
        while nxt is not None and nxt.arrival_s <= step:
            policy.add(nxt, float(step))
            nxt = next(pending, None)
        if (chosen := policy.pop_next(float(step))) is not None:
            served.append(chosen.request_id)
    assert "long" not in served and "long" in policy and len(served) == 200


def test_the_oracle_runs_only_in_the_simulator() -> None:
    with pytest.raises(SystemExit):
        sched.main(["--policy", "sjf-oracle"])
    assert "sjf-oracle" not in sched.POLICY_NAMES and set(sched.POLICY_NAMES) < set(sched.SIMULATED_POLICIES)


# ------------------------------------------------------------------ the known-load mode's pieces
SHIPPED_TRACE = SCHEDULING_PY.parent / "data" / "trace_chat512.jsonl"


def test_burst_and_rate_replays_keep_every_request_once() -> None:
    trace = [e for e in sched.read_trace(SHIPPED_TRACE, resolve=False) if "messages" in e]
    burst = sched.burst_of(trace)
    assert [e["arrival_s"] for e in burst] == [0.0] * len(trace)
    assert [e["trace_index"] for e in burst] == list(range(len(trace)))
    paced = sched.at_rate(trace, 0.5, seed=3)
    assert sorted(e["trace_index"] for e in paced) == list(range(len(trace)))
    assert [e["messages"] for e in paced] == [trace[e["trace_index"]]["messages"] for e in paced]
    times = [e["arrival_s"] for e in paced]
    assert times == sorted(times) and times[0] == 0.0
    many = sched.at_rate([trace[0]] * 4000, 0.5, seed=1)  # the rate really is the one asked for
    assert 4000 / many[-1]["arrival_s"] == pytest.approx(0.5, rel=0.05)


def test_the_shipped_trace_is_chat_from_the_test_split_with_no_restricted_text() -> None:
    from treeserve.training.length_data import is_test_prompt

    trace = sched.read_trace(SHIPPED_TRACE, resolve=False)
    assert len(trace) >= 32 and all(e["max_tokens"] == 512 for e in trace)
    assert {e["source"].split("/")[0] for e in trace} == set(sched.CHAT_TRACE_SETS)
    for e in trace:
        dataset, _, prompt_id = e["source"].partition("/")
        assert is_test_prompt(dataset, prompt_id), e["source"]
        if dataset in sched.REFERENCE_SETS:  # named by id and hash: no text of theirs is committed
            assert "messages" not in e and "prompt" not in e and len(e["prompt_sha256"]) == 64
        else:
            assert dataset in sched.TRACE_SETS and e["messages"][0]["role"] == "user"


API_TRACE = SCHEDULING_PY.parent / "data" / "trace_api.jsonl"


def test_the_api_trace_carries_each_prompts_api_cap_from_the_test_split() -> None:
    from treeserve.training.length_data import is_test_prompt

    caps = load_script("treeserve_bench_api_caps", SCHEDULING_PY.parent / "data" / "api_caps.py")
    KIND_CAPS, api_cap, kind_of = caps.KIND_CAPS, caps.api_cap, caps.kind_of

    trace = sched.read_trace(API_TRACE, resolve=False)
    assert len(trace) >= 40 and min(e["max_tokens"] for e in trace) <= 16 and max(e["max_tokens"] for e in trace) == 1024
    assert {e["source"].split("/")[0] for e in trace} == set(sched.API_TRACE_SETS)
    for e in trace:
        dataset, _, prompt_id = e["source"].partition("/")
        assert is_test_prompt(dataset, prompt_id), e["source"]
        assert e["max_tokens"] == api_cap(dataset, prompt_id) and e["max_tokens"] in KIND_CAPS[kind_of(dataset, prompt_id)]
        if dataset in sched.REFERENCE_SETS:
            assert "messages" not in e and "prompt" not in e
    # The cap is a pure function of the id: the same prompt always gets the same cap.
    assert api_cap("synthetic", "synthetic/oneword/3") == api_cap("synthetic", "synthetic/oneword/3") in (8, 16)


def test_trace_entries_by_reference_resolve_from_the_fetched_set_and_check_the_hash(tmp_path: Path) -> None:
    import hashlib

    (tmp_path / "arenahard.jsonl").write_text(json.dumps({"id": "u1", "prompt": "Why is the sky blue?"}) + "\n",
                                              encoding="utf-8")
    sha = hashlib.sha256(b"Why is the sky blue?").hexdigest()
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival_s": 0, "max_tokens": 8, "source": "arenahard/u1", "prompt_sha256": sha}) + "\n",
                    encoding="utf-8")
    (entry,) = sched.read_trace(path, data_dir=tmp_path)
    assert entry["messages"] == [{"role": "user", "content": "Why is the sky blue?"}]
    path.write_text(json.dumps({"arrival_s": 0, "max_tokens": 8, "source": "arenahard/u1",
                                "prompt_sha256": "0" * 64}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="differs"):
        sched.read_trace(path, data_dir=tmp_path)
    with pytest.raises(ValueError, match="fetch.py alpacaeval"):
        sched.resolve_prompt({"source": "alpacaeval/x", "prompt_sha256": sha}, tmp_path)


def test_repeats_report_medians_of_each_rounds_own_ratios() -> None:
    rounds = [{"fcfs": {"mean_jct_s": 10.0, "ratio": 1.0}, "ssjf": {"mean_jct_s": 8.0, "ratio": 0.8}},
              {"fcfs": {"mean_jct_s": 20.0, "ratio": 1.0}, "ssjf": {"mean_jct_s": 14.0, "ratio": 0.7}},
              {"fcfs": {"mean_jct_s": 12.0, "ratio": 1.0}, "ssjf": {"mean_jct_s": 11.0, "ratio": math.nan}}]
    table = sched.median_table(rounds)
    assert table["fcfs"]["mean_jct_s"] == 12.0 and table["ssjf"]["mean_jct_s"] == 11.0
    assert table["ssjf"]["ratio"] == pytest.approx(0.75)  # NaN rounds left out
    assert table["ssjf"]["num_repeats"] == 3.0
    assert sched.rotated(["a", "b", "c"], 0) == ["a", "b", "c"] and sched.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_capacity_and_oracle_gain_share() -> None:
    # 4 jobs on 2 rows: the busy period ends at the 2nd completion (t=10); the tail is not counted.
    burst = [sched.JobResult(0.0, 0.0, t, 5) for t in (5.0, 10.0, 30.0, 60.0)]
    assert sched.capacity_from_burst(burst, num_rows=2) == pytest.approx(2 / 10.0)
    assert sched.capacity_from_burst(burst[:1], num_rows=2) == pytest.approx(1 / 5.0)
    table = {"fcfs": {"mean_jct_s": 100.0}, "ssjf": {"mean_jct_s": 80.0}, "sjf-oracle": {"mean_jct_s": 75.0}}
    assert sched.oracle_gain_share(table, "ssjf") == pytest.approx(0.8)
    assert sched.oracle_gain_share(table, "fcfs") == 0.0
    table["sjf-oracle"]["mean_jct_s"] = 100.0  # no gain to share
    assert math.isnan(sched.oracle_gain_share(table, "ssjf"))


def test_jobs_come_from_a_predictions_csv_or_a_lengths_csv_of_some_sets(tmp_path: Path) -> None:
    predictions = tmp_path / "predictions.csv"
    predictions.write_text("num_prompt_tokens,num_output_tokens,predicted_len\n10,5,7.5\n", encoding="utf-8")
    assert sched.read_jobs_csv(predictions, 512) == [sched.SimJob(0.0, 10, 512, 5, 7.5)]
    lengths = tmp_path / "lengths.csv"
    lengths.write_text('# script: "bench/predictor_data.py"\ndataset,id,num_prompt_tokens,num_output_tokens\n'
                       "gsm8k,1,20,30\nsynthetic,2,5,6\n", encoding="utf-8")
    assert sched.read_jobs_csv(lengths, 256) == [sched.SimJob(0.0, 20, 256, 30, None), sched.SimJob(0.0, 5, 256, 6, None)]
    assert sched.read_jobs_csv(lengths, 256, sets=["gsm8k"]) == [sched.SimJob(0.0, 20, 256, 30, None)]
    with pytest.raises(SystemExit):
        sched.read_jobs_csv(lengths, 256, sets=["mtbench"])
