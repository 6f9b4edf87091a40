"""Batched speculative decoding for a server: many requests, one target forward.

Requests join the running batch as they arrive. Each step drafts a block for
every active request, Algorithm 1 (:meth:`SchedulerPolicy.draft_lengths`, one
call over the whole batch, with each request's calibrated survival and the
measured cost of batched target steps) decides how many drafts of each request
to verify, and one :meth:`TargetAdapter.forward_rows` verifies them all, in
place in the batch's shared cache (:class:`~mlx_dspark.targets.adapter.RequestBatch`).
Prompts that arrive together prefill together. Each request keeps its own
row, draft cache, sampling parameters and random streams, and accepts with
the package's own rule (:func:`~mlx_dspark.decoding.modes.settle_chain`), so its
tokens are what it would get alone: greedy identical, sampled exact.

All MLX work happens on the engine's one thread; callers talk to it through
:class:`RequestHandle` queues. This module never prints.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..decoding.loop import RoundStats, first_token
from ..decoding.modes import settle_chain
from ..decoding.verify import Randomness
from ..policy.costs import MeasuredCosts
from ..policy.memory import MemoryGuard
from ..policy.policies import SchedulerPolicy, telemetry_for
from ..policy.scheduler import SchedulerSettings, StepRateCurve
from ..policy.settings import build_settings
from ..policy.telemetry import Telemetry
from ..proposers.base import Proposal, Proposer, Round, cut_at_stop, joined
from ..proposers.copying import Drafter, context_bias, pair_proposer
from ..proposers.dspark import DSparkDrafter
from ..proposers.suffix import SUFFIX_MAX_DRAFT
from ..sampling.coupled import TokenKeys, resolve_sampling
from ..sampling.processing import SamplingParams
from ..targets.adapter import BatchRow, RequestBatch, TargetAdapter
from .prompt_cache import CachedPrompt, PromptCache, common_prefix

logger = logging.getLogger("mlx_dspark.server")


@dataclass
class GenerationRequest:
    """One request as the engine sees it: token ids and how to decode them.

    ``segments``: the token counts where the prompt's segments end (the end
    of its system prompt, of its user turns: :mod:`.segments`), where the
    engine keeps a snapshot of the request's cache for later requests.
    """

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    seed: int | None = None
    logprobs: bool = False
    segments: tuple[int, ...] = ()


@dataclass
class Event:
    """Tokens committed for a request; the last event has ``finish_reason``.

    ``finish_reason`` is "stop" (end of sequence), "length", "cancelled" or
    "error" (then ``error`` says why).
    """

    tokens: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None


class RequestHandle:
    """The caller's side of a request: its events and a way to cancel it."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.events: queue.Queue[Event] = queue.Queue()
        self._cancelled = threading.Event()
        self.cancel_reason = "cancelled"

    def cancel(self, reason: str = "cancelled") -> None:
        """Leave the batch at the next step; the engine frees the caches.

        ``reason`` "stop" (the caller found a stop string) counts the request
        as finished, anything else as cancelled."""
        if not self._cancelled.is_set():
            self.cancel_reason = reason
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class _Slot:
    """A running request's state between steps."""

    handle: RequestHandle
    cache: list | BatchRow  # its own until it joins the batch
    draft_cache: object
    unseen: list  # target features the drafter has not ingested yet
    anchor: int
    start: int  # position of the anchor
    rng: Randomness  # the request's sampled verdicts draw with it
    key: mx.array
    prefilled: int = 0  # prompt tokens in the cache so far
    cached: int = 0  # of them, reused from the prompt cache
    # Prompt lengths where its prefill stops to keep a snapshot of the cache.
    marks: set[int] = field(default_factory=set)
    waiting: bool = False  # for another prompt's prefill of a shared prefix
    produced: int = 0
    rounds: list[RoundStats] = field(default_factory=list)
    batch_sizes: int = 0  # sum over rounds of the batch each round ran in
    done: bool = False
    # The tokens in the target cache (context copying reads them) and, for
    # the prompt cache, their features.
    context: list[int] = field(default_factory=list)
    context_features: list = field(default_factory=list)
    source: str = ""  # where this step's draft came from (the offer's word)

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request


def _row(values: mx.array | None, i: int, n: int) -> mx.array | None:
    """Row ``i``'s first ``n`` drafts of a batched proposal's field."""
    return None if values is None else values[i : i + 1, :n]


