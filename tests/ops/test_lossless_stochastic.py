"""Stochastic losslessness of multi-step speculative sampling (MSS, unseeded requests) and of
keyed verification (seeded requests) over merged token trees.

The LLM's own distribution of the first ``K`` generated tokens is computed exactly by
enumeration from its probabilities; many seeded speculative runs must match it under a
chi-square test, and deliberately wrong verification rules must fail the same test. Keyed
verification must also emit, seed by seed, exactly the tokens of keyed decoding without
speculation from the same logits.

Two harnesses: a fast one where the tiny models' logits for every reachable prefix are
tabulated once (so thousands of draws only run the real drafting, merging and verification
code), and an end-to-end one through ``generate_speculative`` with real ``ModelSpeculator``s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import Tensor

from treeserve.ops.drafting import ModelSpeculator, Speculator, expand_token_tree
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SampleKey, SamplingParams, logits_to_probs, sample_keyed
from treeserve.ops.speculative import generate_speculative
from treeserve.ops.token_tree import TokenTree, merge_trees
from treeserve.ops.verify import VerifyFn, VerifyResult, verify_keyed, verify_stochastic

VOCAB = 8
PROMPT = [1, 5, 2, 7]
PASS_P_VALUE = 1e-3  # a correct rule must pass (seeded, so deterministic)
FAIL_P_VALUE = 1e-6  # a wrong rule must fail far below the pass threshold


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    # Tiny tensors: intra-op thread start-up costs ~50x the work on a busy 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(seed: int, num_layers: int = 1) -> Transformer:
    config = ModelConfig(
        vocab_size=VOCAB, dim=16, num_layers=num_layers, num_heads=2, num_kv_heads=1,
        head_dim=8, ffn_dim=32, max_seq_len=32,
    )
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.5 * torch.randn(param.shape, generator=gen))
    return model.eval()


def prefix_logits(model: Transformer, max_len: int) -> dict[tuple[int, ...], Tensor]:
    """Logits after PROMPT + c for every generated prefix c of length 0..max_len."""
    conts = list(itertools.product(range(VOCAB), repeat=max_len))
    seqs = torch.tensor([PROMPT + list(c) for c in conts])  # (N, P + L)
    with torch.no_grad():
        out = model(seqs, model.new_cache(len(conts), seqs.shape[1]))
    assert isinstance(out, Tensor)
    table: dict[tuple[int, ...], Tensor] = {}
    for row, cont in enumerate(conts):
        for j in range(max_len + 1):
            table[cont[:j]] = out[row, len(PROMPT) - 1 + j]
    return table


def exact_distribution(table: dict[tuple[int, ...], Tensor], params: SamplingParams, k: int) -> Tensor:
    """P(first k tokens) of plain sampling, flattened over VOCAB**k outcomes (index = base-VOCAB)."""
    probs = torch.ones(1, dtype=torch.float64)
    for j in range(k):
        prefixes = list(itertools.product(range(VOCAB), repeat=j))
        step = torch.stack([logits_to_probs(table[p], params).double() for p in prefixes])  # (V**j, V)
        probs = (probs[:, None] * step).reshape(-1)
    return probs


def chi_square_p_value(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled."""
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0  # an outcome the LLM can never produce
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


class TableSpeculator:
    """A Speculator whose drafter logits come from a table, drafting with the real expansion code."""

    def __init__(self, table: dict[tuple[int, ...], Tensor], expansion: Sequence[int]) -> None:
        self.table, self.expansion = table, tuple(expansion)
        self.history: list[int] = []

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.history = list(prompt_ids)

    def generated(self) -> list[int]:
        return self.history[len(PROMPT):]

    def propose(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_depth: int | None = None,
        max_nodes: int | None = None,  # the trees here are far below any limit
    ) -> TokenTree:
        base = self.generated()

        def next_logits(parents: list[int], tokens: list[int], frontier: list[int]) -> Tensor:
            rows = []
            for node in frontier:
                path = []
                while node > 0:
                    path.append(tokens[node])
                    node = parents[node]
                rows.append(self.table[tuple(base + path[::-1])])
            return torch.stack(rows)

        expansion = self.expansion if max_depth is None else self.expansion[:max_depth]
        if not expansion:
            return TokenTree.from_parents([-1], [self.history[-1]])
        return expand_token_tree(self.history[-1], expansion, next_logits, params, generator)

    def accept(self, new_tokens: Sequence[int]) -> None:
        self.history.extend(new_tokens)


