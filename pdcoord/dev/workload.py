"""What the open-loop load sends, and when: pure, seeded, no I/O besides reading a trace.

* :class:`Schedule`: piecewise rate multipliers (``0:60:1.0,60:120:2.5``) and the time warp that makes
  a Poisson process or a trace follow them.
* :class:`Balancer`: the sticky load balancer in front of several routers.
* Trace replay (:func:`load_trace`, :func:`derive_sessions`, :func:`trace_arrivals`) of the Mooncake
  FAST'25 conversation trace, prompts built from one deterministic block of text per hash id.
* Synthetic multi-turn sessions (:class:`SyntheticConfig`, :func:`synthetic_arrivals`).

Everything here is in *engine* seconds; the driver (:class:`pdcoord.dev.loadgen.OpenLoop`) stretches
it by its time scale. Tokens are counted as pdsim and pdmaster count them, ⌈characters / 4⌉.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CHARS_PER_TOKEN = 4
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids name blocks of 512 tokens

Messages = list[dict[str, str]]


# ---------------------------------------------------------------------------- rate schedule


class Schedule:
    """Rate multipliers over time: ``[(from_s, to_s, multiplier), ...]``; time no segment covers
    (gaps, and everything after the last segment) has multiplier 1.0.

    :meth:`warp` maps "base" time (a homogeneous Poisson process, or a trace's timestamps) to real
    time so that the instantaneous rate becomes ``base rate * multiplier``: it inverts the
    cumulative multiplier ``M(t) = ∫₀ᵗ m``. A multiplier 0 is a pause."""

    def __init__(self, segments: Sequence[tuple[float, float, float]] = ()) -> None:
        segs = sorted((float(a), float(b), float(m)) for a, b, m in segments)
        for a, b, m in segs:
            if not (0 <= a < b) or m < 0 or not math.isfinite(b):
                raise ValueError(f"bad schedule segment {a}:{b}:{m}")
        for (_, b0, _), (a1, _, _) in itertools.pairwise(segs):
            if a1 < b0:
                raise ValueError(f"schedule segments overlap at {a1}")
        self.segments = tuple(segs)
        # contiguous pieces covering [0, inf), gaps filled with 1.0, with M(start) of each
        pieces: list[tuple[float, float, float]] = []
        t = 0.0
        for a, b, m in segs:
            if a > t:
                pieces.append((t, a, 1.0))
            pieces.append((a, b, m))
            t = b
        pieces.append((t, math.inf, 1.0))
        self._pieces = pieces
        self._m_at: list[float] = []
        acc = 0.0
        for a, b, m in pieces:
            self._m_at.append(acc)
            if math.isfinite(b):
                acc += (b - a) * m

    @classmethod
    def parse(cls, text: str | None) -> Schedule:
        """``from:to:multiplier[,…]`` in seconds; empty or None is the constant 1.0."""
        if not text:
            return cls()
        segs = []
        for part in text.split(","):
            fields = part.strip().split(":")
            if len(fields) != 3:
                raise ValueError(f"schedule segment {part!r} is not from:to:multiplier")
            a, b, m = (float(f) for f in fields)
            segs.append((a, b, m))
        return cls(segs)

    def multiplier(self, t: float) -> float:
        for a, b, m in self._pieces:
            if a <= t < b:
                return m
        return 1.0

    def cumulative(self, t: float) -> float:
        """``M(t)``: base time elapsed by real time *t*."""
        for (a, b, m), acc in zip(self._pieces, self._m_at, strict=True):
            if t < b:
                return acc + (max(t, a) - a) * m
        return math.inf  # not reached: the last piece is unbounded

    def warp(self, tau: float) -> float:
        """The earliest real time by which *tau* base seconds have elapsed (inverse of cumulative)."""
        if tau <= 0:
            return 0.0
        for (a, b, m), acc in zip(self._pieces, self._m_at, strict=True):
            if m > 0 and tau <= acc + (b - a) * m:
                return a + (tau - acc) / m
        raise AssertionError("unreachable: the last piece has multiplier 1 and no end")


def poisson_times(rate: float, rng: random.Random) -> Iterator[float]:
    """Arrival times of a homogeneous Poisson process of *rate* per second, from 0."""
    if rate <= 0:
        return
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


# ---------------------------------------------------------------------------- sticky balancer


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    weight: float = 1.0


def parse_targets(urls: str, weights: str | None = None) -> list[Target]:
    """``URL[,URL…]`` and ``even`` (default) or ``w,w,…`` (one per URL, relative)."""
    us = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
    if not us:
        raise ValueError("no target URL")
    if not weights or weights == "even":
        ws = [1.0] * len(us)
    else:
        ws = [float(w) for w in weights.split(",")]
        if len(ws) != len(us) or any(w < 0 for w in ws) or sum(ws) <= 0:
            raise ValueError(f"need {len(us)} non-negative weights, not all 0: {weights!r}")
    return [Target(u, u, w) for u, w in zip(us, ws, strict=True)]


def _unit_hash(*parts: str) -> float:
    """A stable hash in (0, 1): the same in every process and run (unlike ``hash()``)."""
    h = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "big") + 0.5) / 2**64


class Balancer:
    """The load balancer in front of several routers. A request with a session goes where its
    ``X-Session-Id`` hashes to (weighted rendezvous hashing: a target gets its weight's share of the
    sessions, and every turn of a session goes to the same one, as a balancer configured for session
    affinity on that header does); one without a session goes to a weighted random target."""

    def __init__(self, targets: Sequence[Target], seed: int = 0) -> None:
        self.targets = [t for t in targets if t.weight > 0]
        if not self.targets:
            raise ValueError("no target with a positive weight")
        self._rng = random.Random(f"balancer:{seed}")
        self._weights = [t.weight for t in self.targets]

    def pick(self, session_id: str | None) -> Target:
        if session_id is None:
            return self._rng.choices(self.targets, self._weights)[0]
        return max(self.targets, key=lambda t: _score(t, session_id))

    def next_after(self, session_id: str | None, tried: Sequence[Target]) -> Target | None:
        """Where the balancer passes a request that ``tried`` refused (nginx's ``proxy_next_upstream``):
        the session's next target by the same scores; one without a session, a weighted random other."""
        rest = [t for t in self.targets if t not in tried]
        if not rest:
            return None
        if session_id is None:
            return self._rng.choices(rest, [t.weight for t in rest])[0]
        return max(rest, key=lambda t: _score(t, session_id))


def _score(t: Target, session_id: str) -> float:
    """Weighted rendezvous score w / -ln(u): the largest wins with probability w / Σw, independently
    per session."""
    return t.weight / -math.log(_unit_hash(t.name, session_id))


# ---------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=1)
def corpus() -> str:
    """1 MiB of deterministic word salad (the same in every run) that prompts are cut from."""
    rng = random.Random(20250225)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    vocab = ["".join(rng.choice(letters[: rng.randint(8, 26)]) for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]  # fmt: skip
    words: list[str] = []
    size = 0
    while size < 1 << 20:
        w = rng.choice(vocab)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[: 1 << 20]


@functools.lru_cache(maxsize=1)
def _corpus2() -> str:
    c = corpus()
    return c + c  # a slice starting anywhere in the first copy never wraps


def text(offset: int, length: int, tag: str = "") -> str:
    """*tag* followed by corpus text from *offset*, exactly *length* characters in all."""
    c = corpus()
    if length <= len(tag):
        return tag[:length]
    n = length - len(tag)
    if n > len(c):
        return tag + (c * (n // len(c) + 1))[:n]
    off = offset % len(c)
    return tag + _corpus2()[off : off + n]


def _b36_lsb_first(i: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = digits[i % 36]
    i //= 36
    while i:
        out += digits[i % 36]
        i //= 36
    return out


def block_text(hash_id: int, chars: int = TRACE_BLOCK_TOKENS * CHARS_PER_TOKEN) -> str:
    """The trace's block *hash_id* as text. It starts with the id written least significant digit
    first, so two distinct ids differ within their first few characters (ids equal mod 36 share
    the first character, mod 1296 two, …): no prefix cache sees more sharing than the trace's."""
    off = (hash_id * 2654435761) % len(corpus())
    return text(off, chars, f"{_b36_lsb_first(hash_id)}~ ")


def trace_prompt(hash_ids: Sequence[int], input_tokens: int) -> str:
    """The prompt of *input_tokens* tokens built from blocks of 512 tokens (2048 characters), one per
    hash id, the last one cut to the remaining length."""
    block_chars = TRACE_BLOCK_TOKENS * CHARS_PER_TOKEN
    total = input_tokens * CHARS_PER_TOKEN
    parts = []
    for hid in hash_ids:
        if total <= 0:
            break
        parts.append(block_text(hid, min(block_chars, total)))
        total -= block_chars
    return "".join(parts)


def tokens_of(messages: Messages) -> int:
    """Tokens of the messages' contents, ⌈characters / 4⌉ (the chat template's few are not counted)."""
    return -(-sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN)


# ---------------------------------------------------------------------------- what is sent


@dataclass
class Turn:
    """One request. Its messages are built when it is sent (a trace's prompts are ~50 KB)."""

    session_id: str | None
    turn: int  # 0 for a session's first request
    is_continuation: bool  # as the load knows it: an earlier turn of this session was sent
    n: int
    max_tokens: int
    input_tokens: int
    messages: Callable[[], Messages]
    kind: str = "synthetic"
    clipped: bool = False  # the trace's prompt was longer than max_input_tokens
    session_turns: int | None = None  # turns planned for the session; None when unknown (trace)
    # The answer the model would give (tokens), when it ends before max_tokens: sent to pdsim as
    # ``pdsim_answer_tokens`` (the answer then stops there, as at an EOS). None: max_tokens long.
    answer_tokens: int | None = None


@dataclass
class Arrival:
    """A session (or a lone request) arriving at ``at_s``: ``turns[0]`` is sent then; each later turn
    ``think_s[i-1]`` after turn ``i-1`` ended, and only if it succeeded."""

    at_s: float
    turns: list[Turn]
    think_s: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------- trace replay


@dataclass
class TraceRequest:
    timestamp_s: float  # from the start of the trace (the file has milliseconds)
    input_length: int
    output_length: int
    hash_ids: list[int]
    # set by derive_sessions: the request that started this conversation, the one this one
    # extends, and this one's turn in the conversation
    root: int = -1
    parent: int | None = None
    turn: int = 0


def load_trace(
    path: str | Path,
    start_s: float = 0.0,
    duration_s: float | None = None,
    input_range: tuple[int, int] | None = None,
) -> list[TraceRequest]:
    """The trace's requests with ``start_s <= timestamp < start_s + duration_s`` (trace seconds),
    timestamps shifted to start at 0 (the window's start), sessions derived within the window (a
    request whose earlier turn fell before the window starts a session: the server never saw it).
    ``input_range`` (LO, HI): only the requests whose input has LO to HI tokens."""
    out = []
    end = math.inf if duration_s is None else start_s + duration_s
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            ts = row["timestamp"] / 1000.0
            if ts < start_s or ts >= end or not _in_range(int(row["input_length"]), input_range):
                continue
            hids = [int(h) for h in row["hash_ids"]]
            # a prompt never has more tokens than its blocks hold (not so in this trace; be safe)
            length = min(int(row["input_length"]), len(hids) * TRACE_BLOCK_TOKENS)
            out.append(TraceRequest(ts - start_s, length, int(row["output_length"]), hids))
    out.sort(key=lambda r: r.timestamp_s)
    derive_sessions(out)
    return out


def _in_range(length: int, input_range: tuple[int, int] | None) -> bool:
    return input_range is None or input_range[0] <= length <= input_range[1]


def trace_span(path: str | Path, input_range: tuple[int, int] | None = None) -> tuple[int, float]:
    """(requests, last - first timestamp in seconds) of the whole trace: its mean rate. With
    ``input_range``: the requests of that input length, over the whole trace's span."""
    n, first, last = 0, math.inf, -math.inf
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                ts = row["timestamp"] / 1000.0
                first, last = min(first, ts), max(last, ts)
                n += _in_range(int(row["input_length"]), input_range)
    return n, (last - first) if n else 0.0


def derive_sessions(reqs: list[TraceRequest]) -> None:
    """Conversations from shared prefixes. Request R continues the earlier request P when R's
    hash_ids start with all of P's *full* blocks (P's ids, less the last when P's input ends inside
    it: that partial block's id differs from the full block R has there) and those are more than
    block 0, which every request shares. The longest such P (the latest among equals) is R's parent;
    R takes its root and turn + 1. Sets ``root``, ``parent`` and ``turn`` in place."""
    full_prefix: dict[tuple[int, ...], int] = {}  # P's full blocks -> P (the latest wins)
    for i, r in enumerate(reqs):
        h = r.hash_ids
        r.root, r.parent, r.turn = i, None, 0
        for k in range(len(h), 1, -1):
            p = full_prefix.get(tuple(h[:k]))
            if p is not None:
                r.parent, r.root, r.turn = p, reqs[p].root, reqs[p].turn + 1
                break
        full = len(h) if r.input_length % TRACE_BLOCK_TOKENS == 0 else len(h) - 1
        if full >= 2:
            full_prefix[tuple(h[:full])] = i


def trace_arrivals(
    reqs: Sequence[TraceRequest],
    *,
    speed: float = 1.0,
    schedule: Schedule | None = None,
    max_input_tokens: int = 32768,
    tag: str = "mc",
    ask_max_tokens: int | None = None,
) -> Iterator[Arrival]:
    """One arrival per request at ``warp(timestamp / speed)``; ``max_tokens`` is the output length
    (with ``ask_max_tokens``: that many, the output length becoming the answer that ends first, as
    clients that over-ask), the session id the root's (``{tag}-{root index}``), turn > 0 a
    continuation."""
    sched = schedule or Schedule()
    for r in reqs:
        clipped = r.input_length > max_input_tokens
        length = min(r.input_length, max_input_tokens)

        def messages(r: TraceRequest = r, length: int = length) -> Messages:
            return [{"role": "user", "content": trace_prompt(r.hash_ids, length)}]

        answer = max(1, r.output_length)
        max_tokens = answer if ask_max_tokens is None else ask_max_tokens
        turn = Turn(f"{tag}-{r.root}", r.turn, r.turn > 0, 1, max_tokens, length, messages, kind="trace",
                    clipped=clipped, answer_tokens=None if ask_max_tokens is None else answer)  # fmt: skip
        yield Arrival(sched.warp(r.timestamp_s / speed), [turn])


# ---------------------------------------------------------------------------- synthetic sessions


@dataclass
class SyntheticConfig:
    session_rate: float = 0.25  # sessions per second (Poisson), before the schedule
    turns: tuple[int, int] = (2, 6)  # uniform, inclusive
    system_prompts: int = 4  # shared system prefixes, one chosen at random per session
    system_tokens: int = 2048
    first_user_median_tokens: float = 1500.0  # lognormal
    first_user_sigma: float = 0.8
    first_user_max_tokens: int = 16384
    user_tokens: tuple[int, int] = (120, 1500)  # later user turns, uniform
    max_tokens: tuple[int, int] = (80, 350)  # per turn, uniform
    think_mean_s: float = 10.0  # exponential, after the previous turn ended
    gang_fraction: float = 0.1  # requests with n > 1
    gang_n: int = 4

    @property
    def mean_turns(self) -> float:
        return (self.turns[0] + self.turns[1]) / 2


def system_prompt(seed: int, i: int, tokens: int) -> str:
    off = random.Random(f"{seed}:system:{i}").randrange(len(corpus()))
    return text(off, tokens * CHARS_PER_TOKEN, f"System prompt {i} of run {seed}. ")


def synthetic_session(
    cfg: SyntheticConfig, seed: int, k: int, tag: str = "syn"
) -> tuple[list[Turn], list[float]]:
    """Session *k*: its turns and think times, from its own seeded stream (so it does not depend on
    the rate, the schedule or the other sessions). Each turn sends the whole conversation so far:
    the shared system prompt, every user message and, after each, the previous answer as the
    assistant message, of the length that turn asked for (the engines' real answers are not used,
    so prompts do not depend on the server)."""
    rng = random.Random(f"{seed}:session:{k}")
    sid = f"{tag}{seed}-{k}"
    n_turns = rng.randint(*cfg.turns)
    system = rng.randrange(cfg.system_prompts)
    first = math.exp(rng.gauss(math.log(cfg.first_user_median_tokens), cfg.first_user_sigma))
    specs: list[tuple[str, int, int, str]] = []  # role, corpus offset, characters, tag
    turns: list[Turn] = []
    thinks: list[float] = []
    prev_max = 0
    for t in range(n_turns):
        if t > 0:
            specs.append(
                ("assistant", rng.randrange(1 << 20), prev_max * CHARS_PER_TOKEN, f"[{sid} answer {t - 1}] ")
            )
            thinks.append(rng.expovariate(1 / cfg.think_mean_s) if cfg.think_mean_s > 0 else 0.0)
        user = (
            int(min(max(first, 16), cfg.first_user_max_tokens)) if t == 0 else rng.randint(*cfg.user_tokens)
        )
        specs.append(("user", rng.randrange(1 << 20), user * CHARS_PER_TOKEN, f"[{sid} turn {t}] "))
        max_tokens = rng.randint(*cfg.max_tokens)
        n = cfg.gang_n if rng.random() < cfg.gang_fraction else 1
        prev_max = max_tokens

        def messages(upto: int = len(specs), system: int = system) -> Messages:
            out = [{"role": "system", "content": system_prompt(seed, system, cfg.system_tokens)}]
            out += [{"role": role, "content": text(off, chars, tg)} for role, off, chars, tg in specs[:upto]]
            return out

        chars = cfg.system_tokens * CHARS_PER_TOKEN + sum(s[2] for s in specs)
        turns.append(Turn(sid, t, t > 0, n, max_tokens, -(-chars // CHARS_PER_TOKEN), messages,
                          session_turns=n_turns))  # fmt: skip
    return turns, thinks


def synthetic_arrivals(
    cfg: SyntheticConfig, seed: int, schedule: Schedule | None = None, tag: str = "syn"
) -> Iterator[Arrival]:
    """Sessions arriving as a Poisson process of ``session_rate`` warped by *schedule*; endless."""
    sched = schedule or Schedule()
    for k, tau in enumerate(poisson_times(cfg.session_rate, random.Random(f"{seed}:arrivals"))):
        turns, thinks = synthetic_session(cfg, seed, k, tag)
        yield Arrival(sched.warp(tau), turns, thinks)
