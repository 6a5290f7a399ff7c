"""VerifierShard + SpeculatorActor in child processes of a real Runtime, driven like a scheduler.

The driver prefills several requests, then loops propose -> step until every request is done,
exactly as the scheduler will. Greedy requests must emit the tokens of single-request
``generate_speculative`` (float32 tiny model loaded from files by the children); a TP=2 pair of
shards (gloo) must give the same replies as TP=1, stochastic requests included.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve.actors.speculator import SpeculatorActor
from treeserve.actors.messages.tree_wire import params_to_wire, tree_from_wire
from treeserve.actors.verifier import VerifierShard
from treeserve.models import load_model
from treeserve.ops.drafting import ModelSpeculator
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import emit_until_done, generate_speculative
from treeserve.runtime import ActorRef, RemoteError, Runtime, RuntimeConfig, SupervisorConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    # The reference runs in this process; tiny models gain nothing from intra-op threads.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


import tiny_model_files as tiny  # registered by conftest.py

SPECULATORS = [
    {"kind": "ngram", "max_ngram": 3, "num_draft_tokens": 3},
    {"kind": "self", "layers": 3, "expansion": [1, 2, 1]},  # all 3 layers: a perfect greedy drafter
]
ROW_CAPACITY = 96


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def requests_for(vocab: int) -> list[dict[str, Any]]:
    prompts = [[5, 9, 14, 5, 9], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42], [7, 8]]
    assert all(t < vocab for p in prompts for t in p)
    return [
        {"prompt": prompts[0], "params": SamplingParams(max_new_tokens=12)},
        {"prompt": prompts[1], "params": SamplingParams(max_new_tokens=10)},
        {"prompt": prompts[2], "params": SamplingParams(temperature=0.8, top_k=20, seed=5, max_new_tokens=9)},
    ]


async def fan(shards: list[ActorRef], method: str, body: Any) -> Any:
    """Send one call to every shard, await all, return rank 0's reply (checking they agree)."""
    replies = await asyncio.gather(*(s.ask(method, body, timeout=60) for s in shards))
    if method == "info":  # identical but for the rank itself
        replies = [{k: v for k, v in r.items() if k != "tp_rank"} for r in replies]
    assert all(r == replies[0] for r in replies), f"ranks disagree on {method}: {replies}"
    return replies[0]


async def drive(
    shards: list[ActorRef], speculator: ActorRef, requests: list[dict[str, Any]], tag: str
) -> list[tuple[list[int], int]]:
    """A scheduler-like loop: prefill + start, then propose -> step until every request is done.

    Returns each request's (emitted tokens, number of verify steps)."""
    info = await fan(shards, "info", None)
    assert info["num_rows"] >= len(requests) and info["row_capacity"] == ROW_CAPACITY
    state = []
    reply = await fan(shards, "prefill", {"rows": [{"row": row, "prompt_ids": req["prompt"]}
                                                   for row, req in enumerate(requests)]})
    assert reply == {"rows": [{"row": row, "length": len(req["prompt"]) - 1} for row, req in enumerate(requests)]}
    for row, req in enumerate(requests):
        rid = f"{tag}-{row}"
        await speculator.ask("start", {"request_id": rid, "prompt_ids": req["prompt"]})
        state.append({"rid": rid, "row": row, "params": req["params"], "emitted": [], "new": [], "done": False,
                      "steps": 0})
    while active := [s for s in state if not s["done"]]:
        proposal = await speculator.ask("propose", {"requests": [
            {"request_id": s["rid"], "new_tokens": s["new"], "params": params_to_wire(s["params"]),
             "max_depth": s["params"].max_new_tokens - len(s["emitted"]) - 1} for s in active
        ]})
        assert proposal["missing"] == []
        rows = [{"row": s["row"], "tree": tree, "params": params_to_wire(s["params"]), "request_id": s["rid"]}
                for s, tree in zip(active, proposal["trees"])]
        reply = await fan(shards, "step", {"rows": rows})
        for s, entry, row in zip(active, reply["rows"], rows):
            tree = tree_from_wire(row["tree"])
            assert entry["row"] == s["row"] and entry["accepted"][0] == 0
            assert entry["new_tokens"] == [int(tree.tokens[i]) for i in entry["accepted"][1:]] + [entry["bonus_token"]]
            _, finish = emit_until_done(s["emitted"], entry["new_tokens"], s["params"])
            s["new"] = entry["new_tokens"]
            s["steps"] += 1
            if finish is not None:
                s["done"] = True
                await fan(shards, "release", {"row": s["row"], "request_id": s["rid"]})
                await speculator.ask("release", {"request_id": s["rid"]})
    return [(s["emitted"], s["steps"]) for s in state]


def shard_config(model_dir: Path, rank: int, size: int, port: int) -> dict[str, Any]:
    return {"model": str(model_dir), "cache_dir": str(model_dir.parent / "cache"), "dtype": "float32",
            "tp_rank": rank, "tp_size": size, "dist_init": f"tcp://127.0.0.1:{port}", "device": "cpu",
            "num_rows": 4, "row_capacity": ROW_CAPACITY, "num_threads": 1}