def draw_first_tokens(
    llm_table: dict[tuple[int, ...], Tensor],
    speculators: Sequence[TableSpeculator | NGramSpeculator],
    params: SamplingParams,
    verifier: VerifyFn,
    num_draws: int,
    k: int,
    seed: int,
) -> Tensor:
    """Counts over VOCAB**k outcomes of the first k tokens of speculative sampling (the loop of
    generate_speculative with table lookups in place of LLM forwards)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB**k, dtype=torch.long)
    for _ in range(num_draws):
        for s in speculators:
            s.prefill(PROMPT)
        generated: list[int] = []
        while len(generated) < k:
            remaining = k - len(generated)
            tree = merge_trees([s.propose(params, gen, max_depth=remaining - 1) for s in speculators])
            logits = torch.stack(
                [llm_table[tuple(generated + tree.tokens[tree.path_to(n)[1:]].tolist())] for n in range(tree.num_nodes)]
            )  # (T, V)
            new = verifier(tree, logits, params, gen).new_tokens(tree)[:remaining]
            generated += new
            for s in speculators:
                s.accept(new)
        index = 0
        for token in generated:
            index = index * VOCAB + token
        counts[index] += 1
    return counts


# ------------------------------------------------------------------ deliberately wrong rules
def accept_without_ratio(
    tree: TokenTree, logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """WRONG: accepts every first proposal (no p/q ratio), then samples the bonus from p."""
    accepted = [0]
    proposals = tree.proposals()
    while proposals[accepted[-1]]:
        accepted.append(proposals[accepted[-1]][0].child)
    p = logits_to_probs(logits[accepted[-1]], params)
    return VerifyResult(accepted, int(torch.multinomial(p, 1, generator=generator)))


def residual_without_subtraction(
    tree: TokenTree, logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> VerifyResult:
    """WRONG: the ratio test is right but a rejection keeps p instead of norm(max(0, p - q))."""
    assert tree.draft_probs is not None
    probs = logits_to_probs(logits, params)
    proposals = tree.proposals()
    accepted = [0]
    while True:
        p = probs[accepted[-1]]
        for proposal in proposals[accepted[-1]]:
            assert proposal.q_row is not None
            x = int(tree.tokens[proposal.child])
            if float(torch.rand((), generator=generator)) * float(tree.draft_probs[proposal.q_row, x]) < float(p[x]):
                accepted.append(proposal.child)
                break
        else:
            return VerifyResult(accepted, int(torch.multinomial(p, 1, generator=generator)))


# ------------------------------------------------------------------ fast table-driven tests
K = 3


@pytest.fixture(scope="module")
def tables() -> tuple[dict[tuple[int, ...], Tensor], list[dict[tuple[int, ...], Tensor]]]:
    llm = tiny_model(0, num_layers=2)
    ssms = [tiny_model(1), tiny_model(2)]
    return prefix_logits(llm, K - 1), [prefix_logits(m, K - 1) for m in ssms]


CASES = {
    "t1.0": SamplingParams(temperature=1.0),
    "t1.3_topk5_topp0.9": SamplingParams(temperature=1.3, top_k=5, top_p=0.9),
}


def make_table_speculators(ssm_tables: list[dict[tuple[int, ...], Tensor]]) -> list[TableSpeculator | NGramSpeculator]:
    # Two SSMs with several children per node (duplicates kept as separate proposals) merged,
    # plus an n-gram speculator whose point-mass proposals join the same merged tree.
    return [
        TableSpeculator(ssm_tables[0], (3, 2)),
        TableSpeculator(ssm_tables[1], (2, 2)),
        NGramSpeculator(VOCAB, max_ngram=2, num_draft_tokens=2, num_branches=2),
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_mss_matches_llm_distribution_and_wrong_rules_fail(tables, case: str) -> None:  # type: ignore[no-untyped-def]
    llm_table, ssm_tables = tables
    params = CASES[case]
    exact = exact_distribution(llm_table, params, K)
    num_draws = 2000
    counts = draw_first_tokens(llm_table, make_table_speculators(ssm_tables), params, verify_stochastic, num_draws, K, 0)
    p_value = chi_square_p_value(counts, exact)
    tv = 0.5 * float((counts.double() / num_draws - exact).abs().sum())
    assert p_value > PASS_P_VALUE, (p_value, tv)
    for wrong in (accept_without_ratio, residual_without_subtraction):
        wrong_counts = draw_first_tokens(llm_table, make_table_speculators(ssm_tables), params, wrong, num_draws, K, 0)
        assert chi_square_p_value(wrong_counts, exact) < FAIL_P_VALUE, wrong.__name__


# ------------------------------------------------------------------ end to end through generate_speculative
def generate_counts(
    llm: Transformer, ssms: Sequence[Transformer], params: SamplingParams, verifier: VerifyFn, num_draws: int, k: int
) -> Tensor:
    gen = torch.Generator().manual_seed(1)
    speculators = [ModelSpeculator(ssms[0], (2, 2, 1)), ModelSpeculator(ssms[1], (1, 3))]
    counts = torch.zeros(VOCAB**k, dtype=torch.long)
    for _ in range(num_draws):
        out = generate_speculative(llm, speculators, PROMPT, params, generator=gen, verifier=verifier).token_ids
        assert len(out) == k
        index = 0
        for token in out:
            index = index * VOCAB + token
        counts[index] += 1
    return counts


def run_end_to_end(num_draws: int, num_wrong_draws: int) -> None:
    llm = tiny_model(0, num_layers=2)
    ssms = [tiny_model(1), tiny_model(2)]
    # top_k=3 keeps VOCAB**3 outcomes down to 27 reachable ones, so few draws suffice.
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=K)
    exact = exact_distribution(prefix_logits(llm, K - 1), params, K)
    counts = generate_counts(llm, ssms, params, verify_stochastic, num_draws, K)
    assert chi_square_p_value(counts, exact) > PASS_P_VALUE
    wrong_counts = generate_counts(llm, ssms, params, accept_without_ratio, num_wrong_draws, K)
    assert chi_square_p_value(wrong_counts, exact) < FAIL_P_VALUE


def test_generate_speculative_end_to_end_matches_llm_distribution() -> None:
    run_end_to_end(num_draws=800, num_wrong_draws=300)


@pytest.mark.slow
def test_generate_speculative_end_to_end_extended() -> None:
    run_end_to_end(num_draws=8000, num_wrong_draws=3000)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mss_extended_draws(tables, case: str) -> None:  # type: ignore[no-untyped-def]
    llm_table, ssm_tables = tables
    params = CASES[case]
    exact = exact_distribution(llm_table, params, K)
    counts = draw_first_tokens(llm_table, make_table_speculators(ssm_tables), params, verify_stochastic, 30000, K, 7)
    assert chi_square_p_value(counts, exact) > PASS_P_VALUE
    wrong = draw_first_tokens(llm_table, make_table_speculators(ssm_tables), params, residual_without_subtraction, 30000, K, 7)
    assert chi_square_p_value(wrong, exact) < FAIL_P_VALUE


# ------------------------------------------------------------------ the served configuration
def perturbed(drafter: Transformer, seed: int) -> Transformer:
    """``drafter`` with noise on every weight but the embedding (the LLM's own), in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.startswith("embed_tokens."):
                param.add_(0.5 * torch.randn(param.shape, generator=gen))
    return drafter


def distilled_and_ngram(llm: Transformer) -> list[Speculator]:
    """The benchmark's distilled kinds: two SSMs with reduced draft vocabularies (tokens outside
    are never drafted), greedy-spine trees with i.i.d. draws, merged with the n-gram drafter."""
    from treeserve.ops.ssm import DistilledSpeculator, init_ssm_from_verifier, ssm_config_for

    ssms = [perturbed(init_ssm_from_verifier(llm, ssm_config_for(llm, num_layers=1, ffn_dim=32,
                                                                 draft_vocab_size=len(ids)), torch.tensor(ids)), seed)
            for seed, ids in ((3, [0, 2, 3, 5, 6]), (4, [1, 2, 4, 7]))]
    return [DistilledSpeculator(ssms[0], (2, 2, 1)), DistilledSpeculator(ssms[1], (3, 1)),
            NGramSpeculator(VOCAB, max_ngram=2, num_draft_tokens=2, num_branches=2)]


def feature_only(llm: Transformer) -> list[Speculator]:
    """A feature drafter (reduced draft vocabulary, spine of i.i.d. draws over it, fed the
    LLM's states): the benchmark's best mode at temperature 0.8."""
    from treeserve.ops.feature_drafter import init_feature_drafter
    from treeserve.ops.feature_speculator import FeatureSpeculator
    from treeserve.ops.ssm import ssm_config_for

    config = ssm_config_for(llm, num_layers=1, ffn_dim=32, draft_vocab_size=5)
    drafter = perturbed(init_feature_drafter(llm, config, torch.tensor([0, 2, 3, 5, 6])), 6)
    return [FeatureSpeculator(drafter, (3, 2, 1))]


def feature_and_ngram(llm: Transformer) -> list[Speculator]:
    """The served default's kinds, in its order: the feature drafter, then the n-gram drafter."""
    return [*feature_only(llm), NGramSpeculator(VOCAB, max_ngram=2, num_draft_tokens=2, num_branches=2)]


def feature_ngram_and_suffix(llm: Transformer) -> list[Speculator]:
    """The served default's kinds with the suffix drafter merged last, its index fed by an
    earlier request (and, draw after draw, by every earlier draw of this test, as a server's)."""
    from treeserve.ops.suffix import SuffixIndex, SuffixSpeculator

    index = SuffixIndex(min_ngram=1)
    SuffixSpeculator(index, VOCAB).prefill([*PROMPT, 1, 2, 3, 1, 2, 4, 1, 2, 3])
    return [*feature_and_ngram(llm), SuffixSpeculator(index, VOCAB, min_probability=0.0)]


def served_counts(llm: Transformer, speculators: Sequence[Speculator], params: SamplingParams, verifier: VerifyFn,
                  num_draws: int, k: int) -> Tensor:
    """Counts of the first ``k`` tokens of ``generate_speculative`` with ``speculators``."""
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB**k, dtype=torch.long)
    for _ in range(num_draws):
        out = generate_speculative(llm, speculators, PROMPT, params, generator=gen, verifier=verifier).token_ids
        index = 0
        for token in out[:k]:
            index = index * VOCAB + token
        counts[index] += 1
    return counts


