"""Does the feature drafter draft better from several of the verifier's layers (EAGLE-3's fused
low, middle and high features) than from its final hidden state alone? An A/B on the same data.

Both drafters are the shipped architecture (one block, the verifier's draft-vocabulary head),
built by ``init_feature_drafter``, trained from scratch by the same loop, schedule and seed
(two draft steps, the second reading the drafter's own prediction, as ``treeserve
distill-features`` trains), and scored on the same held-out answers. They differ only in what a
verified position hands the drafter:

* ``last``: the final normed hidden state, as served today;
* ``fused``: ``Linear(3D -> D)`` of the outputs of blocks ``--taps`` (each RMS-normalised) and
  the final normed state, started as "the final state alone", where ``last`` starts.
  A second draft step reads the drafter's own predicted state in place of the fused one, as
  EAGLE-3 does.

Input: a ``treeserve distill-features`` work dir's states folder (its answers, generated in
q4_1), of which the first ``--train`` sequences are used, and held-out answers: a folder made
the same way, or a prompts file the verifier answers first (MT-Bench's, in the figures of
``bench/RESULTS.md``). Every sequence is run once more through the verifier in ``--format``
(eagerly, hooks on the tapped blocks) for the taps and the final states, so both drafters see
states from the same forward.

    python bench/drafter_layers.py --states WORK/states_256_q4_1/states \
        --heldout bench/data/mtbench.jsonl --train 1200 --epochs 5 --json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from treeserve.models import LoadedModel, load_model
from treeserve.training.teacher import read_prompts, select_prompts
# training_windows and training_batch: the windows and batches distill-features trains on (public for this bench)
from treeserve.training.feature_distill import (StateSequence, training_batch, training_windows, draft_vocabulary, feature_loss,
                                           generate_state_data, unrolled_features)
from treeserve.ops.feature_drafter import FeatureDrafter, init_feature_drafter
from treeserve.ops.model import Transformer
from treeserve.ops.ssm import ssm_config_for


@dataclass(frozen=True)
class Tapped:
    """A sequence with the final states of this forward (``seq.states``, float16) and the tapped
    blocks' outputs ``(L, taps, D)`` (float16)."""

    seq: StateSequence
    taps: Tensor


def read_states(folder: str, limit: int | None = None) -> list[StateSequence]:
    records: dict[int, StateSequence] = {}
    for path in sorted(glob.glob(f"{folder}/part_*.pt")) or sorted(glob.glob(f"{folder}/states/part_*.pt")):
        for index, record in torch.load(path, weights_only=True)["records"]:
            records[index] = StateSequence(**record)
    ordered = [records[i] for i in sorted(records)]
    return ordered[:limit] if limit is not None else ordered


def heldout_states(args: argparse.Namespace, loaded: LoadedModel) -> list[StateSequence]:
    """``--heldout``'s answers: a states folder as it is, or a prompts file (``.jsonl``) whose
    first 80 chat prompts the verifier answers greedily (256 tokens at most, batched) into
    ``--heldout-dir``, once (a rerun reuses them)."""
    if not args.heldout.endswith(".jsonl"):
        return read_states(args.heldout)
    prompts = select_prompts(loaded.tokenizer, read_prompts([args.heldout]), max_prompts=80)
    return generate_state_data(loaded.model, [(p, len(p)) for p in prompts], args.heldout_dir, max_new_tokens=256,
                               stop_ids=loaded.tokenizer.stop_ids, batch_size=64)


def tap(model: Transformer, data: Sequence[StateSequence], blocks: Sequence[int]) -> list[Tapped]:
    """Each sequence through ``model`` eagerly, keeping the outputs of ``blocks`` (RMS-normalised)
    and the final states."""
    model.decode_step = None  # the eager blocks, whose modules' hooks run
    # run_blocks does h = h + attn(...); h = h + mlp(post_attention_layernorm(h)) per block, so a
    # block's output is its post-attention norm's input plus its MLP's output.
    residual: dict[int, Tensor] = {}
    caught: dict[int, Tensor] = {}
    hooks = []
    for b in blocks:
        layer = model.layers[b]
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, b=b: residual.__setitem__(b, a[0])))
        hooks.append(layer.mlp.register_forward_hook(
            lambda m, a, out, b=b: caught.__setitem__(b, residual[b] + out)))
    out = []
    try:
        with torch.no_grad():
            for seq in data:
                ids = seq.token_ids.to(torch.long)[None]
                _, final = model(ids, model.new_cache(1, ids.shape[1]), return_hidden=True)
                taps = torch.stack([caught[b][0].float() for b in blocks], dim=1)  # (L, taps, D)
                # RMS-normalised before float16: the residual stream reaches tens of thousands
                taps = taps * torch.rsqrt(taps.pow(2).mean(-1, keepdim=True) + 1e-6)
                out.append(Tapped(StateSequence(seq.token_ids, final[0].to(torch.float16), seq.top1, seq.prompt_len),
                                  taps.to(torch.float16)))
    finally:
        for hook in hooks:
            hook.remove()
    return out


class Fusion(nn.Module):
    """``Linear(3D -> D)`` of the taps (RMS-normalised by :func:`tap`) and the final state
    (``fused``), or the final state itself (``last``)."""

    def __init__(self, dim: int, taps: int, fused: bool) -> None:
        super().__init__()
        self.linear = nn.Linear((taps + 1) * dim, dim, bias=False) if fused else None
        if self.linear is not None:
            with torch.no_grad():
                self.linear.weight.zero_()
                self.linear.weight[:, taps * dim:] = torch.eye(dim)  # starts as the final state alone

    def forward(self, taps: Tensor, final: Tensor) -> Tensor:
        if self.linear is None:
            return final
        return self.linear(torch.cat([taps.flatten(-2), final], dim=-1))  # taps (B, T, taps, D), normalised


