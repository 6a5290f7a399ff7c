"""Byte-level BPE or SentencePiece tokenizer (``tokenizers`` package) from GGUF metadata or a
``tokenizer.json``.

Also renders the model's own Jinja chat template in a sandbox, and offers
:class:`IncrementalDetokenizer`, which turns a growing list of token ids into text deltas
without ever emitting half of a multi-byte character.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# Pre-tokenizer regexes of llama.cpp's BPE "pre" types (src/llama-vocab.cpp).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Special tokens that end a turn in common chat formats; added to stop_ids when present.
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
_SPECIAL_TOKEN_TYPES = (2, 3, 4)  # llama.cpp: UNKNOWN, CONTROL and USER_DEFINED (matched as special text)
CHAT_ROLES = frozenset({"system", "user", "assistant"})
# Roles a chat template names in a comparison: m['role'] == 'tool', message.role != "ipython",
# m['role'] in ['tool', 'developer'].
_ROLE_COMPARED = re.compile(r"""role['"]?\]?\s*(?:==|!=)\s*['"]([A-Za-z_][\w-]*)['"]""")
_ROLE_LISTED = re.compile(r"""role['"]?\]?\s*(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")
_QUOTED_NAME = re.compile(r"""['"]([A-Za-z_][\w-]*)['"]""")
_PRIVATE_USE = range(0xE000, 0xF900)  # marker characters for escaped special-token text


class TokenizerError(ValueError):
    """The tokenizer metadata is unsupported or inconsistent."""


_NORMAL, _BYTE = 1, 6  # llama.cpp's token types: NORMAL, BYTE (<0xXX>)


def _sentencepiece_backend(tokens: Sequence[str], scores: Sequence[float] | None, types: Sequence[int],
                           vocab: dict[str, int], add_space_prefix: bool | None, unknown_id: int | None) -> BackendTokenizer:
    """llama.cpp's SentencePiece tokenizer (``tokenizer.ggml.model = "llama"``) as a ``tokenizers``
    BPE: spaces become "▁" (and one is prepended to each text piece, unless the file says not
    to), then adjacent pieces merge, the pair whose joined piece scores highest first (leftmost
    among equals), as llama.cpp's ``llm_tokenizer_spm`` does; a piece left outside the vocabulary
    falls back to its UTF-8 bytes' ``<0xXX>`` tokens. The merges are every split of a normal
    token into two vocabulary pieces, ranked by the token's score."""
    if scores is None:
        raise TokenizerError("a SentencePiece GGUF tokenizer needs tokenizer.ggml.scores")
    ranked = sorted((i for i, kind in enumerate(types) if kind == _NORMAL), key=lambda i: (-scores[i], i))
    merges: list[tuple[str, str]] = []
    for index in ranked:
        piece = tokens[index]
        pairs = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        merges += sorted(((a, b) for a, b in pairs if a in vocab and b in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]]))
    unk = tokens[unknown_id] if unknown_id is not None and 0 <= unknown_id < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "▁")]
    if add_space_prefix is None or add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix is None or add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def _pre_tokenizer(pre: str | None) -> Any:
    """The ``tokenizers`` pre-tokenizer equivalent to llama.cpp's BPE pre type ``pre``."""
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in (None, "default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    patterns = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
    if pre in patterns:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise TokenizerError(f"unsupported BPE pre-tokenizer {pre!r} (supported: smollm, gpt2, llama-bpe, qwen2)")


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    ``bos_id``/``eos_id`` may be None when the model has none; ``stop_ids`` are the token ids
    that end a generation (EOS plus turn-end specials present in the vocabulary).
    ``encode`` prepends BOS only when the model asks for it (``add_bos``). With
    ``split_special_tokens``, ``encode`` and ``encode_chat`` tokenize special-token strings
    found in the text (in chat messages: their contents) as plain text, so user text can
    never become a control token; a chat template's own markup stays special.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None,
        add_bos: bool = False,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        stops = {eos_id} if eos_id is not None else set()
        stops.update(extra_stop_ids)
        for token in _TURN_END_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None:
                stops.add(token_id)
        self.stop_ids: frozenset[int] = frozenset(stops)
        specials = sorted((t.content for t in backend.get_added_tokens_decoder().values() if t.special),
                          key=lambda t: (-len(t), t))  # longest first: a regex alternation takes the first
        self.special_tokens: tuple[str, ...] = tuple(specials)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain: BackendTokenizer | None = None
        self._template: Any = None  # the chat template compiled by jinja2, on first use

    @property
    def _plain_backend(self) -> BackendTokenizer:
        """The same tokenizer with special-token matching off, for text that must stay text;
        built on first use (a copy takes 0.1-0.2 s, and a verifier process never encodes)."""
        if self._plain is None:
            plain = BackendTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf_reader(cls, reader: Any) -> Tokenizer:
        """Build from an open ``gguf.GGUFReader`` (``tokenizer.ggml.*`` fields: gpt2-style BPE, or
        llama's SentencePiece)."""

        def value(key: str) -> Any:
            field = reader.fields.get(key)
            return None if field is None else field.contents()

        kind = value("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported GGUF tokenizer {kind!r}; supported: gpt2 (byte-level BPE), "
                                 "llama (SentencePiece BPE with byte fallback)")
        tokens: list[str] = value("tokenizer.ggml.tokens")
        types: list[int] = value("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            vocab.setdefault(token, index)
        if kind == "llama":
            backend = _sentencepiece_backend(tokens, value("tokenizer.ggml.scores"), types, vocab,
                                             value("tokenizer.ggml.add_space_prefix"), value("tokenizer.ggml.unknown_token_id"))
        else:
            merges: list[str] = value("tokenizer.ggml.merges") or []
            merge_pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
            backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
            backend.pre_tokenizer = _pre_tokenizer(value("tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, kind_id in enumerate(types) if kind_id in _SPECIAL_TOKEN_TYPES]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        extra = value("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_id=value("tokenizer.ggml.bos_token_id"),
            eos_id=value("tokenizer.ggml.eos_token_id"),
            chat_template=value("tokenizer.chat_template"),
            add_bos=bool(value("tokenizer.ggml.add_bos_token")),
            extra_stop_ids=[extra] if extra is not None else (),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from the tokenizer metadata of a GGUF file."""
        import gguf

        return cls.from_gguf_reader(gguf.GGUFReader(str(path)))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from ``tokenizer.json`` plus optional ``tokenizer_config.json`` / ``config.json``.

        Works for Hugging Face model folders and for folders written by :meth:`save`.
        """
        folder = Path(folder)
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        settings = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")

        def token_id(entry: Any) -> int | None:
            if isinstance(entry, Mapping):
                entry = entry.get("content")
            return backend.token_to_id(entry) if isinstance(entry, str) else None

        bos_id = token_id(settings.get("bos_token"))
        eos_id = token_id(settings.get("eos_token"))
        extra: list[int] = []
        config_eos = model_config.get("eos_token_id")
        for candidate in config_eos if isinstance(config_eos, list) else [config_eos]:
            if isinstance(candidate, int):
                extra.append(candidate)
                eos_id = candidate if eos_id is None else eos_id
        saved_stops = settings.get("treeserve_stop_ids")
        if isinstance(saved_stops, list):
            extra.extend(i for i in saved_stops if isinstance(i, int))
        if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
            bos_id = model_config["bos_token_id"]
        template = settings.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            chat_template=template if isinstance(template, str) else None,
            add_bos=bool(settings.get("add_bos_token", False)),
            extra_stop_ids=extra,
        )

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` that :meth:`from_folder` reads back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        settings = {
            "bos_token": self.backend.id_to_token(self.bos_id) if self.bos_id is not None else None,
            "eos_token": self.backend.id_to_token(self.eos_id) if self.eos_id is not None else None,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
            "treeserve_stop_ids": sorted(self.stop_ids),
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1), encoding="utf-8")

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def chat_roles(self) -> frozenset[str]:
        """The roles a chat may use: system, user and assistant, plus any role the chat
        template compares a message's role with (``m['role'] == 'tool'``, ``... in [...]``)."""
        template = self.chat_template or ""
        named = set(_ROLE_COMPARED.findall(template))
        for listed in _ROLE_LISTED.findall(template):
            named.update(_QUOTED_NAME.findall(listed))
        return CHAT_ROLES | frozenset(named)

    def encode(self, text: str, *, add_bos: bool | None = None, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in it map to their ids, or, with
        ``split_special_tokens``, are tokenized as the plain text they are.

        BOS is prepended when ``add_bos`` is True, or when it is None and the model asks for it.
        """
        backend = self._plain_backend if split_special_tokens else self.backend
        ids = list(backend.encode(text, add_special_tokens=False).ids)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 byte runs become U+FFFD)."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the model's own Jinja template.

        The template runs in jinja2's immutable sandbox with HF's settings (trim_blocks,
        lstrip_blocks). Raises :class:`TokenizerError` if the model has no template.
        """
        return str(self._compiled_template().render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.backend.id_to_token(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.backend.id_to_token(self.eos_id) if self.eos_id is not None else "",
        ))

    def _compiled_template(self) -> Any:
        """The chat template compiled once (3-4 ms a request for the default model's, when
        every request compiled it again)."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TokenizerError(f"chat template error: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template

    def warm(self) -> None:
        """Build now what the first request would build (the plain-text backend, 0.1-0.2 s; the
        compiled chat template): a server calls it before it serves. A template that does not
        compile is left to fail the chat requests that use it, as it did, not the start."""
        _ = self._plain_backend
        if self.chat_template is not None:
            try:
                self._compiled_template()
            except Exception:  # noqa: BLE001 - jinja2's TemplateSyntaxError and kin; each chat request reports it
                self._template = None

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
        split_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (BOS added only if the template lacks it).

        With ``split_special_tokens``, special-token strings inside the messages' values stay
        text: each is replaced by a marker the template passes through unchanged (a private-use
        character absent from the input, around the token's index), the template is rendered,
        the result is split at the special tokens the template wrote, and every other piece is
        tokenized with the markers turned back into their text, special-token matching off.
        Without such strings the ids are exactly those of the plain path."""
        if not split_special_tokens or self._special_re is None:
            ids = self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
                              add_bos=False)
        else:
            ids = self._encode_chat_split(messages, add_generation_prompt)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _encode_chat_split(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int]:
        special_re = self._special_re
        assert special_re is not None  # checked by the caller
        texts = [v for m in messages for v in m.values() if isinstance(v, str)] + [self.chat_template or ""]
        marker = next((chr(c) for c in _PRIVATE_USE if not any(chr(c) in t for t in texts)), None)
        if marker is None:  # every private-use character is in the input: nothing can be escaped
            raise TokenizerError("cannot keep special-token text apart in these messages")
        index = {token: i for i, token in enumerate(self.special_tokens)}

        def escape(text: str) -> str:
            return special_re.sub(lambda m: f"{marker}{index[m.group()]}{marker}", text)

        unescape_re = re.compile(f"{re.escape(marker)}(\\d+){re.escape(marker)}")
        escaped = [{k: escape(v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]
        rendered = self.apply_chat_template(escaped, add_generation_prompt=add_generation_prompt)
        ids: list[int] = []
        position = 0
        for match in special_re.finditer(rendered):  # the template's own markup
            ids += self._encode_plain(unescape_re, rendered[position:match.start()])
            token_id = self.backend.token_to_id(match.group())
            assert token_id is not None  # a special token of this vocabulary
            ids.append(token_id)
            position = match.end()
        ids += self._encode_plain(unescape_re, rendered[position:])
        return ids

    def _encode_plain(self, unescape_re: re.Pattern[str], piece: str) -> list[int]:
        if not piece:
            return []
        text = unescape_re.sub(lambda m: self.special_tokens[int(m.group(1))], piece)
        return list(self._plain_backend.encode(text, add_special_tokens=False).ids)


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas that never split a multi-byte character.

    ``push(ids)`` returns the new, complete text; bytes of an unfinished UTF-8 character are
    held back until a later token completes them. ``finish()`` returns whatever is left
    (with U+FFFD for a truly broken tail). Only a short window of ids is re-decoded per call.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # ids before this have been emitted

    def push(self, ids: Iterable[int]) -> str:
        """Append ``ids`` and return the newly completed text (possibly empty)."""
        self._ids.extend(int(i) for i in ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def finish(self) -> str:
        """Flush any held-back text at the end of the stream."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