@pytest.mark.parametrize("make_speculators", [distilled_and_ngram, feature_only, feature_and_ngram,
                                              feature_ngram_and_suffix])
def test_served_kinds_at_temperature_0_8_match_the_llm_distribution(make_speculators) -> None:  # type: ignore[no-untyped-def]
    llm = tiny_model(0, num_layers=2)
    params = SamplingParams(temperature=0.8, max_new_tokens=2)  # no top-k / top-p: the full vocabulary
    exact = exact_distribution(prefix_logits(llm, 1), params, 2)
    counts = served_counts(llm, make_speculators(llm), params, verify_stochastic, 1500, 2)
    assert chi_square_p_value(counts, exact) > PASS_P_VALUE
    wrong = served_counts(llm, make_speculators(llm), params, accept_without_ratio, 1500, 2)
    assert chi_square_p_value(wrong, exact) < FAIL_P_VALUE


# ------------------------------------------------------------------ keyed verification (seeded requests)
def accept_first_keyed(tree: TokenTree, logits: Tensor, params: SamplingParams, key: SampleKey) -> VerifyResult:
    """WRONG: accepts every first proposal, then the keyed bonus at the leaf's position."""
    accepted = [0]
    proposals = tree.proposals()
    while proposals[accepted[-1]]:
        accepted.append(proposals[accepted[-1]][0].child)
    p = logits_to_probs(logits[accepted[-1]][None], params)
    return VerifyResult(accepted, sample_keyed(p, key.seed, [key.position + len(accepted) - 1])[0])


