"""Token trees and sampling params survive the wire exactly; malformed dicts raise ValueError."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from treeserve.actors.messages.tree_wire import (
    SPARSE_MAX_NONZEROS,
    params_from_wire,
    params_to_wire,
    tree_from_wire,
    tree_to_wire,
)
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree, TokenTreeBuilder, merge_trees
from treeserve.transport import Request, decode, encode


def through_codec(body: Any) -> Any:
    msg = decode(encode(Request(id=1, target="v", method="step", body=body)))
    assert isinstance(msg, Request)
    return msg.body


def stochastic_tree(vocab: int, *, dense: bool) -> TokenTree:
    gen = torch.Generator().manual_seed(0)
    builder = TokenTreeBuilder(5, with_probs=True)
    q = torch.softmax(torch.randn(vocab, generator=gen), -1) if dense else torch.nn.functional.one_hot(
        torch.tensor(3), vocab).float()
    row = builder.add_probs(q)
    a = builder.add_proposal(0, 3, speculator=0, q_row=row)
    builder.add_proposal(0, 3, speculator=0, q_row=row)  # duplicate draw: second proposal, same node
    row2 = builder.add_probs(q)
    builder.add_proposal(a, 7, speculator=0, q_row=row2)
    other = TokenTreeBuilder(5, with_probs=True)
    other.add_proposal(0, 9, q_row=other.add_probs(q))
    return merge_trees([builder.build(), other.build()])


def assert_same_tree(a: TokenTree, b: TokenTree) -> None:
    for name in ("parents", "tokens", "proposal_children", "proposal_speculators", "proposal_q_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert getattr(b, name).dtype == torch.long
    if a.draft_probs is None:
        assert b.draft_probs is None
    else:
        assert b.draft_probs is not None and b.draft_probs.dtype == torch.float32
        assert torch.equal(a.draft_probs, b.draft_probs)


@pytest.mark.parametrize("kind", ["greedy", "root_only", "sparse", "dense"])
def test_tree_round_trip_direct_and_through_codec(kind: str) -> None:
    if kind == "greedy":
        tree = TokenTree.from_parents([-1, 0, 0, 1, 3], [4, 8, 9, 10, 11])
    elif kind == "root_only":
        tree = TokenTree.from_parents([-1], [4])
    else:
        tree = stochastic_tree(SPARSE_MAX_NONZEROS * 2, dense=kind == "dense")
    wire = tree_to_wire(tree)
    if kind == "dense":
        assert isinstance(wire["draft_probs"], np.ndarray)  # too many non-zeros for the sparse form
    if kind == "sparse":
        assert isinstance(wire["draft_probs"], dict)
    assert_same_tree(tree, tree_from_wire(wire))
    assert_same_tree(tree, tree_from_wire(through_codec(wire)))
    # Integer fields arriving as arrays (the spec's int32/int64 form) are accepted too.
    as_arrays = {**wire, "parents": np.asarray(wire["parents"], np.int32), "tokens": torch.tensor(wire["tokens"])}
    assert_same_tree(tree, tree_from_wire(through_codec(as_arrays)))


def test_trees_in_a_step_body_use_one_frame_at_most_each() -> None:
    # 40 rows must fit the transport's 64-frame limit: greedy trees need no frame at all.
    rows = [{"row": i, "tree": tree_to_wire(TokenTree.chain(1, [2, 3])), "request_id": str(i)} for i in range(40)]
    frames = encode(Request(id=1, target="v", method="step", body={"rows": rows}))
    assert len(frames) == 1


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w.pop("tokens"), "missing"),
        (lambda w: w.update(extra=1), "unknown"),
        (lambda w: w.update(parents=[-1, 0, 5]), "invalid token tree"),
        (lambda w: w.update(tokens=[1, 2.5, 3]), "integers"),
        (lambda w: w.update(tokens="abc"), "list or an integer array"),
        (lambda w: w.update(parents=np.zeros((2, 2), np.int64)), "1-D integer"),
        (lambda w: w.update(draft_probs=np.zeros(3, np.float32)), "2-D float"),
        (lambda w: w.update(draft_probs={"shape": [1, 4], "index": [9], "values": [1.0]}), "index entries"),
        (lambda w: w.update(draft_probs={"shape": [1, 4], "index": [0], "values": [-1.0]}), "non-negative"),
        (lambda w: w.update(draft_probs={"shape": [1], "index": [], "values": []}), "shape"),
    ],
)
def test_malformed_tree_raises_value_error(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    wire = tree_to_wire(TokenTree.from_parents([-1, 0, 1], [1, 2, 3]))
    mutate(wire)
    with pytest.raises(ValueError, match=message):
        tree_from_wire(wire)
    with pytest.raises(ValueError, match="map"):
        tree_from_wire([1, 2, 3])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w.update(parents=[-1.0]), "integers"),
        (lambda w: w.update(tokens=[True]), "integers"),
        (lambda w: w.update(parents=[0]), "only root"),
        (lambda w: w.update(proposal_children=[1]), "equal shapes"),
        (lambda w: w.pop("proposal_q_rows"), "missing"),
    ],
)
def test_a_one_node_tree_is_checked_like_any_other(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    """A plain decode step's one-node tree takes a short parse; anything off that shape goes to
    the full one and is refused as before."""
    tree = TokenTree.root_only(7)
    assert_same_tree(TokenTree.from_parents([-1], [7]), tree)
    wire = tree_to_wire(tree)
    assert_same_tree(tree, tree_from_wire(wire))
    mutate(wire)
    with pytest.raises(ValueError, match=message):
        tree_from_wire(wire)


def test_params_round_trip_and_validation() -> None:
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=11, stop_token_ids=(2, 5), max_new_tokens=33)
    assert params_from_wire(params_to_wire(params)) == params
    assert params_from_wire(through_codec(params_to_wire(params))) == params
    assert params_from_wire({}) == SamplingParams()
    assert params_from_wire({"temperature": 0, "top_k": None, "seed": None, "stop_token_ids": None}) == SamplingParams()
    for bad, message in [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temprature": 1.0}, "unknown"),
    ]:
        with pytest.raises(ValueError, match=message):
            params_from_wire(bad)
    with pytest.raises(ValueError, match="map"):
        params_from_wire("greedy")
