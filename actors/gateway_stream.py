"""One generation as the gateway relays it: tokenize a validated request, build the
scheduler's ``generate`` body, and turn the scheduler's token stream into client items
(incremental text + token ids) and the final ``stream_end`` body. No sockets here: items
go out through the ``send_item`` callback the gateway passes in."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, cast

from treeserve.actors.gateway_config import TokenizerLike
from treeserve.actors.gateway_request import GenerateRequest, InvalidRequest
from treeserve.ops.tokenizer import IncrementalDetokenizer, Tokenizer
from treeserve.runtime.ref import ActorRef

__all__ = ["STAT_KEYS", "prompt_ids_for", "relay_generation", "scheduler_body"]

STAT_KEYS = (
    "finish_reason",
    "num_prompt_tokens",
    "num_generated_tokens",
    "num_steps",
    "mean_accepted_per_step",
    "queue_s",
    "ttft_s",
    "total_s",
    "predicted_len",
)
"""Scheduler stats copied into ``stream_end`` (a whitelist: the scheduler may add
internal fields that are no business of the client)."""


def prompt_ids_for(tokenizer: TokenizerLike, req: GenerateRequest, context_length: int) -> list[int]:
    """The prompt's token ids: given ids, the encoded ``prompt``, or the ``messages``
    rendered with the chat template (``encode_chat`` when the tokenizer has it, so BOS
    is handled as the model wants). Raises ``InvalidRequest`` for a template error, an
    empty result, or a prompt leaving no room in the context for a generated token."""
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    elif req.prompt is not None:
        ids = [int(t) for t in tokenizer.encode(req.prompt)]
    else:
        assert req.messages is not None
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            encode_chat = getattr(tokenizer, "encode_chat", None)
            if callable(encode_chat):
                ids = [int(t) for t in encode_chat(messages)]
            else:
                ids = [int(t) for t in tokenizer.encode(tokenizer.apply_chat_template(messages))]
        except Exception as exc:  # template errors are about the client's messages
            raise InvalidRequest(f"cannot apply the chat template: {exc}") from exc
    if not ids:
        raise InvalidRequest("the prompt tokenizes to no tokens")
    if len(ids) >= context_length:
        raise InvalidRequest(
            f"the prompt is {len(ids)} tokens; the context holds {context_length} tokens "
            "including at least one generated token"
        )
    return ids


def scheduler_body(req: GenerateRequest, prompt_ids: list[int], stop_ids: Sequence[int]) -> dict[str, Any]:
    """The scheduler's ``generate`` body (fresh ``request_id``; sampling params in the
    wire form of ``actors/tree_wire.params_to_wire``; the tokenizer's ``stop_ids`` plus
    the request's own stop ids)."""
    return {
        "request_id": uuid.uuid4().hex,
        "prompt_ids": prompt_ids,
        "params": {
            "temperature": req.temperature,
            "top_k": req.top_k,
            "top_p": req.top_p,
            "seed": req.seed,
            "stop_token_ids": sorted(set(stop_ids) | set(req.stop_token_ids)),
            "max_new_tokens": req.max_tokens,
        },
        "speculate": req.speculate.value,
    }


async def relay_generation(
    scheduler: ActorRef,
    body: dict[str, Any],
    tokenizer: TokenizerLike,
    send_item: Callable[[dict[str, Any]], Awaitable[None]],
) -> dict[str, Any]:
    """Run ``scheduler.generate(body)``, passing ``{"text", "token_ids"}`` items to
    ``send_item`` (text never splits a UTF-8 character; special tokens give no text),
    and return the ``stream_end`` body: full text, all ids and the scheduler's stats.
    Cancelling the caller, or ``send_item`` raising, cancels the scheduler's stream."""
    detok = IncrementalDetokenizer(cast(Tokenizer, tokenizer), skip_special_tokens=True)
    pieces: list[str] = []
    token_ids: list[int] = []
    final: dict[str, Any] | None = None
    # ask_stream is an async generator: closing it cancels the scheduler's stream.
    items = cast(AsyncGenerator[Any, None], scheduler.ask_stream("generate", body, timeout=None))
    async with contextlib.aclosing(items):
        async for item in items:
            if not isinstance(item, dict):
                raise TypeError(f"scheduler yielded a {type(item).__name__}, expected a map")
            if item.get("done") is True:
                final = item  # may still carry tokens: handled like any item
            ids = [int(t) for t in item.get("token_ids", ())]
            if not ids:
                continue
            text = detok.push(ids)
            pieces.append(text)
            token_ids.extend(ids)
            await send_item({"text": text, "token_ids": ids})
    tail = detok.finish()
    if tail:
        pieces.append(tail)
        await send_item({"text": tail, "token_ids": []})
    if final is None:
        raise RuntimeError("the scheduler ended the stream without its final stats item")
    end_body: dict[str, Any] = {"text": "".join(pieces), "token_ids": token_ids}
    end_body.update({k: final[k] for k in STAT_KEYS if k in final})
    return end_body