def batch(data: Sequence[Tapped], picks: Sequence[tuple[int, int]], length: int,
          prompt_weight: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """feature_distill's batch of the final states (states at t, tokens x_{t+1}, states at t+1,
    loss weights) with the taps at t before it and the verifier's top-1 at t+1 after it."""
    final, tokens, targets, weights = training_batch([d.seq for d in data], picks, length, prompt_weight)
    span = tokens.shape[1]
    taps = torch.stack([data[i].taps[s: s + span] for i, s in picks]).float()
    truth = torch.stack([data[i].seq.top1[s + 1: s + 1 + span] for i, s in picks])
    return taps, final, tokens, targets, weights, truth


def evaluate(drafter: FeatureDrafter, fusion: Fusion, data: Sequence[Tapped], length: int) -> tuple[float, float]:
    """Top-1 agreement with the verifier at draft steps 1 and 2 on generated positions."""
    hits, totals = [0, 0], [0, 0]
    drafter.eval()
    with torch.no_grad():
        picks_all = training_windows([d.seq for d in data], length)
        for start in range(0, len(picks_all), 8):
            taps, final, tokens, _, weights, truth = batch(data, picks_all[start: start + 8], length, 0.0)
            predicted = unrolled_features(drafter, fusion(taps, final), tokens, steps=2)
            for step, states in enumerate(predicted):
                guess = drafter.draft_ids[drafter.head(states).argmax(-1)]
                counted = weights > 0
                if step == 1:
                    counted[:, 0] = False
                hits[step] += int(((guess == truth) & counted).sum())
                totals[step] += int(counted.sum())
    return hits[0] / max(totals[0], 1), hits[1] / max(totals[1], 1)


def train(model: Transformer, data: Sequence[Tapped], heldout: Sequence[Tapped], draft_ids: Tensor, fused: bool,
          args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(args.seed)
    config = ssm_config_for(model, num_layers=1, ffn_dim=model.config.ffn_dim, draft_vocab_size=args.draft_vocab)
    drafter = init_feature_drafter(model, config, draft_ids)
    fusion = Fusion(model.config.dim, len(args.taps), fused)
    for parameter in drafter.embed_tokens.parameters():
        parameter.requires_grad_(False)
    trainable = [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")] + list(fusion.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    picks_all = training_windows([d.seq for d in data], args.length)
    per_epoch = math.ceil(len(picks_all) / args.batch_size)
    total = args.epochs * per_epoch
    rng = random.Random(args.seed)
    history = []
    started = time.monotonic()
    for epoch in range(args.epochs):
        rng.shuffle(picks_all)
        drafter.train()
        for index in range(per_epoch):
            step = epoch * per_epoch + index
            for group in optimizer.param_groups:
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            taps, final, tokens, targets, weights, _ = batch(
                data, picks_all[index * args.batch_size: (index + 1) * args.batch_size], args.length, args.prompt_weight)
            loss, _ = feature_loss(drafter, fusion(taps, final), tokens, targets, weights, steps=2)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
        history.append(evaluate(drafter, fusion, heldout, args.length))
        print(f"{'fused' if fused else 'last'}: epoch {epoch + 1}/{args.epochs} held-out top-1 "
              f"{history[-1][0]:.3f} / {history[-1][1]:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    return {"features": "fused" if fused else "last", "heldout_top1": history, "train_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--states", required=True, help="a distill-features states folder (training answers)")
    parser.add_argument("--heldout", required=True,
                        help="a states folder of held-out answers, or a prompts .jsonl to answer (e.g. bench/data/mtbench.jsonl)")
    parser.add_argument("--heldout-dir", default="drafter_layers_heldout", help="where a prompts file's answers go")
    parser.add_argument("--train", type=int, default=1200, help="first N training sequences")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--format", default="q4_1", help="the verifier's format for the states")
    parser.add_argument("--taps", type=int, nargs="+", default=[2, 15], help="blocks whose outputs join the final state")
    parser.add_argument("--variants", nargs="+", choices=["last", "fused"], default=["last", "fused"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=192)
    parser.add_argument("--prompt-weight", type=float, default=0.2)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    loaded = load_model(args.model, weight_format=args.format)
    verifier = loaded.model
    data = tap(verifier, read_states(args.states, args.train), args.taps)
    heldout = tap(verifier, heldout_states(args, loaded), args.taps)
    del verifier
    tap_s = time.monotonic() - started
    positions = sum(d.seq.token_ids.numel() for d in data)
    print(f"{len(data)} training sequences ({positions} positions), {len(heldout)} held out; taps in {tap_s:.0f} s",
          flush=True)
    model = load_model(args.model, dtype=torch.float32).model  # the drafters train in float32, as distill-features
    model.requires_grad_(False)
    draft_ids = draft_vocabulary([d.seq for d in data], args.draft_vocab)
    results = [train(model, data, heldout, draft_ids, variant == "fused", args) for variant in args.variants]
    if args.json:
        print(json.dumps({"train_sequences": len(data), "train_positions": positions, "heldout_sequences": len(heldout),
                          "taps": args.taps, "format": args.format, "tap_s": tap_s, "epochs": args.epochs,
                          "results": results}))


if __name__ == "__main__":
    main()
