"""Stand-ins for the gateway's collaborators, for tests, demos and other-language
client checks without a model: ``ScriptedScheduler`` (a scheduler actor whose
``generate`` echoes the prompt back in scripted chunk sizes and records what happened)
and ``ByteTokenizer`` (token id = UTF-8 byte, so multi-byte characters span tokens).
``tiny_bpe_tokenizer`` builds a real ``treeserve.ops.tokenizer.Tokenizer`` offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from treeserve.actors.gateway.actor import GatewayActor
from treeserve.actors.gateway.config import GatewayConfig, TokenizerLike
from treeserve.runtime.actor import Actor, handler, stream_handler
from treeserve.runtime.bodies import body_to_wire
from treeserve.runtime.config import RuntimeConfig
from treeserve.runtime.errors import ActorError
from treeserve.runtime.runtime import Runtime
from treeserve.transport.wire import ErrorCode

__all__ = [
    "ByteTokenizer",
    "ScriptedScheduler",
    "expected_echo",
    "fake_gateway",
    "tiny_bpe_tokenizer",
]

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ByteTokenizer:
    """A tokenizer whose ids are UTF-8 bytes (0..255) plus four specials: 256 ``<eos>``
    (the stop id), 257 ``<user>``, 258 ``<assistant>``, 259 ``<system>``. Its chat
    template accepts only those three roles (others raise ``ValueError``)."""

    EOS = 256
    SPECIALS = {256: "<eos>", 257: "<user>", 258: "<assistant>", 259: "<system>"}
    vocab_size = 260

    def __init__(self) -> None:
        self.stop_ids = frozenset({self.EOS})

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (special-token strings are not parsed)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; broken UTF-8 becomes U+FFFD, specials their names unless skipped."""
        out: list[str] = []
        run = bytearray()
        for token in ids:
            if token < 256:
                run.append(token)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                out.append(self.SPECIALS[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """``[role]content\\n`` per message, then ``[assistant]``."""
        parts = []
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unsupported role {m['role']!r}")
            parts.append(f"[{m['role']}]{m['content']}\n")
        if add_generation_prompt:
            parts.append("[assistant]")
        return "".join(parts)


def tiny_bpe_tokenizer() -> Any:
    """A real ``Tokenizer``: byte-level BPE over the 256-symbol byte alphabet (no
    merges), ChatML specials (``<|im_end|>`` is a stop id) and a ChatML template."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer

    from treeserve.ops.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = BackendTokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|im_start|>", "<|im_end|>")])
    return Tokenizer(backend, bos_id=None, eos_id=backend.token_to_id("<|im_end|>"), chat_template=_CHATML)


def expected_echo(prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """The tokens ``ScriptedScheduler`` generates: the prompt repeated, cut at
    ``max_new_tokens`` or just after the first stop id."""
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = prompt_ids[len(out) % len(prompt_ids)]
        out.append(token)
        if token in stop_ids:
            break
    return out


class ScriptedScheduler(Actor):
    """A scheduler stand-in: ``generate`` echoes the prompt (see ``expected_echo``) in
    chunks of ``chunk_sizes`` tokens (cycled), sleeping ``delay_s`` before each, then
    yields the final stats item marked ``done``. ``fail_code`` (a wire error code, or
    ``"crash"`` for a plain exception) makes every ``generate`` fail at once instead. ``finish``
    (the gateway's call when a stop string appears) ends that stream before its next chunk with
    ``finish_reason`` ``"stop"``. ``events`` records ``(event, request_id)`` pairs: ``start``,
    ``finish``, ``done``, ``cancelled`` (the generator saw CancelledError or GeneratorExit);
    ``bodies`` maps request id to the body received, in its wire form, and ``received`` to the
    body object itself (a gateway in this process passes a typed body as it is)."""

    max_concurrency = 512
    mailbox_size = 1024

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        cfg = dict(config or {})
        self.delay_s = float(cfg.get("delay_s", 0.0))
        self.chunk_sizes = [int(n) for n in cfg.get("chunk_sizes", [1, 2, 3])]
        self.fail_code: str | None = cfg.get("fail_code")
        self.events: list[tuple[str, str]] = []
        self.bodies: dict[str, dict[str, Any]] = {}
        self.received: dict[str, Any] = {}
        self.finished: dict[str, int] = {}

    @stream_handler
    async def generate(self, received: Any) -> AsyncIterator[dict[str, Any]]:
        """Echo the prompt back; see the class docstring."""
        start = time.perf_counter()
        body = body_to_wire(received)  # the form it would have had from another process
        request_id = str(body["request_id"])
        self.bodies[request_id] = body
        self.received[request_id] = received
        self.events.append(("start", request_id))
        if self.fail_code == "crash":
            raise RuntimeError("scripted crash")
        if self.fail_code is not None:
            raise ActorError(f"scripted {self.fail_code}", code=ErrorCode(self.fail_code))
        params = body["params"]
        out = expected_echo(body["prompt_ids"], int(params["max_new_tokens"]), params["stop_token_ids"])
        ttft_s = 0.0
        num_steps = 0
        try:
            emitted = 0
            while emitted < len(out) and request_id not in self.finished:
                size = self.chunk_sizes[num_steps % len(self.chunk_sizes)]
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                chunk = out[emitted : emitted + size]
                emitted += len(chunk)
                num_steps += 1
                if num_steps == 1:
                    ttft_s = time.perf_counter() - start
                yield {"token_ids": chunk}
            is_stop = (bool(out) and out[-1] in params["stop_token_ids"]) or request_id in self.finished
            yield {
                "done": True,
                "finish_reason": "stop" if is_stop else "length",
                "num_prompt_tokens": len(body["prompt_ids"]),
                "num_generated_tokens": self.finished.get(request_id, len(out)),
                "num_steps": num_steps,
                "mean_accepted_per_step": len(out) / max(1, num_steps),
                "queue_s": 0.0,
                "ttft_s": ttft_s,
                "total_s": time.perf_counter() - start,
            }
        except (asyncio.CancelledError, GeneratorExit):
            self.events.append(("cancelled", request_id))
            raise
        self.events.append(("done", request_id))

    @handler
    async def finish(self, body: dict[str, Any]) -> bool:
        """End ``body["request_id"]``'s stream after ``body["num_tokens"]`` tokens (as a stop)."""
        request_id = str(body["request_id"])
        self.events.append(("finish", request_id))
        self.finished[request_id] = int(body["num_tokens"])
        return True

    @handler
    async def get_events(self) -> list[list[str]]:
        """``events`` as a list of ``[event, request_id]`` pairs."""
        return [list(e) for e in self.events]


@contextlib.asynccontextmanager
async def fake_gateway(
    config: GatewayConfig | None = None,
    *,
    tokenizer: TokenizerLike | None = None,
    scheduler: Mapping[str, Any] | None = None,
    gateway_cls: type[GatewayActor] = GatewayActor,
) -> AsyncIterator[tuple[GatewayActor, ScriptedScheduler]]:
    """Run a ``Runtime`` hosting a ``ScriptedScheduler`` (config ``scheduler``) and a
    gateway in front of it (default: ``ByteTokenizer``, a free loopback tcp port; read
    ``gateway.endpoint``). Everything is stopped on exit."""
    async with Runtime(RuntimeConfig()) as rt:
        fake = ScriptedScheduler(scheduler)
        ref = await rt.node.host("scheduler", fake)
        gateway = gateway_cls(
            config if config is not None else GatewayConfig(bind="tcp://127.0.0.1:0"),
            tokenizer if tokenizer is not None else ByteTokenizer(),
            ref,
        )
        await rt.node.host("gateway", gateway)
        yield gateway, fake