def keyed_ignoring_temperature(tree: TokenTree, logits: Tensor, params: SamplingParams, key: SampleKey) -> VerifyResult:
    """WRONG: keyed verification against the temperature-1 distribution."""
    return verify_keyed(tree, logits, SamplingParams(temperature=1.0, top_k=params.top_k, top_p=params.top_p), key)


def keyed_first_tokens(
    llm_table: dict[tuple[int, ...], Tensor],
    speculators: Sequence[TableSpeculator | NGramSpeculator],
    params: SamplingParams,
    verifier: Callable[[TokenTree, Tensor, SamplingParams, SampleKey], VerifyResult],
    seeds: range,
    k: int,
) -> tuple[Tensor, int]:
    """Counts over VOCAB**k outcomes of the first k tokens, one seeded run per seed (drafting
    from a stream of its own), and how many runs differ from keyed decoding without speculation
    (the keyed draw at each position from the same table logits)."""
    counts = torch.zeros(VOCAB**k, dtype=torch.long)
    num_differ = 0
    for seed in seeds:
        seeded = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
        draft_gen = torch.Generator().manual_seed(10_000 + seed)
        for s in speculators:
            s.prefill(PROMPT)
        generated: list[int] = []
        while len(generated) < k:
            remaining = k - len(generated)
            tree = merge_trees([s.propose(seeded, draft_gen, max_depth=remaining - 1) for s in speculators])
            logits = torch.stack(
                [llm_table[tuple(generated + tree.tokens[tree.path_to(n)[1:]].tolist())] for n in range(tree.num_nodes)]
            )  # (T, V)
            key = SampleKey(seed, len(PROMPT) + len(generated))  # the position the root's logits predict
            new = verifier(tree, logits, seeded, key).new_tokens(tree)[:remaining]
            generated += new
            for s in speculators:
                s.accept(new)
        plain: list[int] = []
        for _ in range(k):
            p = logits_to_probs(llm_table[tuple(plain)][None], seeded)
            plain += sample_keyed(p, seed, [len(PROMPT) + len(plain)])
        num_differ += plain != generated
        index = 0
        for token in generated:
            index = index * VOCAB + token
        counts[index] += 1
    return counts, num_differ


@pytest.mark.parametrize("case", list(CASES))
def test_keyed_verification_is_lossless_equals_plain_decoding_and_wrong_rules_fail(tables, case: str) -> None:  # type: ignore[no-untyped-def]
    llm_table, ssm_tables = tables
    params = CASES[case]
    exact = exact_distribution(llm_table, params, K)
    counts, num_differ = keyed_first_tokens(llm_table, make_table_speculators(ssm_tables), params, verify_keyed,
                                            range(2000), K)
    assert chi_square_p_value(counts, exact) > PASS_P_VALUE
    assert num_differ == 0  # with speculation = without, seed by seed
    wrong_rules = [accept_first_keyed] + ([keyed_ignoring_temperature] if params.temperature != 1.0 else [])
    for wrong in wrong_rules:
        wrong_counts, wrong_differ = keyed_first_tokens(llm_table, make_table_speculators(ssm_tables), params, wrong,
                                                        range(1000), K)
        assert chi_square_p_value(wrong_counts, exact) < FAIL_P_VALUE, wrong.__name__
        assert wrong_differ > 0, wrong.__name__
