"""API-style traffic: every prompt with the ``max_tokens`` an API client would send for its kind.

Real API traffic carries caps from a handful of tokens to thousands: a classification call asks
for 8, an extraction for 32-64, a chat for 512-1,024. :func:`api_cap` gives each prompt of the
fetched public sets and of the synthetic set (``synthetic.py``, whose ids name the kind of
answer a template asks for) one such cap, picked among its kind's options by a hash of its id,
so the same prompt always gets the same cap. ``bench/predictor_caps.py`` trains and scores the
length predictor on these caps; ``bench/scheduling.py --make-trace ... --trace-caps api`` writes
a trace of them.
"""

from __future__ import annotations

import hashlib

KIND_CAPS: dict[str, tuple[int, ...]] = {
    "synthetic/oneword": (8, 16),  # classification, yes/no and one-word answers
    "synthetic/short": (32, 64, 128),  # extraction, short factual answers, arithmetic
    "synthetic/medium": (128, 256),  # definitions, a few sentences
    "synthetic/list": (256, 512),
    "synthetic/code": (512, 1024),
    "synthetic/long": (1024,),  # essays and stories
    "gsm8k": (256, 512),  # math word problems
    "humaneval": (512, 1024),  # code completion
    "mtbench": (512, 1024),  # chat
    "arenahard": (1024,),  # chat (real users' prompts)
    "alpacaeval": (512, 1024),  # chat (instructions)
}
"""The caps a client sends per kind of prompt (synthetic prompts by the kind in their id)."""
MAX_API_CAP = max(max(caps) for caps in KIND_CAPS.values())


def kind_of(dataset: str, prompt_id: str) -> str:
    """The :data:`KIND_CAPS` key of a prompt: ``synthetic/<kind>`` for synthetic ids
    (``synthetic/<kind>/<n>``), else the set's name."""
    if dataset == "synthetic":
        return "/".join(prompt_id.split("/")[:2])
    return dataset


def api_cap(dataset: str, prompt_id: str) -> int:
    """The prompt's cap: one of its kind's options, picked by a hash of ``dataset/id``."""
    options = KIND_CAPS[kind_of(dataset, prompt_id)]
    digest = hashlib.sha256(f"{dataset}/{prompt_id}".encode()).digest()
    return options[digest[0] % len(options)]


__all__ = ["KIND_CAPS", "MAX_API_CAP", "api_cap", "kind_of"]
