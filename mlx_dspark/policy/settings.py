"""One speculation setup, decided once.

:func:`build_settings` turns the DSpark arguments of the API, the command-line
flags and the ``DSPARK_*`` environment variables into one frozen
:class:`SpeculationSettings`: how many drafts a round may verify, which draft
policy decides, chain or tree, and the notes worth showing the user. It is the
only place where those defaults are applied and those values are checked;
:func:`~mlx_dspark.generation.stream_generate`, calibration and the benchmark
all start from it. An argument that was given wins over its environment
variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..errors import DSparkError
from .scheduler import ENV_VARS, SchedulerSettings

# What decides each round's draft length (see :func:`build_settings`).
SCHEDULERS = ("off", "threshold", "auto", "adaptive")
PROFILES = ("auto", "refresh")
# Drafts a round offered a copy from the context may verify under the default
# policy: past the drafter's block they are the copy's own tokens, and greedy
# small models repeat runs far longer than a block (see :mod:`~mlx_dspark.proposers.copying`).
COPY_DRAFTS = 15

# How error messages and notes name each argument (the API's names); the
# command line passes its flags instead.
ARGUMENT_NAMES = {
    "num_draft": "num_draft",
    "confidence_threshold": "confidence_threshold",
    "scheduler": "scheduler",
    "profile": "profile",
    "tree_budget": "tree_budget",
}


@dataclass(frozen=True)
class SpeculationSettings:
    """A decided speculation setup.

    ``num_draft``: drafts per round at most (0 = plain target decoding).
    ``policy``: ``off`` (always ``num_draft``), ``threshold`` (cut at the
    confidence threshold), ``auto`` (the calibrated prefix scheduler) or
    ``adaptive`` (the draft length, 0 included, with the best predicted
    tokens/s). ``tree_budget``: nodes of a drafted tree per round, 0 for a
    chain. ``profile``: ``auto`` (use the cached cost profile) or ``refresh``.
    ``scheduler``: the scheduler and memory-guard knobs, environment applied.
    ``copy_draft``: drafts at most in a round the context offers a copy
    (None: ``num_draft``); more than ``num_draft`` only for the adaptive
    policy drafting chains with no ``num_draft`` given.
    ``notes``: one-line remarks for the user; the library never prints them.
    """

    num_draft: int
    policy: str
    tree_budget: int = 0
    copy_draft: int | None = None
    profile: str = "auto"
    scheduler: SchedulerSettings = SchedulerSettings()
    notes: tuple[str, ...] = ()

    @property
    def copy_as_is(self) -> bool:
        """Whether a round whose copy covers all its drafts verifies the copy
        as it is, without running the drafter: with ``copy_draft``, whose
        (adaptive) policy never reads the drafter's rows in rounds offered a
        copy. A large copy bias (the shipped drafter's 20) drafts the same
        tokens; a small one would have let the drafter's own guesses win."""
        return self.copy_draft is not None

    @property
    def confidence_threshold(self) -> float:
        return self.scheduler.confidence_threshold

    def make_mode(self):
        """A fresh round mode for one generation: a chain, or a tree of
        ``tree_budget`` nodes (tree modes keep per-generation records)."""
        from ..decoding.modes import ChainMode, TreeMode

        return TreeMode(self.tree_budget) if self.tree_budget else ChainMode()


def _choose_policy(
    scheduler: str | None,
    num_draft_given: bool,
    profile: str,
    knobs: SchedulerSettings,
    env: Mapping[str, str],
) -> str:
    """The policy for ``scheduler=None``: adaptive when nothing else is asked;
    a threshold asks for ``threshold``, an explicit draft count for ``off``;
    ``DSPARK_SCHEDULER_ENABLED`` or ``profile="refresh"`` ask for ``auto``
    (unless the variable says false)."""
    if scheduler is not None:
        return scheduler
    threshold = knobs.confidence_threshold
    enabled_var = ENV_VARS["enabled"]
    if enabled_var not in env and profile == "auto":
        if threshold > 0:
            return "threshold"
        return "off" if num_draft_given else "adaptive"
    if enabled_var not in env or knobs.enabled:
        return "auto"
    return "threshold" if threshold > 0 else "off"


def build_settings(
    block_size: int,
    num_draft: int | None = None,
    confidence_threshold: float | None = None,
    scheduler: str | None = None,
    profile: str = "auto",
    tree_budget: int = 0,
    *,
    base: SchedulerSettings | None = None,
    env: Mapping[str, str] | None = None,
    names: Mapping[str, str] | None = None,
) -> SpeculationSettings:
    """Decide the speculation setup for a drafter of ``block_size``.

    ``num_draft=None`` means the block size; a given ``num_draft`` means
    always that many unless a scheduler is named. ``confidence_threshold=None``
    means ``DSPARK_CONFIDENCE_THRESHOLD`` or 0 (off); a given threshold wins
    over the variable. ``base`` holds scheduler knobs the caller chose; the
    ``DSPARK_*`` variables of ``env`` (``os.environ`` if None) apply over it.
    ``names`` renames arguments in messages (the command line passes its
    flags). Every invalid value raises a one-sentence :class:`DSparkError`.
    """
    env = os.environ if env is None else env
    names = {**ARGUMENT_NAMES, **(names or {})}
    if num_draft is not None and num_draft < 0:
        raise DSparkError(f"{names['num_draft']} must be at least 0, got {num_draft}.")
    if num_draft is not None and num_draft > block_size:
        raise DSparkError(
            f"{names['num_draft']} must be between 0 and the drafter's block size "
            f"{block_size}, got {num_draft}."
        )
    if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
        raise DSparkError(
            f"{names['confidence_threshold']} must be in [0, 1], "
            f"got {confidence_threshold}."
        )
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise DSparkError(
            f"{names['scheduler']} must be one of {', '.join(SCHEDULERS)}, "
            f"got {scheduler!r}."
        )
    if profile not in PROFILES:
        raise DSparkError(
            f"{names['profile']} must be auto or refresh, got {profile!r}."
        )
    if tree_budget < 0:
        raise DSparkError(f"{names['tree_budget']} must be >= 0, got {tree_budget}.")
    if scheduler == "off" and confidence_threshold:
        raise DSparkError(
            f"{names['confidence_threshold']} needs {names['scheduler']} threshold, "
            "not off."
        )

    notes = []
    threshold_var = ENV_VARS["confidence_threshold"]
    keep = ()
    if confidence_threshold is not None:
        keep = ("confidence_threshold",)
        if threshold_var in env:
            notes.append(
                f"{threshold_var} is ignored: {names['confidence_threshold']} "
                "was given."
            )
    elif scheduler in ("off", "auto", "adaptive") and threshold_var in env:
        keep = ("confidence_threshold",)
        notes.append(
            f"{threshold_var} is ignored: {names['scheduler']} {scheduler} "
            "does not cut at a threshold."
        )
    knobs = base or SchedulerSettings()
    if confidence_threshold is not None:
        knobs = replace(knobs, confidence_threshold=float(confidence_threshold))
    knobs = SchedulerSettings.from_env(env, base=knobs, keep=keep)

    policy = _choose_policy(scheduler, num_draft is not None, profile, knobs, env)
    if policy != "threshold" and knobs.confidence_threshold:
        knobs = replace(knobs, confidence_threshold=0.0)
    cap = block_size if num_draft is None else int(num_draft)
    if cap == 0:
        notes.append(
            f"{names['num_draft']} 0: every round decodes with the target alone "
            "(no drafts)."
        )
    long_copies = policy == "adaptive" and num_draft is None and not tree_budget
    return SpeculationSettings(
        num_draft=cap,
        policy=policy,
        tree_budget=int(tree_budget),
        copy_draft=max(cap, COPY_DRAFTS) if long_copies and cap else None,
        profile=profile,
        scheduler=knobs,
        notes=tuple(notes),
    )