@dataclass
class EngineStats:
    """Totals since the engine started (read by ``/metrics`` and tests)."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    target_forwards: int = 0
    request_rounds: int = 0  # sum of batch sizes over target forwards
    max_batch: int = 0
    prefill_forwards: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # of them, reused from the prompt cache
    generated_tokens: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0
    active: int = 0
    waiting: int = 0
    # Suffix drafts (a SuffixProposer): request rounds that verified one and
    # the draft tokens they kept; of them, drafts from the global store
    # (other requests' output); the store's size after the last step.
    suffix_rounds: int = 0
    suffix_accepted: int = 0
    suffix_global_rounds: int = 0
    suffix_global_accepted: int = 0
    suffix_store_tokens: int = 0
    suffix_store_documents: int = 0

    @property
    def mean_batch(self) -> float:
        return (
            self.request_rounds / self.target_forwards if self.target_forwards else 0.0
        )


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least
    squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [v for v, _, n in blocks for _ in range(n)]


class StepCost:
    """Measured cost of a batched step, as the curve Algorithm 1 reads.

    Target forwards are timed by their total query tokens (exponential moving
    average per size); sizes not measured yet come from ``prior`` (a cached
    profile) scaled to the measurements, and without a prior the measured
    points alone (held flat beyond them, so larger batches get tried and
    measured). A larger forward never costs less, so the curve is the closest
    non-decreasing one (weighted by how often each size was measured): noise
    must not make extra drafts look free. ``draft_seconds`` is the measured
    drafting time of a step.

    Steps of one request are what the cached profile measured (one request's
    forward over its query tokens, one drafting pass): their recent times are
    kept apart for :meth:`take_measured`, which the engine merges into the
    profile (:func:`~mlx_dspark.policy.profile.save_measured`).
    """

    def __init__(
        self, prior: StepRateCurve | None = None, alpha: float = 0.3, window: int = 5
    ):
        self.prior = prior
        self.alpha = alpha
        self.seconds: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.draft_seconds = 0.0 if prior is None else prior.draft_seconds
        self.alone: dict[int | str, deque] = {}  # one request: recent seconds
        self.unsaved: dict[int | str, int] = {}  # steps since take_measured
        self.window = window

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def _alone(self, what: int | str, seconds: float) -> None:
        self.alone.setdefault(what, deque(maxlen=self.window)).append(seconds)
        self.unsaved[what] = self.unsaved.get(what, 0) + 1

    def record_verify(self, tokens: int, seconds: float, requests: int = 1) -> None:
        self.seconds[tokens] = self._average(self.seconds.get(tokens), seconds)
        self.counts[tokens] = self.counts.get(tokens, 0) + 1
        if requests == 1:
            self._alone(tokens, seconds)

    def record_draft(self, seconds: float, requests: int = 1) -> None:
        self.draft_seconds = self._average(self.draft_seconds or None, seconds)
        if requests == 1:
            self._alone("draft", seconds)

    def take_measured(self) -> MeasuredCosts:
        """The steps of one request measured since the last call (the median
        of each size's recent times, and how many), and start counting again."""
        measured = MeasuredCosts()
        for what, steps in self.unsaved.items():
            value = (float(np.median(self.alone[what])), steps)
            if what == "draft":
                measured.draft = value
            else:
                measured.verify[int(what)] = value
        self.unsaved = {}
        return measured

    def curve(self) -> StepRateCurve:
        points = dict(self.seconds)
        weights = {b: float(min(n, 1 / self.alpha)) for b, n in self.counts.items()}
        if self.prior is not None:
            sizes = self.prior.batch_sizes
            common = [b for b in sizes if b in points]
            scale = 1.0
            if common:
                scale = float(
                    np.median([points[b] * self.prior.sps(b) for b in common])
                )
            for b in sizes:
                if b not in points:
                    points[b], weights[b] = scale / self.prior.sps(b), 1.0
        if not points:
            return StepRateCurve.linear(1.0, 0.05, draft_seconds=self.draft_seconds)
        sizes = sorted(points)
        seconds = monotone([points[b] for b in sizes], [weights[b] for b in sizes])
        return StepRateCurve.from_measurements(
            dict(zip(sizes, seconds, strict=True)), self.draft_seconds
        )


@dataclass
class DraftGate:
    """Whether a step drafts at all: whichever of drafting and plain steps
    was measured faster for this many requests.

    For each number of requests it keeps moving averages of the tokens a step
    committed and the seconds it took, whole (draft, verify, settle), apart
    for drafting and for plain steps, and drafts when drafting commits more
    tokens per second. Measured rather than modelled: a batched forward's
    cost depends on more than its token count (padding to the longest chain,
    re-aligning rows that kept different numbers of tokens), and drafting for
    two requests costs more than for one. A size not measured both ways yet
    follows the nearest size that was (requests come and go, and each new
    size explored blindly costs a slow step); before any size was, the gate
    drafts once and then steps plain once.

    After ``wait`` steps in a row one way, one step goes the other way (a
    probe), so that neither estimate goes stale: one unlucky measurement must
    not lock the gate into the slower mode. A probe slower than the steps it
    interrupted doubles the wait (up to ``probe_max``), a faster one resets it
    to ``probe_every``, so a settled choice costs few probes. Decided before
    drafting, from past steps only, so it never biases what is committed.
    """

    probe_every: int = 16
    probe_max: int = 256
    alpha: float = 0.2
    measured: dict[tuple[int, bool], tuple[float, float]] = field(
        default_factory=dict
    )  # (requests, drafted) -> averaged (tokens, seconds)
    drafting: bool | None = None  # the way of the current run of steps
    streak: int = 0  # steps in a row that way
    probing: bool = False  # the step being decided is a probe
    wait: int = field(init=False)  # steps in a row before the next probe

    def __post_init__(self):
        self.wait = self.probe_every

    def rate(self, requests: int, drafted: bool) -> float | None:
        """Measured tokens per second, None before the first such step."""
        found = self.measured.get((requests, drafted))
        return None if found is None else found[0] / max(found[1], 1e-9)

    def drafting_wins(self, requests: int) -> bool | None:
        """Whether drafting was measured faster for this many requests (or
        the nearest size measured both ways); None before any was."""
        both = [
            r for r, drafted in self.measured if drafted and (r, False) in self.measured
        ]
        if not both:
            return None
        nearest = min(both, key=lambda r: (abs(r - requests), r))
        return self.rate(nearest, True) > self.rate(nearest, False)

    def speedup(self, requests: int) -> float | None:
        """Drafting steps' measured tokens per second over plain steps', for
        this many requests (or the nearest size measured both ways); None
        before any size was measured both ways."""
        both = [
            r for r, drafted in self.measured if drafted and (r, False) in self.measured
        ]
        if not both:
            return None
        nearest = min(both, key=lambda r: (abs(r - requests), r))
        return self.rate(nearest, True) / max(self.rate(nearest, False), 1e-9)

    def should_draft(self, requests: int) -> bool:
        wins = self.drafting_wins(requests)
        if wins is None:
            return self.rate(requests, True) is None
        self.probing = self.drafting is not None and self.streak >= self.wait
        return not self.drafting if self.probing else wins

    def record(self, requests: int, tokens: int, seconds: float, drafted: bool) -> None:
        if self.probing:
            usual = self.rate(requests, not drafted)
            won = usual is None or tokens / max(seconds, 1e-9) > usual
            self.wait = self.probe_every if won else min(2 * self.wait, self.probe_max)
            self.probing, self.streak = False, 0
        elif drafted == self.drafting:
            self.streak += 1
        else:
            self.drafting, self.streak = drafted, 1
        key = (requests, drafted)
        old = self.measured.get(key)
        if old is None:
            self.measured[key] = (float(tokens), seconds)
        else:
            a = self.alpha
            self.measured[key] = (
                old[0] + a * (tokens - old[0]),
                old[1] + a * (seconds - old[1]),
            )


@dataclass
class EngineConfig:
    """``num_draft``: drafts per request per step at most (None: the drafter's
    block size; 0: plain batched decoding, no drafter). ``max_batch``: requests
    decoded together; more wait. ``settings``: scheduler and memory-guard knobs
    (DSPARK_* variables override them); no floor on verified drafts by
    default (``n_draft_min=0``), so Algorithm 1 alone decides, and critical
    memory pressure drops to plain decoding. ``adaptive``: skip drafting
    in steps where it does not pay (:class:`DraftGate`). ``prompt_cache_size``
    / ``prompt_cache_bytes``: the :class:`PromptCache` (0: none).
    ``share_min_tokens``: a prompt that shares at least this many more
    tokens with one being prefilled than the cache gives waits for that
    prefill's snapshot of them rather than computing them again.
    ``sampling``: the sampled requests' rule, ``"coupled"`` or
    ``"residual"`` (:mod:`~mlx_dspark.sampling.coupled`); None: coupled for a request
    with a seed (its tokens are then ``mlx_lm.generate``'s with that seed),
    else :data:`~mlx_dspark.sampling.coupled.UNSEEDED_SAMPLING`.
    ``prior``: the cached cost profile the engine starts from (None: none);
    what the engine measures is merged back into it when a request finishes,
    at most once every ``save_costs_every`` seconds
    (:func:`~mlx_dspark.policy.profile.save_measured`)."""

    num_draft: int | None = None
    max_batch: int = 8
    prefill_step_size: int = 512
    settings: SchedulerSettings = field(
        default_factory=lambda: SchedulerSettings(n_draft_min=0)
    )
    adaptive: bool = True
    prior: StepRateCurve | None = None
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    share_min_tokens: int = 32
    sampling: str | None = None
    save_costs_every: float = 30.0


def _empty_proposal() -> Proposal:
    return Proposal(mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, 1)), mx.zeros((1, 0)))


