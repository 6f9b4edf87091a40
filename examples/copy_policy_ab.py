"""Time the default policy against a variant of it, side by side with SmolLM2
alone, on the held-out prompts of ``eval_default_pair.py`` (greedy, tok/s with
prefill)::

    python examples/copy_policy_ab.py --prompts 8 --max-tokens 96 [--against blind]
    python examples/copy_policy_ab.py --against calibration --calibration FILE
    python examples/copy_policy_ab.py --against no-phrases
    python examples/copy_policy_ab.py --against phrases --phrases FILE
    python examples/copy_policy_ab.py --against drafter-copies
    python examples/copy_policy_ab.py --against line

The variants stop copied rounds at the drafter's block (7 drafts) instead of
going on with the copy's own tokens up to 15; ``blind`` is besides never told
whether a round is offered a copy (one kind of round, the calibrated cut in
every round: the policy before rounds offered a copy were sized apart);
``calibration`` is the default policy reading another calibration file;
``no-phrases`` the default policy and copies with the drafter's phrase store
set aside (the context's copies only); ``phrases`` with another phrase store;
``drafter-copies`` the default policy with the drafter run in rounds whose copy
covers their drafts too (its rows carry the copy bias) instead of verifying the
copy as it is; ``line`` the default policy pricing rounds by a line through
the drafted rounds' times instead of the pair's measured cost profile.
They run prompt by prompt in one process, alternating their order, each policy
keeping what it measured from one prompt to the next as the default policy
does.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import mlx.core as mx
from eval_default_pair import held_out_sets
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark.decoding.loop import speculative_generate_step
from mlx_dspark.policy.calibration import CalibrationResult
from mlx_dspark.policy.policies import resolve_policy
from mlx_dspark.policy.settings import build_settings
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.proposers.suffix_store import phrase_store
from mlx_dspark.targets.adapter import TargetAdapter


@dataclasses.dataclass
class Blind:
    """A policy that is never told whether a round is offered a copy."""

    inner: object

    def round_cap(self, cap, copy=False, phrases=False):
        return self.inner.round_cap(cap, copy=False, phrases=False)

    def draft_length(self, proposal, cap):
        return self.inner.draft_length(proposal, cap)

    def observe(self, proposal, round_stats):
        blind = dataclasses.replace(
            round_stats, copy_offered=False, phrases_offered=False
        )
        self.inner.observe(proposal, blind)


def pair_tokens(
    model, tokenizer, drafter, policy, prompt, max_tokens, copy_draft, as_is=True
) -> int:
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    steps = speculative_generate_step(
        mx.array(prompt),
        target,
        pair_proposer(drafter, copy_draft, as_is and copy_draft is not None),
        num_draft=drafter.block_size,
        max_tokens=max_tokens,
        policy=policy,
    )
    count = 0
    for token, _ in steps:
        count += 1
        if token in tokenizer.eos_token_ids:
            break
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument(
        "--against",
        choices=(
            "block",
            "blind",
            "calibration",
            "no-phrases",
            "phrases",
            "drafter-copies",
            "line",
        ),
        default="block",
    )
    parser.add_argument("--calibration", help="the other calibration file")
    parser.add_argument("--phrases", help="the other phrase store")
    args = parser.parse_args()
    for option in ("calibration", "phrases"):
        if (args.against == option) != (getattr(args, option) is not None):
            parser.error(f"--{option} FILE goes with --against {option}")
    model, tokenizer, drafter = mlx_dspark.load()
    settings = build_settings(drafter.block_size)
    sets = held_out_sets(tokenizer, args.prompts, args.prefix_tokens)
    other = args.against
    copy_draft = {"default": settings.copy_draft, other: None}  # None: the block
    calibration = None
    if args.calibration:
        calibration = CalibrationResult.load(args.calibration)
    if other in ("calibration", "no-phrases", "phrases", "drafter-copies", "line"):
        copy_draft[other] = settings.copy_draft
    phrases = {"default": drafter.phrase_store, "no-phrases": None}
    if args.phrases:
        phrases[other] = phrase_store(args.phrases)
    memory = {"default": None, other: None}
    alone = make_sampler(0.0)
    # warm up both paths (the default policy measures this machine once)
    warm = sets["chat"][0]
    list(mlx_lm_stream_generate(model, tokenizer, warm, max_tokens=8, sampler=alone))
    policy = resolve_policy(model, drafter, settings).policy
    pair_tokens(model, tokenizer, drafter, policy, warm, 8, settings.copy_draft)
    for name, prompts in sets.items():
        tokens = {"alone": 0, **dict.fromkeys(memory, 0)}
        seconds = dict.fromkeys(tokens, 0.0)
        for i, prompt in enumerate(prompts):
            order = list(tokens) if i % 2 else list(reversed(tokens))
            for variant in order:
                tic = time.perf_counter()
                if variant == "alone":
                    steps = mlx_lm_stream_generate(
                        model,
                        tokenizer,
                        prompt,
                        max_tokens=args.max_tokens,
                        sampler=alone,
                    )
                    count = len(list(steps))
                else:
                    drafter.policy_memory = memory[variant]
                    drafter.phrase_store = phrases.get(variant, phrases["default"])
                    policy = resolve_policy(model, drafter, settings).policy
                    memory[variant] = policy
                    if variant == "blind":
                        policy = Blind(policy)
                    elif variant == "calibration":
                        policy.calibration = calibration
                    elif variant == "line":
                        policy.profile = None
                    count = pair_tokens(
                        model,
                        tokenizer,
                        drafter,
                        policy,
                        prompt,
                        args.max_tokens,
                        copy_draft[variant],
                        as_is=variant != "drafter-copies",
                    )
                seconds[variant] += time.perf_counter() - tic
                tokens[variant] += count
        rate = {v: tokens[v] / seconds[v] for v in tokens}
        print(
            f"{name:5s}: SmolLM2 alone {rate['alone']:.1f} tok/s, default "
            f"{rate['default'] / rate['alone']:.2f}x, {other} "
            f"{rate[other] / rate['alone']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
