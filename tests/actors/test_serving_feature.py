"""A feature-level drafter served through the actor system: the verifier's hidden states travel
to the speculator actor and the drafts it makes from them are the in-process ones.

With one feature speculator, fixed trees (adaptive sizing off) and greedy decoding, the served
request must take exactly as many verify steps as ``generate_speculative`` in this process:
states that arrive late, out of order or for the wrong tokens change the drafts and with them
the accepted counts. The output must equal incremental decoding as always.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.client import Client
from treeserve.training.feature_distill import TrainConfig, collect_states, train_feature_drafter
from treeserve.ops.feature_drafter import init_feature_drafter, load_feature_drafter, save_feature_drafter
from treeserve.ops.feature_speculator import FeatureSpeculator
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental, generate_speculative
from treeserve.ops.ssm import ssm_config_for
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

PROMPTS = [[5, 9, 11, 30, 7], [40, 41, 42, 43, 40, 41, 42], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
WIDTHS = [2, 2, 1, 1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")
    model = tiny.make_tiny_model()
    # A drafter trained briefly on the model's own greedy outputs agrees with it often enough
    # that accepted drafts (and so the states of accepted nodes) matter.
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with the server's processes
    params = SamplingParams(max_new_tokens=40)
    sequences = []
    for seed in range(24):
        prompt = torch.randint(3, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        sequences.append(torch.tensor(prompt + generate_incremental(model, prompt, params).token_ids))
    data = collect_states(model, sequences)
    config = ssm_config_for(model, num_layers=1, ffn_dim=model.config.ffn_dim, draft_vocab_size=model.config.vocab_size)
    drafter = init_feature_drafter(model, config, torch.arange(model.config.vocab_size))
    train_feature_drafter(drafter, data, TrainConfig(epochs=100, lr=3e-3, length=48))
    torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("drafter") / "fd.safetensors"
    save_feature_drafter(drafter, path)
    return folder, path


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with the server's processes
    yield
    torch.set_num_threads(threads)


def in_process(folder: Path, path: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], int, list[int]]:
    model = tiny.make_tiny_model()  # the weights written to ``folder``
    speculator = FeatureSpeculator(load_feature_drafter(model, path), WIDTHS)
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(tiny.EOS_ID,))
    out = generate_speculative(model, [speculator], prompt, params, max_tree_nodes=32)
    return out.token_ids, out.num_steps, generate_incremental(model, prompt, params).token_ids


async def test_served_feature_drafts_equal_the_in_process_ones(served: tuple[Path, Path]) -> None:
    folder, path = served
    config = ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=4, row_capacity=160, max_tree_nodes=32,
        speculators=({"kind": "feature", "path": str(path), "expansion": WIDTHS},), scheduling=SchedulerSettings(adaptive_speculation=False),
        heartbeat_interval_s=0.25, step_timeout_s=60.0,
    )
    async with Server(config) as server, Client(server.endpoint) as client:
        num_accepting = 0
        for prompt in PROMPTS:
            tokens, steps, reference = in_process(folder, path, prompt, 24)
            assert tokens == reference
            done = await client.generate(prompt, speculate="tree", max_tokens=24)
            assert list(done.token_ids) == reference
            assert done.num_steps == steps
            num_accepting += steps < len(reference)
        # Drafts were accepted, so misplaced states would have changed the step counts.
        assert num_accepting > 0