def _token_logprobs(logits: mx.array, tokens: list[int]) -> list[float]:
    """Log-probabilities of ``tokens`` under the rows ``logits [n, V]`` (raw
    model distribution, as mlx-lm reports)."""
    logits = logits.astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)
    return [float(x) for x in np.array(picked).ravel()]


def prefill_groups(chunks: list[tuple[_Slot, int]]) -> list[list[tuple[_Slot, int]]]:
    """Prompt chunks ``(slot, length)`` grouped for batched forwards.

    A batched forward pads every chunk to its group's longest, so a group
    only takes a chunk while its padded size stays within 1.5 times its real
    tokens: similar lengths share a forward, a short prompt never pays for a
    long one's chunk. (On the 2-core CPU, 8 prompts of 50 tokens prefill
    about a fifth faster together than one by one.)
    """
    groups: list[list[tuple[_Slot, int]]] = []
    real = 0
    for chunk in sorted(chunks, key=lambda c: -c[1]):
        group = groups[-1] if groups else None
        if group and 2 * (len(group) + 1) * group[0][1] <= 3 * (real + chunk[1]):
            group.append(chunk)
            real += chunk[1]
        else:
            groups.append([chunk])
            real = chunk[1]
    return groups


class BatchEngine:
    """Continuous batching of DSpark speculative decoding on one thread.

    ``submit`` queues a request and returns its handle; the engine thread
    (``start``) admits waiting requests between steps, prefills them, and
    runs batched draft / schedule / verify steps until every request is done.

    ``proposer``, when given, proposes each request's chains alone through
    :class:`~mlx_dspark.proposers.base.Proposer` (one state per request) instead
    of the drafter's batched backbone; ``drafter`` still names the pair
    (its target layers, block and calibration). An EAGLE-3 ``drafter``
    always goes through its pair's proposer.

    ``drafter=None`` with a ``proposer`` that offers its drafts (a
    :class:`~mlx_dspark.proposers.suffix.SuffixProposer`): drafts with no
    drafter; each request's offered draft is verified as it is (up to the
    step's cap), the proposer is kept up to date with every committed token
    (also in steps that do not draft) and its ``close`` is called when a
    request ends. All its calls are made on the engine thread.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        drafter: Drafter | None,
        config: EngineConfig | None = None,
        memory_source=None,
        proposer: Proposer | None = None,
    ):
        from ..policy.calibrate import find_calibration

        self.model = model
        self.drafter = drafter
        # None: the drafter's own proposals, its backbone batched over the
        # requests (with its pair's context copying). Only a DSpark
        # drafter batches: an EAGLE-3 one proposes for each request alone.
        if drafter is None and getattr(proposer, "offer", None) is None:
            raise ValueError("an engine with no drafter needs a proposer that offers")
        if proposer is None and not isinstance(drafter, DSparkDrafter):
            proposer = pair_proposer(drafter)
        self.proposer = proposer
        self.offers = drafter is None
        self.config = config or EngineConfig()
        if drafter is None:
            self.target = TargetAdapter(model)  # no feature taps
        else:
            self.target = TargetAdapter(model, drafter.config.target_layer_ids)
        # Sliding-window and recurrent caches stay per request (forward_batch).
        self.batch = RequestBatch() if self.target.plain_kv else None
        # Gemma-4 drafters run their own RoPE; they draft one request at a time.
        self.batch_drafts = drafter is None or not drafter.config.is_gemma4
        self.eos = set(int(t) for t in getattr(tokenizer, "eos_token_ids", ()))
        block_size = SUFFIX_MAX_DRAFT if drafter is None else drafter.block_size
        speculation = build_settings(
            block_size,
            self.config.num_draft,
            scheduler="auto",
            base=self.config.settings,
        )
        settings = speculation.scheduler
        self.n_max = settings.n_max(speculation.num_draft)
        found = None if drafter is None else find_calibration(model, drafter)
        guard = None
        if self.n_max > 0:
            guard = MemoryGuard.from_settings(settings, self.n_max, memory_source)
        self.cost = StepCost(self.config.prior)
        self._costs_saved_at: float | None = None
        self.gate = DraftGate() if self.config.adaptive else None
        self.policy = SchedulerPolicy(
            None if found is None else found[0],
            telemetry_for(found),
            curve=self.cost.curve(),
            settings=settings,
            guard=guard,
        )
        self.policy.telemetry.policy = "auto" if self.n_max else "off"
        if found is not None:
            self.policy.telemetry.calibration = str(found[1])
        self.prompt_cache = None
        if self.config.prompt_cache_size > 0:
            self.prompt_cache = PromptCache(
                self.config.prompt_cache_size, self.config.prompt_cache_bytes
            )
        self.stats = EngineStats()
        self._waiting: deque[RequestHandle] = deque()
        self._active: list[_Slot] = []
        self._prefilling: list[_Slot] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- caller side -------------------------------------------------------

    @property
    def telemetry(self) -> Telemetry:
        return self.policy.telemetry

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> BatchEngine:
        self._thread = threading.Thread(
            target=self._run, name="dspark-engine", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        handle = RequestHandle(request)
        with self._lock:
            self._waiting.append(handle)
            self.stats.requests += 1
            self.stats.waiting = len(self._waiting)
            self._wake.notify_all()
        return handle

    # -- engine thread -----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (
                    self._stopping or self._waiting or self._active or self._prefilling
                ):
                    self._wake.wait(timeout=0.5)
                if self._stopping:
                    break
                busy = len(self._active) + len(self._prefilling)
                room = max(0, self.config.max_batch - busy)
                joining = [
                    self._waiting.popleft() for _ in range(room) if self._waiting
                ]
                self.stats.waiting = len(self._waiting)
            try:
                self._iteration(joining)
            except Exception as error:  # never take the server down
                logger.exception("batched step failed")
                for slot in [*self._active, *self._prefilling]:
                    self._finish(slot, "error", f"generation failed: {error}")
            self.stats.active = len(self._active)
        for slot in [*self._active, *self._prefilling]:
            self._finish(slot, "cancelled")
        with self._lock:
            while self._waiting:
                self._waiting.popleft().events.put(Event([], finish_reason="cancelled"))
        # MLX gives each thread its own streams; a thread that leaves them
        # running aborts the process at exit.
        mx.synchronize()
        clear = getattr(mx, "clear_streams", None)
        if clear is not None:
            clear()

    def _iteration(self, joining: list[RequestHandle]) -> None:
        for handle in joining:
            self._admit(handle)
        self._drop_cancelled()
        self._prefill()
        if self._active:
            self._step()

    def _admit(self, handle: RequestHandle) -> None:
        if handle.cancelled:
            self.stats.cancelled += 1
            handle.events.put(Event([], finish_reason="cancelled"))
            return
        request = handle.request
        sampling = resolve_sampling(self.config.sampling, request.seed)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        rng: Randomness = np.random.default_rng(seed)
        if sampling == "coupled" and not request.params.greedy:
            rng = TokenKeys.from_seed(seed, request.params)
        try:
            slot = _Slot(
                handle=handle,
                cache=self.target.make_cache(),
                draft_cache=self._new_draft_state(),
                unseen=[],
                anchor=-1,
                start=0,
                rng=rng,
                key=mx.random.key(seed),
            )
            self._reuse_prompt(slot)
        except Exception as error:
            logger.exception("admission failed")
            self.stats.failed += 1
            handle.events.put(
                Event([], finish_reason="error", error=f"admission failed: {error}")
            )
            return
        self._prefilling.append(slot)

    def _reuse_prompt(self, slot: _Slot) -> None:
        """Start from the cached prompt giving the most leading tokens.

        A target whose cached prompts cannot be cut back (sliding-window or
        recurrent layers) keeps snapshots where this prompt's segments end
        and where it leaves the cached prompt it shares most with (the next
        prompt that shares as much reuses it)."""
        if self.prompt_cache is None:
            return
        prompt = slot.request.prompt
        reuse, entry, shared = self.prompt_cache.lookup(prompt)
        if not self.target.plain_kv:
            marks = list(slot.request.segments)
            if shared - reuse >= self.config.share_min_tokens:
                marks.append(shared)
            slot.marks.update(n for n in marks if reuse < n < len(prompt))
        if entry is None or reuse <= slot.prefilled:
            return
        self.prompt_cache.fetch(prompt)  # the most recently used now
        slot.cache = self.target.restore(entry.state, reuse)
        slot.unseen = [] if entry.features is None else [entry.features[:, :reuse]]
        self.stats.prompt_tokens_cached += reuse - slot.cached
        slot.prefilled = slot.cached = reuse

    def _leader(self, slot: _Slot, ahead: list[_Slot]) -> _Slot | None:
        """A prompt being prefilled ahead of ``slot`` that shares at least
        ``share_min_tokens`` more of its tokens than the cache gave it, and
        has not prefilled them yet: ``slot`` waits for its snapshot there."""
        if self.prompt_cache is None or slot.prefilled != slot.cached:
            return None
        prompt = slot.request.prompt
        for other in ahead:
            shared = common_prefix(tuple(other.request.prompt), prompt)
            shared = min(shared, len(prompt) - 1)
            if (
                shared - slot.prefilled >= self.config.share_min_tokens
                and other.prefilled < shared
            ):
                other.marks.add(shared)
                return other
        return None

    def _keep(self, cache, tokens: list[int], features: list) -> mx.array | None:
        """Put a snapshot of ``cache`` (holding ``tokens``) and its features
        into the prompt cache; the features, joined."""
        state = self.target.snapshot(cache)
        # No feature taps (no drafter): the features are None.
        features = [f for f in features if f is not None]
        joined_features = mx.concatenate(features, axis=1) if features else None
        if joined_features is not None:
            mx.eval(joined_features)
        self.prompt_cache.insert(CachedPrompt(tuple(tokens), state, joined_features))
        return joined_features

    def _remember(self, slot: _Slot) -> None:
        """Keep the request's target cache so far, with its tokens and
        features: after its prefill (before it joins the batch), and when it
        finishes, so that a chat's next turn reuses the answer as well."""
        features = self._keep(slot.cache, slot.context, slot.context_features)
        if features is not None:
            slot.context_features = [features]

    def _prefill(self) -> None:
        """About one prefill chunk of prompt tokens between decode steps.

        A long prompt delays the running requests a chunk at a time, not by
        its whole prefill. Chunks of similar length share a target forward
        (:func:`prefill_groups`): prompts that join together prefill
        together, as ``mlx_lm.server`` batches them. A prompt that shares a
        long prefix with one ahead of it waits for that one's snapshot of it
        (:meth:`_leader`); a chunk ends where a snapshot is to be kept.
        """
        ahead = []
        for slot in self._prefilling:
            if slot.waiting:  # the snapshot it waited for may be there now
                self._reuse_prompt(slot)
            slot.waiting = self._leader(slot, ahead) is not None
            if not slot.waiting:
                ahead.append(slot)
        step = self.config.prefill_step_size
        budget, chunks = step, []
        for slot in ahead:
            if budget <= 0:
                break
            end = min(
                (m for m in slot.marks if m > slot.prefilled),
                default=len(slot.request.prompt),
            )
            n = min(step, end - slot.prefilled)
            chunks.append((slot, n))
            budget -= n
        # Sliding-window and recurrent layers prefill one request at a time.
        together = self.target.plain_kv
        for group in prefill_groups(chunks) if together else [[c] for c in chunks]:
            self._prefill_group(group)

    def _prefill_group(self, group: list[tuple[_Slot, int]]) -> None:
        """The next chunk of each request's prompt, in one target forward, as
        :func:`~mlx_dspark.decoding.loop.prefill` runs it; after its last chunk a
        request joins the batch."""
        slots = [slot for slot, _ in group]
        try:
            tokens = [
                slot.request.prompt[slot.prefilled : slot.prefilled + n]
                for slot, n in group
            ]
            if len(group) == 1:
                hidden, features = self.target.hidden(mx.array(tokens), slots[0].cache)
                outputs = [(self.target.lm_head(hidden[:, -1:]), features)]
            else:
                outputs = self.target.forward_batch(
                    tokens, [slot.cache for slot in slots], last_only=True
                )
            mx.eval(outputs)
            self.stats.prefill_forwards += 1
        except Exception as error:
            logger.exception("prefill failed")
            for slot in slots:
                self._finish(slot, "error", f"prefill failed: {error}")
            return
        for (slot, n), (logits, features) in zip(group, outputs, strict=True):
            slot.unseen.append(features)
            slot.prefilled += n
            prompt = slot.request.prompt
            if slot.prefilled == len(prompt):
                self._start(slot, logits[0, -1])
            elif slot.prefilled in slot.marks and self.prompt_cache is not None:
                kept = self._keep(slot.cache, prompt[: slot.prefilled], slot.unseen)
                if kept is not None:
                    slot.unseen = [kept]

    def _start(self, slot: _Slot, logits: mx.array) -> None:
        """A prefilled request's first token; it joins the batch."""
        request = slot.request
        try:
            anchor = first_token(logits, request.params, slot.rng)
            logprobs = None
            if request.logprobs:
                logprobs = _token_logprobs(logits[None], [anchor])
        except Exception as error:
            logger.exception("prefill failed")
            self._finish(slot, "error", f"prefill failed: {error}")
            return
        self._prefilling.remove(slot)
        slot.anchor, slot.start = anchor, len(request.prompt)
        self.stats.prompt_tokens += len(request.prompt)
        slot.context = list(request.prompt)
        if self.prompt_cache is not None:
            slot.context_features = list(slot.unseen)
            self._remember(slot)
        if self.batch is not None:
            slot.cache = self.batch.join(slot.cache)
        self._active.append(slot)
        self._emit(slot, [anchor], logprobs)

    def _drop_cancelled(self) -> None:
        for slot in [*self._active, *self._prefilling]:
            if slot.handle.cancelled:
                self._finish(slot, slot.handle.cancel_reason)

    def _cap(self, slot: _Slot, cap: int) -> int:
        return max(0, min(cap, slot.request.max_tokens - slot.produced - 1))

    def _step(self) -> None:
        slots = list(self._active)
        tic = time.perf_counter()
        cap = self.policy.round_cap(self.n_max) if self.n_max else 0
        caps = [self._cap(s, cap) for s in slots]
        gate = self.gate
        if any(caps) and gate is not None and not gate.should_draft(len(slots)):
            caps = [0] * len(slots)
        proposals = self._draft(slots, caps)
        # What each request has to verify (an offered draft may be shorter).
        caps = [
            min(c, int(p.tokens.shape[1])) for c, p in zip(caps, proposals, strict=True)
        ]
        lazy = []
        for slot, proposal in zip(slots, proposals, strict=True):
            lazy += [proposal.tokens, proposal.confidence]
            if not slot.request.params.greedy:
                lazy.append(proposal.logits)
        mx.eval([a for a in lazy if a is not None])
        drafted = time.perf_counter()
        if any(caps):
            self.cost.record_draft(drafted - tic, sum(c > 0 for c in caps))
            self.policy.curve = self.cost.curve()
        lengths = self.policy.draft_lengths(proposals, caps)
        if self.config.adaptive and self.eos:
            # Never verify drafts past a drafted end of sequence.
            lengths = [
                cut_at_stop(p.tokens[0, :n], self.eos) if n > 1 else n
                for p, n in zip(proposals, lengths, strict=True)
            ]
        drafts = [
            np.array(p.tokens[0, :n]).tolist() if n else []
            for p, n in zip(proposals, lengths, strict=True)
        ]
        chains = [[s.anchor, *d] for s, d in zip(slots, drafts, strict=True)]
        if self.batch is not None:
            outputs = self.target.forward_rows(chains, [s.cache for s in slots])
        elif len(slots) == 1:
            outputs = [self.target(mx.array(chains), slots[0].cache)]
        else:
            outputs = self.target.forward_batch(chains, [s.cache for s in slots])
        mx.eval([a for out in outputs for a in out if a is not None])
        verified = time.perf_counter()
        self.cost.record_verify(
            sum(len(c) for c in chains), verified - drafted, len(slots)
        )
        self.stats.target_forwards += 1
        self.stats.request_rounds += len(slots)
        self.stats.max_batch = max(self.stats.max_batch, len(slots))
        committed_now, kept = 0, []
        for slot, c, proposal, chain, (logits, features) in zip(
            slots, caps, proposals, drafts, outputs, strict=True
        ):
            params = slot.request.params
            result, _, committed = settle_chain(
                self.target,
                slot.cache,
                chain,
                proposal,
                logits,
                features,
                params,
                slot.rng,
            )
            tokens = [*chain[: result.accepted], result.next_token]
            slot.context += [slot.anchor, *tokens[:-1]]
            if self.prompt_cache is not None:
                if committed is not None:
                    kept.append(mx.contiguous(committed))
                    slot.context_features.append(kept[-1])
            logprobs = None
            if slot.request.logprobs:
                logprobs = _token_logprobs(logits[0, : len(tokens)], tokens)
            # The drafter ingested everything unseen when it drafted.
            slot.unseen = [committed] if c else [*slot.unseen, committed]
            slot.start += len(tokens)
            slot.anchor = result.next_token
            round_stats = RoundStats(
                drafted=c,
                verified=len(chain),
                accepted=result.accepted,
                draft_time=drafted - tic,
                verify_time=verified - drafted,
                wall_time=verified - tic,
                copy_offered=bool(self.offers and chain),
                source=slot.source if chain else "",
            )
            slot.rounds.append(round_stats)
            slot.batch_sizes += len(slots)
            self.policy.observe(proposal, round_stats)
            self.stats.drafts_verified += len(chain)
            self.stats.drafts_accepted += result.accepted
            if self.offers and chain:
                self._count_suffix(slot.source, result.accepted)
            committed_now += len(tokens)
            self._emit(slot, tokens, logprobs)
        mx.eval(kept)  # copies: the step's whole features are not kept alive
        store = getattr(self.proposer, "store", None)
        if store is not None:
            self.stats.suffix_store_tokens = store.num_tokens
            self.stats.suffix_store_documents = store.num_documents
        if gate is not None and self.n_max:
            seconds = time.perf_counter() - tic
            gate.record(len(slots), committed_now, seconds, any(caps))

    def _draft(self, slots: list[_Slot], caps: list[int]) -> list[Proposal]:
        """A proposal per request (empty where its cap is 0), lazily.

        The backbone runs once for all drafting requests
        (:meth:`DSparkDrafter.forward_batch`), and the greedy requests' chains
        come from one batched :meth:`~DSparkDrafter.propose`; a sampled
        request proposes alone, with its own parameters and random key.
        """
        if self.proposer is not None:
            return [self._propose(s, c) for s, c in zip(slots, caps, strict=True)]
        drafter = self.drafter
        proposals = [_empty_proposal() for _ in slots]
        rows = [r for r, c in enumerate(caps) if c > 0]
        if not rows:
            return proposals
        anchors = mx.array([slots[r].anchor for r in rows])
        contexts = [joined(slots[r].unseen) for r in rows]
        if len(rows) > 1 and self.batch_drafts:
            hidden = drafter.forward_batch(
                drafter.block_tokens(anchors),
                [slots[r].start for r in rows],
                contexts,
                [slots[r].draft_cache for r in rows],
            )
        else:
            hidden = mx.concatenate(
                [
                    drafter(
                        drafter.block_tokens(anchors[j : j + 1]),
                        slots[r].start,
                        contexts[j],
                        slots[r].draft_cache,
                    )
                    for j, r in enumerate(rows)
                ]
            )
        greedy = [j for j, r in enumerate(rows) if slots[r].request.params.greedy]
        if greedy:
            index = mx.array(greedy)
            n = max(caps[rows[j]] for j in greedy)
            bias = self._copy_bias([slots[rows[j]] for j in greedy], n)
            chains = drafter.propose(
                hidden[index], anchors[index], n, SamplingParams(), None, bias=bias
            )
            for i, j in enumerate(greedy):
                c = caps[rows[j]]
                proposals[rows[j]] = Proposal(
                    _row(chains.tokens, i, c),
                    _row(chains.logits, i, c),
                    _row(chains.confidence, i, c),
                    top_logprob=_row(chains.top_logprob, i, c),
                    copied=_row(chains.copied, i, c),
                )
        for j, r in enumerate(rows):
            params = slots[r].request.params
            if params.greedy:
                continue
            if isinstance(slots[r].rng, TokenKeys):
                key = slots[r].rng.peek(caps[r])  # coupled: the tokens' keys
            else:
                slots[r].key, key = mx.random.split(slots[r].key)
            proposals[r] = drafter.propose(
                hidden[j : j + 1],
                anchors[j : j + 1],
                caps[r],
                params,
                key,
                bias=self._copy_bias([slots[r]], caps[r]),
            )
        return proposals

    def _new_draft_state(self):
        if self.proposer is None:
            return self.drafter.make_cache()
        return self.proposer.make_state()

    def _propose(self, slot: _Slot, cap: int) -> Proposal:
        """One request's chain from ``self.proposer`` (empty when ``cap`` is
        0), lazily. A proposer that offers is given the committed tokens
        every step, and its offered draft is verified (at most ``cap``)."""
        history = [*slot.context, slot.anchor]
        offer = None
        slot.source = ""
        if self.offers:
            offer = self.proposer.offer(slot.draft_cache, history, cap)[0]
            cap = min(cap, offer.longest)
            slot.source = offer.source
        if cap == 0:
            return _empty_proposal()
        params = slot.request.params
        if params.greedy:
            key = None
        elif isinstance(slot.rng, TokenKeys):
            key = slot.rng.peek(cap)  # coupled: the tokens' keys
        else:
            slot.key, key = mx.random.split(slot.key)
        round = Round(
            history, joined(slot.unseen), cap, params, key, offer,
            frozenset(self.eos), partial(self.target.attention_kv, slot.cache),
        )  # fmt: skip
        return self.proposer.propose(slot.draft_cache, round)

    def _count_suffix(self, source: str, accepted: int) -> None:
        s = self.stats
        s.suffix_rounds += 1
        s.suffix_accepted += accepted
        if source == "global":
            s.suffix_global_rounds += 1
            s.suffix_global_accepted += accepted

    def _copy_bias(self, slots: list[_Slot], n: int):
        """The bias toward each request's ``n`` tokens copied from its context
        (:func:`~mlx_dspark.proposers.copying.context_bias`), or None when the drafter
        does not copy."""
        contexts = [[*s.context, s.anchor] for s in slots]
        return context_bias(self.drafter, contexts, n)

    def _emit(self, slot: _Slot, tokens: list[int], logprobs: list[float] | None):
        """Send committed tokens, stopping at end of sequence or max_tokens."""
        out, reason = [], None
        for token in tokens:
            if token in self.eos:
                reason = "stop"
                break
            out.append(token)
            slot.produced += 1
            if slot.produced >= slot.request.max_tokens:
                reason = "length"
                break
        self.stats.generated_tokens += len(out)
        lps = None if logprobs is None else logprobs[: len(out)]
        if out:
            slot.handle.events.put(Event(out, lps))
        if reason is not None:
            self._finish(slot, reason)

    def usage(self, slot: _Slot) -> dict:
        rounds = slot.rounds
        prompt = len(slot.request.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": slot.produced,
            "total_tokens": prompt + slot.produced,
            "prompt_tokens_details": {"cached_tokens": slot.cached},
            "dspark": {
                "rounds": len(rounds),
                "drafted": sum(r.drafted for r in rounds),
                "verified_drafts": sum(r.verified for r in rounds),
                "accepted_drafts": sum(r.accepted for r in rounds),
                "mean_accepted_length": (
                    sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else 0.0
                ),
                "mean_batch_size": slot.batch_sizes / len(rounds) if rounds else 0.0,
                **(self._suffix_usage(rounds) if self.offers else {}),
            },
        }

    @staticmethod
    def _suffix_usage(rounds: list[RoundStats]) -> dict:
        """The request's rounds that verified a suffix draft, and those
        drafted from the global store (other requests' output)."""
        suffix = [r for r in rounds if r.verified]
        shared = [r for r in suffix if r.source == "global"]
        return {
            "suffix_rounds": len(suffix),
            "suffix_accepted": sum(r.accepted for r in suffix),
            "suffix_global_rounds": len(shared),
            "suffix_global_accepted": sum(r.accepted for r in shared),
        }

    def _save_costs(self) -> bool:
        """Merge what the engine measured into the cached profile it started
        from, at most once every ``save_costs_every`` seconds; whether it was
        written. A profile that is not the cache's (no ``meta["key"]``) or
        none is never written."""
        from ..policy.profile import save_measured

        prior = self.config.prior
        key = None if prior is None else prior.meta.get("key")
        now = time.monotonic()
        last = self._costs_saved_at
        if key is None or (
            last is not None and now - last < self.config.save_costs_every
        ):
            return False
        self._costs_saved_at = now
        return save_measured(key, self.cost.take_measured())

    def _finish(self, slot: _Slot, reason: str, error: str | None = None) -> None:
        if slot.done:
            return
        slot.done = True
        for group in (self._active, self._prefilling):
            if slot in group:
                group.remove(slot)
        if reason == "cancelled":
            self.stats.cancelled += 1
        elif reason == "error":
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        usage = self.usage(slot)
        if reason in ("stop", "length"):
            self._save_costs()
        if self.prompt_cache is not None and reason in ("stop", "length"):
            self._remember(slot)
        close = getattr(self.proposer, "close", None)
        if self.offers and close is not None and slot.draft_cache is not None:
            # The request's document in a shared suffix store is finished.
            close(slot.draft_cache, [*slot.context, slot.anchor])
        if isinstance(slot.cache, BatchRow):
            slot.cache.batch.leave(slot.cache)
        # Free the caches now, not when the caller drops its handle.
        slot.cache, slot.draft_cache, slot.unseen = [], None, []
        slot.context_features = []
        self.stats.active = len(self._active)
        slot.handle.events.put(
            Event([], finish_reason=reason, usage=usage, error=error)
        )