async def test_scheduler_loop_matches_reference_and_tp2_matches_tp1(tmp_path: Path) -> None:
    model_dir = tiny.write_tiny_hf_model(tmp_path / "tiny", seed=4)
    model = load_model(str(model_dir)).model
    requests = requests_for(model.config.vocab_size)
    port = free_port()
    # Generous start timeout: four children import torch at once on a small, shared machine.
    config = RuntimeConfig(supervisor=SupervisorConfig(start_timeout_s=90), default_timeout_s=90)
    async with Runtime(config) as rt:
        spawned = await asyncio.gather(
            rt.spawn(SpeculatorActor, {"model": str(model_dir), "speculators": SPECULATORS, "capacity": ROW_CAPACITY,
                      "num_threads": 1},
                     name="spec", process="child"),
            rt.spawn(VerifierShard, shard_config(model_dir, 0, 1, port), name="v1", process="child"),
            # Sequential spawning of TP ranks must work: the rendezvous runs in the background.
            rt.spawn(VerifierShard, shard_config(model_dir, 0, 2, port), name="v2r0", process="child"),
        )
        speculator, tp1, rank0 = spawned
        rank1 = await rt.spawn(VerifierShard, shard_config(model_dir, 1, 2, port), name="v2r1", process="child")
        out_tp1 = await drive([tp1], speculator, requests, "tp1")
        out_tp2 = await drive([rank0, rank1], speculator, requests, "tp2")
        await check_bad_calls_are_rejected(tp1)
        await check_rank0_failure_fails_every_rank([rank0, rank1], model.config.vocab_size)
    for req, (tokens, num_steps) in zip(requests, out_tp1):
        assert len(tokens) == req["params"].max_new_tokens
        if req["params"].is_greedy:
            assert num_steps < len(tokens) / 2  # the all-layer drafter's chains were accepted
            drafters = [NGramSpeculator(model.config.vocab_size, max_ngram=3, num_draft_tokens=3),
                        ModelSpeculator(model.truncated(3), (1, 2, 1))]
            expected = generate_speculative(model, drafters, req["prompt"], req["params"]).token_ids
            assert tokens == expected
    assert out_tp2 == out_tp1


async def check_bad_calls_are_rejected(shard: ActorRef) -> None:
    """Malformed calls get ValueError replies (RemoteError here) and the shard keeps serving."""
    greedy = params_to_wire(SamplingParams())
    tree = {"parents": [-1, 0], "tokens": [3, 4], "proposal_children": [1], "proposal_speculators": [0],
            "proposal_q_rows": [0], "draft_probs": None}
    bad_calls = [
        ("prefill", {"rows": [{"row": 9, "prompt_ids": [1, 2]}]}, "out of range"),
        ("prefill", {"rows": [{"row": 0, "prompt_ids": []}]}, "non-empty"),
        ("prefill", {"rows": [{"row": 0, "prompt_ids": list(range(3, 3 + ROW_CAPACITY))}]}, "no room"),
        ("prefill", {"rows": [{"row": 0}]}, "missing"),
        ("prefill", {"rows": [{"row": 0, "prompt_ids": [1, 2]}, {"row": 0, "prompt_ids": [3, 4]}]}, "once"),
        ("prefill", {"rows": []}, "non-empty"),
        ("prefill", {"row": 0, "prompt_ids": [1, 2]}, "missing"),
        ("step", {"rows": [{"row": 0, "tree": {**tree, "tokens": [3, 999]}, "params": greedy,
                            "request_id": "a"}]}, "token ids"),
        ("step", {"rows": [{"row": 0, "tree": {**tree, "parents": [0, 0]}, "params": greedy,
                            "request_id": "a"}]}, "invalid token tree"),
        ("step", {"rows": [{"row": 0, "tree": tree, "params": {"top_p": 2.0}, "request_id": "a"}]}, "top_p"),
        ("step", {"rows": []}, "non-empty"),
    ]
    for method, body, message in bad_calls:
        with pytest.raises(RemoteError, match=message):
            await shard.ask(method, body)
    assert await shard.ask("prefill", {"rows": [{"row": 0, "prompt_ids": [5, 6, 7]}]}) == {"rows": [{"row": 0, "length": 2}]}
    reply = await shard.ask("step", {"rows": [{"row": 0, "tree": tree, "params": greedy, "request_id": "a"}]})
    assert reply["rows"][0]["accepted"][0] == 0
    await shard.ask("release", {"row": 0, "request_id": "a"})


async def check_rank0_failure_fails_every_rank(shards: list[ActorRef], vocab: int) -> None:
    """A verification error on rank 0 reaches the other ranks (no hang) and nobody commits."""
    sampled = params_to_wire(SamplingParams(temperature=1.0, seed=1))
    # Token 4 is proposed from a q that gives it probability 0: rank 0's verifier raises.
    bad = {"parents": [-1, 0], "tokens": [3, 4], "proposal_children": [1], "proposal_speculators": [0],
           "proposal_q_rows": [0], "draft_probs": {"shape": [1, vocab], "index": [5], "values": [1.0]}}
    await fan(shards, "prefill", {"rows": [{"row": 1, "prompt_ids": [5, 6, 7]}]})
    outcomes = await asyncio.gather(
        *(s.ask("step", {"rows": [{"row": 1, "tree": bad, "params": sampled, "request_id": "x"}]}, timeout=60)
          for s in shards),
        return_exceptions=True,
    )
    assert all(isinstance(o, RemoteError) for o in outcomes), outcomes
    assert "probability" in str(outcomes[0])
    good = {**bad, "draft_probs": {"shape": [1, vocab], "index": [4], "values": [1.0]}}
    reply = await fan(shards, "step", {"rows": [{"row": 1, "tree": good, "params": sampled, "request_id": "x"}]})
    assert reply["rows"][0]["accepted"][0] == 0
    await fan(shards, "release", {"row": 1, "request_id": "x"})
