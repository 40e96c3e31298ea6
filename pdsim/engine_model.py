"""Model mode's engine scheduler: one continuous-batch step loop over a KV pool (pure, synchronous).

No I/O, no clock, no asyncio: the adapter (``pdsim.batch_runner``) calls :meth:`EngineModel.plan_step`,
sleeps the returned duration (engine time, unscaled: the adapter applies ``--time-scale``), then calls
:meth:`EngineModel.finish_step` and delivers its events. Everything here costs O(batch) per step.

A request holds ``seqs`` sequences (n samples of each prompt). Its KV is ``prompt_kv`` tokens (the
prompts' KV, once per sample) plus one token per sequence for each generated token but the newest
(whose KV is written by the step that feeds it back, as in the real engines).

Life of a request on a decode server:

* local (no PD): waiting → running (its prompt is prefilled inside the decode steps, in chunks of at
  most ``max_prefill_tokens`` per step, the first token coming with the last chunk) → done;
* PD (KV from a prefill server): prealloc (waits until its prompt KV can be allocated: SGLang keeps
  ``num_reserved_decode_tokens`` free per active request and room for the request's own clipped
  ``max_new_tokens`` beyond what the running requests could give back) → transfer
  (the adapter attaches to the prefill's room and moves the KV, then calls :meth:`transferred`) →
  ready → running → done.

On a prefill server a request is prefilled in chunks and finishes when its prefill completes.

The two policies follow the engines' schedulers (figures in ``shared/research/overload-eval.md`` §2):

* ``sglang``: a waiting request joins the batch only if free KV minus a reserve for the running
  requests' future tokens (remaining ``max_new_tokens`` x ``new_token_ratio``, each clipped at 4096)
  covers its input and its own remaining tokens; the ratio starts at 0.7 and decays linearly to
  0.7 x 0.14 over 600 decode steps. When a decode step cannot get one KV token per running sequence,
  running requests are *retracted* (fewest output tokens, then longest input, first) until free KV
  covers 20 more steps of the rest; they go back to the front of the waiting queue and are recomputed
  (input + generated tokens) when readmitted, and the ratio is raised (``scheduler.py`` /
  ``schedule_batch.py::retract_decode``, ``environ.py``).
* ``vllm``: admission needs only the request's own tokens; when a step cannot allocate, the newest
  running request is *preempted* by recompute and put at the front of the waiting queue, until the
  step fits (``vllm/v1/core/sched/scheduler.py``).

A request may end before ``max_new_tokens`` (``answer_tokens``, as at an EOS); no reservation
reads it: the engines know only ``max_new_tokens``.

Priority scheduling (``priority_scheduling``; SGLang ``--enable-priority-scheduling``, vLLM
``--scheduling-policy priority``): each request carries an integer ``priority``; the waiting queue is
served by priority, then arrival (SGLang sorts it so every step, ``schedule_policy.py``:
``_sort_by_priority_and_fcfs``), higher values first unless ``low_priority_first`` (SGLang's
``--schedule-low-priority-values-first``; vLLM's order). The prompt chunks of a step go first to the
prefills already under way (SGLang continues its chunked request before taking new ones), then by the
same order; a preempting vLLM takes its victim from the lowest priority, newest first. Preemption of a
running request *for* a waiting one of higher priority (SGLang's
``--priority-scheduling-preemption-threshold``) is not modelled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

Policy = Literal["sglang", "vllm"]
Role = Literal["prefill", "decode"]


class QueueFull(Exception):
    """The waiting queue is at ``max_queued_requests`` (SGLang answers 503 "The request queue is full.")."""


@dataclass(frozen=True, slots=True)
class StepCost:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float

    def duration(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + self.per_prefill_token_s * prefill_tokens + self.per_decode_seq_s * decode_seqs


@dataclass(frozen=True, slots=True)
class ModelConfig:
    role: Role
    policy: Policy
    cost: StepCost
    max_total_tokens: int  # the KV pool, in tokens
    max_running_seqs: int  # the batch cap (running_max_req_size), in sequences
    max_prefill_tokens: int = 16384  # prefill tokens computed per step (chunked prefill)
    max_queued_requests: int | None = None  # None: unbounded, as both engines by default
    # SGLang's scheduler constants (python/sglang/srt/environ.py: SGLANG_INIT_NEW_TOKEN_RATIO,
    # ..._MIN_NEW_TOKEN_RATIO_FACTOR, ..._NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION,
    # SGLANG_RETRACT_DECODE_STEPS).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    retract_decode_steps: int = 20
    # SGLang PD decode: KV tokens its preallocation keeps free for each active request's decoding
    # (SGLANG_NUM_RESERVED_DECODE_TOKENS, disaggregation/decode.py).
    num_reserved_decode_tokens: int = 512
    priority_scheduling: bool = False  # serve waiting requests by ``ModelRequest.priority``, then arrival
    low_priority_first: bool = False  # with it: lower values first (vLLM; SGLang's flag of that name)

    @property
    def prealloc_seqs(self) -> int:
        """SGLang PD decode: request slots for running + preallocated requests. Its request pool holds
        max_running_requests plus 2x that many for preallocation when the cap is at most 32
        (``model_runner.py``: ``pre_alloc_size = max_num_reqs * 2 if max_num_reqs <= 32 else 0``)."""
        cap = self.max_running_seqs
        return cap * 3 if cap <= 32 else cap


class Phase(Enum):
    NEW = "new"  # not added yet
    PREALLOC = "prealloc"  # decode PD: waiting for its prompt KV to be allocatable
    TRANSFER = "transfer"  # decode PD: KV allocated, being transferred
    READY = "ready"  # decode PD: KV arrived, waiting for a batch slot
    WAITING = "waiting"  # needs KV (and prefill work) before it can run
    RUNNING = "running"
    DONE = "done"


# Decode server: sequences whose KV is in and that run or wait for a batch slot. More of them than
# max_running_seqs means a router put more on this engine than its running_max_req_size.
_HELD = frozenset({Phase.WAITING, Phase.READY, Phase.RUNNING})


@dataclass(eq=False, slots=True)
class ModelRequest:
    rid: Hashable
    seqs: int  # sequences: n x prompts
    prompt_tokens: int  # input length (all prompts), what a recompute prefills again
    prompt_kv: int  # KV tokens the prompts hold: prompt tokens once per sample
    prefill_tokens: int  # tokens to compute before the first token (uncached; 0 once KV was transferred)
    max_new_tokens: int  # per sequence: what the client asked for, all the engine knows of the answer
    pd: bool = False  # decode server: the KV comes from a prefill server
    priority: int = 0  # the request's ``priority`` field (used with ``priority_scheduling``)
    # The answer the model would give (tokens per sequence): it ends there, as at an EOS, when shorter
    # than ``max_new_tokens``. The engine does not know it: every reservation uses ``max_new_tokens``.
    answer_tokens: int | None = None
    phase: Phase = field(default=Phase.NEW, init=False)
    generated: int = field(default=0, init=False)  # tokens per sequence so far
    computed: int = field(default=0, init=False)  # of prefill_tokens
    kv: int = field(default=0, init=False)  # KV tokens held
    queued: bool = field(default=False, init=False)  # ever waited for lack of batch room or KV
    recomputing: bool = field(default=False, init=False)
    arrival: int = field(default=0, init=False)  # order of add(): the tie-break after priority


@dataclass(slots=True)
class StepEvents:
    tokens: dict[Hashable, int] = field(default_factory=dict)  # rid → tokens per sequence generated so far
    finished: list[Hashable] = field(default_factory=list)  # all tokens generated (or prefill done), KV freed
    prefilled: list[Hashable] = field(default_factory=list)  # prefill server: the prefill completed
    allocated: list[Hashable] = field(default_factory=list)  # decode PD: KV preallocated, transfer may start
    retracted: list[Hashable] = field(default_factory=list)  # retracted or preempted: back to waiting

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished or self.prefilled or self.allocated or self.retracted)


@dataclass(slots=True)
class _PreallocBudget:
    reserved_per_seq: int
    single: int  # the largest running request's room beyond the retractable tokens
    retracted: int  # KV the retracted (waiting) requests need to come back, with their reserve
    retractable: int  # KV the running requests hold (input + output)
    active: int  # sequences charged the reserved decode tokens

    def allocatable(self, free_kv: int) -> int:
        return free_kv - max(self.reserved_per_seq * self.active, self.single) - self.retracted


@dataclass(slots=True)
class _Plan:
    chunks: list[tuple[ModelRequest, int]]
    decode: list[ModelRequest]
    duration_s: float


class EngineModel:
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.max_total_tokens <= 0 or cfg.max_running_seqs <= 0 or cfg.max_prefill_tokens <= 0:
            raise ValueError("max_total_tokens, max_running_seqs and max_prefill_tokens must be positive")
        self.cfg = cfg
        self._sglang = cfg.policy == "sglang"
        self._decode = cfg.role == "decode"
        self.kv_used = 0
        self._reqs: dict[Hashable, ModelRequest] = {}
        # Queues hold stale entries (cancelled or moved on) until they reach the head: O(1) cancel.
        self._prealloc: deque[ModelRequest] = deque()
        self._waiting: deque[ModelRequest] = deque()
        self._ready: deque[ModelRequest] = deque()
        self._running: dict[Hashable, ModelRequest] = {}  # insertion order = admission order
        self._transfer: dict[Hashable, ModelRequest] = {}
        self._fresh: list[ModelRequest] = []  # entered a queue since the last admission pass
        self._reqs_in = dict.fromkeys(Phase, 0)
        self._seqs_in = dict.fromkeys(Phase, 0)
        self.new_token_ratio = cfg.init_new_token_ratio
        self._min_ratio = cfg.init_new_token_ratio * cfg.min_new_token_ratio_factor
        self._ratio_decay = (cfg.init_new_token_ratio - self._min_ratio) / cfg.new_token_ratio_decay_steps
        self._plan: _Plan | None = None
        self._events = StepEvents()
        self._arrivals = 0
        self._by_priority = cfg.priority_scheduling
        self._sign = 1 if cfg.low_priority_first else -1  # sort key: sign x priority, ascending
        self._unsorted = False  # the waiting queue gained a request since it was last sorted
        self.steps = 0
        self.queued_total = 0
        self.max_waiting = 0
        self.max_running = 0
        self.retracted_requests = 0
        self.retracted_input_tokens = 0
        self.retracted_output_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.over_capacity_total = 0  # decode: requests that became held beyond max_running_seqs
        self.held_high_water = 0  # decode: peak of held (waiting + ready + running) sequences

    # ---- gauges ------------------------------------------------------------------------------

    @property
    def free_kv(self) -> int:
        return self.cfg.max_total_tokens - self.kv_used

    def seqs(self, phase: Phase) -> int:
        return self._seqs_in[phase]

    def requests(self, phase: Phase) -> int:
        return self._reqs_in[phase]

    @property
    def running_seqs(self) -> int:
        return self._seqs_in[Phase.RUNNING]

    @property
    def held_seqs(self) -> int:
        """Sequences a router has put on the batch: running or waiting for it with their KV in (a PD
        request in prealloc or transfer is not held yet)."""
        return self._seqs_in[Phase.WAITING] + self._seqs_in[Phase.READY] + self._seqs_in[Phase.RUNNING]

    @property
    def waiting_seqs(self) -> int:
        """SGLang's waiting queue: requests needing admission, including transferred ones."""
        return self._seqs_in[Phase.WAITING] + self._seqs_in[Phase.READY]

    @property
    def pending_seqs(self) -> int:
        """Every sequence inside the engine that is not running (waiting, prealloc, transfer)."""
        return self.waiting_seqs + self._seqs_in[Phase.PREALLOC] + self._seqs_in[Phase.TRANSFER]

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute (uncached, not yet prefilled) of the waiting and running
        requests: the prefill work queued in this engine."""
        return sum(
            r.prefill_tokens - r.computed
            for r in self._reqs.values()
            if r.phase is Phase.WAITING or r.phase is Phase.RUNNING
        )

    @property
    def pending_prealloc_tokens(self) -> int:
        """Decode PD: prompt KV tokens of the requests waiting to preallocate."""
        return sum(r.prompt_kv for r in self._reqs.values() if r.phase is Phase.PREALLOC)

    def get(self, rid: Hashable) -> ModelRequest | None:
        return self._reqs.get(rid)

    # ---- requests ----------------------------------------------------------------------------

    def fits(self, prompt_kv: int, seqs: int, max_new_tokens: int) -> bool:
        """Whether a request could ever run alone here (otherwise it would be retracted forever)."""
        if seqs > self.cfg.max_running_seqs:
            return False
        total = prompt_kv + (seqs * max_new_tokens if self._decode else 0)
        return total <= self.cfg.max_total_tokens

    def add(self, r: ModelRequest) -> None:
        """Queue a request (raises :class:`QueueFull` at ``max_queued_requests``, ValueError if it can
        never fit or its id is in use)."""
        if r.rid in self._reqs:
            raise ValueError(f"request {r.rid!r} already present")
        if not self.fits(r.prompt_kv, r.seqs, r.max_new_tokens):
            raise ValueError(f"request {r.rid!r} cannot fit this engine's batch or KV pool")
        cap = self.cfg.max_queued_requests
        if cap is not None and self._reqs_in[Phase.WAITING] + self._reqs_in[Phase.PREALLOC] >= cap:
            raise QueueFull("The request queue is full.")
        if not self._decode:
            # A fully cached prompt still computes its last token, as the engines do.
            r.prefill_tokens = max(1, r.prefill_tokens)
        self._reqs[r.rid] = r
        self._arrivals += 1
        r.arrival = self._arrivals
        if r.pd and self._decode:
            self._set_phase(r, Phase.PREALLOC)
            self._prealloc.append(r)
        else:
            self._set_phase(r, Phase.WAITING)
            self._waiting.append(r)
            self._unsorted = True
        self._fresh.append(r)

    def _order(self, r: ModelRequest) -> tuple[int, int]:
        """Priority scheduling's order: priority (by the configured sign), then arrival."""
        return self._sign * r.priority, r.arrival

    def transferred(self, rid: Hashable) -> None:
        """A preallocated PD request's KV has arrived: it may now join the batch."""
        r = self._reqs.get(rid)
        if r is None or r.phase is not Phase.TRANSFER:
            raise ValueError(f"request {rid!r} is not in transfer")
        del self._transfer[rid]
        self._set_phase(r, Phase.READY)
        self._ready.append(r)
        self._fresh.append(r)

    def cancel(self, rid: Hashable) -> bool:
        """Drop a request wherever it is and free its KV at once; False if it is unknown (or done)."""
        r = self._reqs.pop(rid, None)
        if r is None:
            return False
        self._free(r)
        self._running.pop(rid, None)
        self._transfer.pop(rid, None)
        self._set_phase(r, Phase.DONE)
        return True

    # ---- the step loop -----------------------------------------------------------------------

    def plan_step(self) -> float | None:
        """Decide the next step (admissions, retractions, KV for this step's tokens) and return its
        engine-time duration, or None when there is nothing to compute."""
        if self._plan is not None:
            raise RuntimeError("plan_step called twice without finish_step")
        if self._decode:
            self._prealloc_pass()
        displaced = self._make_decode_room() if self._decode else False
        if not displaced:
            # As both engines: a step that had to retract or preempt admits nobody.
            self._admit()
        self._mark_queued()
        # Measured after admission: what stays pending waits inside the engine (or is in transfer).
        self.max_waiting = max(self.max_waiting, self.pending_seqs)
        chunks: list[tuple[ModelRequest, int]] = []
        decode: list[ModelRequest] = []
        budget = self.cfg.max_prefill_tokens
        prefill = decode_seqs = alloc = 0
        running: Iterable[ModelRequest] = self._running.values()
        if self._by_priority:
            # Prefills under way first (a chunked request is continued), then the rest by priority.
            running = sorted(running, key=lambda r: (r.computed == 0, *self._order(r)))
        for r in running:
            rest = r.prefill_tokens - r.computed
            if rest <= 0:
                decode.append(r)
                decode_seqs += r.seqs
                if r.generated > 0:
                    r.kv += r.seqs  # the KV of the token this step feeds back
                    alloc += r.seqs
            elif budget > 0:
                take = min(rest, budget)
                chunks.append((r, take))
                budget -= take
                prefill += take
        self.kv_used += alloc
        if not chunks and not decode:
            if self._decode and self._sglang:
                self.new_token_ratio = self.cfg.init_new_token_ratio  # SGLang resets it when idle
            return None
        if decode and not displaced and self._sglang:
            self.new_token_ratio = max(self._min_ratio, self.new_token_ratio - self._ratio_decay)
        duration = self.cfg.cost.duration(prefill, decode_seqs)
        self._plan = _Plan(chunks, decode, duration)
        return duration

    def take_events(self) -> StepEvents:
        """Events produced outside a step's completion (preallocations, retractions by plan_step)."""
        events, self._events = self._events, StepEvents()
        return events

    def finish_step(self) -> StepEvents:
        """Complete the planned step: tokens, finished requests, completed prefills."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("finish_step without plan_step")
        self._plan = None
        self.steps += 1
        ev = self._events
        for r, take in plan.chunks:
            if r.phase is not Phase.RUNNING:
                continue  # cancelled during the step
            r.computed += take
            if r.recomputing:
                self.recomputed_tokens += take
            if r.computed < r.prefill_tokens:
                continue
            r.recomputing = False
            if not self._decode:
                ev.prefilled.append(r.rid)
                self._finish(r)
            else:
                self._emit(r)
        for r in plan.decode:
            if r.phase is Phase.RUNNING:
                self._emit(r)
        return self.take_events()

    # ---- internals ---------------------------------------------------------------------------

    def _set_phase(self, r: ModelRequest, phase: Phase) -> None:
        was_held = r.phase in _HELD
        if r.phase not in (Phase.NEW, Phase.DONE):
            self._reqs_in[r.phase] -= 1
            self._seqs_in[r.phase] -= r.seqs
        r.phase = phase
        if phase is not Phase.DONE:
            self._reqs_in[phase] += 1
            self._seqs_in[phase] += r.seqs
        if self._decode and phase in _HELD and not was_held:
            # The over-capacity check: counted when a request becomes held (a retraction moves a
            # held request from running back to waiting and is not a new arrival).
            held = self.held_seqs
            self.held_high_water = max(self.held_high_water, held)
            if held > self.cfg.max_running_seqs:
                self.over_capacity_total += 1

    def _alloc(self, r: ModelRequest, tokens: int) -> None:
        r.kv += tokens
        self.kv_used += tokens

    def _free(self, r: ModelRequest) -> None:
        self.kv_used -= r.kv
        r.kv = 0

    def _emit(self, r: ModelRequest) -> None:
        r.generated += 1
        self._events.tokens[r.rid] = r.generated
        end = r.max_new_tokens if r.answer_tokens is None else min(r.max_new_tokens, r.answer_tokens)
        if r.generated >= end:
            self._finish(r)

    def _finish(self, r: ModelRequest) -> None:
        self._free(r)
        del self._running[r.rid]
        del self._reqs[r.rid]
        self._set_phase(r, Phase.DONE)
        self._events.finished.append(r.rid)

    def _future(self, r: ModelRequest) -> int:
        """Tokens the request may still need (clipped, as SGLang's estimate)."""
        return r.seqs * min(max(r.max_new_tokens - r.generated, 0), self.cfg.clip_max_new_tokens)

    def _reserve(self, *groups: Iterable[ModelRequest]) -> float:
        """SGLang's KV reserve for the future tokens of already admitted requests."""
        return sum(self._future(r) for group in groups for r in group) * self.new_token_ratio

    def _prealloc_pass(self) -> None:
        q = self._prealloc
        if not q:
            return
        cap = self.cfg.prealloc_seqs
        held = self.running_seqs + self._seqs_in[Phase.TRANSFER] + self._seqs_in[Phase.READY]
        budget = self._prealloc_budget() if self._sglang else None
        while q:
            r = q[0]
            if r.phase is not Phase.PREALLOC:
                q.popleft()
                continue
            if budget is not None:
                if held + r.seqs > cap:
                    break
                # SGLang ``DecodePreallocQueue.pop_preallocated``: the prompt plus the reserved
                # decode tokens must fit what is allocatable, and so must the prompt plus its own
                # clipped max_new_tokens beyond what the running requests could give back.
                required = r.prompt_kv + self.cfg.num_reserved_decode_tokens * r.seqs
                own = r.prompt_kv + r.seqs * min(r.max_new_tokens, self.cfg.clip_max_new_tokens)
                if max(required, own - budget.retractable) > budget.allocatable(self.free_kv):
                    break
                budget.active += r.seqs
            elif self.free_kv < r.prompt_kv:
                break
            q.popleft()
            held += r.seqs
            self._alloc(r, r.prompt_kv)  # the prompt's KV only: the answer's grows step by step
            self._set_phase(r, Phase.TRANSFER)
            self._transfer[r.rid] = r
            self._events.allocated.append(r.rid)

    def _prealloc_budget(self) -> _PreallocBudget:
        """SGLang ``DecodePreallocQueue._allocatable_tokens``: free KV less the larger of the reserved
        decode tokens of every active request (running, in transfer, transferred and waiting) and
        the room the largest running request may still need beyond what retracting every running
        request frees; less what the retracted requests need to come back."""
        clip = self.cfg.clip_max_new_tokens
        running = list(self._running.values())
        retractable = sum(r.prompt_kv + r.seqs * r.generated for r in running)
        single = 0
        if running:
            single = max(r.prompt_kv // r.seqs + min(r.max_new_tokens, clip) for r in running) - retractable
        reserved = self.cfg.num_reserved_decode_tokens
        retracted = sum(
            r.prompt_kv + r.seqs * (r.generated + reserved) for r in self._waiting if r.phase is Phase.WAITING
        )
        active = (
            self.running_seqs
            + self._seqs_in[Phase.TRANSFER]
            + self._seqs_in[Phase.READY]
            + self._seqs_in[Phase.WAITING]
        )
        return _PreallocBudget(reserved, single, retracted, retractable, active)

    def _admit(self) -> None:
        cap = self.cfg.max_running_seqs
        q = self._waiting
        if self._by_priority and self._unsorted:
            live = sorted((r for r in q if r.phase is Phase.WAITING), key=self._order)
            q.clear()
            q.extend(live)
        self._unsorted = False
        reserve_on = self._sglang and self._decode
        reserve = self._reserve(self._running.values()) if reserve_on and q else 0.0
        while q:
            r = q[0]
            if r.phase is not Phase.WAITING:
                q.popleft()
                continue
            if self.running_seqs + r.seqs > cap:
                break
            need = r.prompt_kv + r.seqs * r.generated  # a recompute rebuilds the generated tokens' KV too
            if reserve_on:
                # SGLang ``PrefillAdder.add_one_req``: the input plus the clipped max_new_tokens must
                # fit the free KV less the reserve; a request admitted in this pass is then charged
                # its whole clipped max_new_tokens (``_update_prefill_budget``), a running one only
                # x new_token_ratio.
                if self.free_kv - reserve < need + self._future(r):
                    break
                reserve += self._future(r)
            elif self.free_kv < need:
                break
            q.popleft()
            self._alloc(r, need)
            self._start(r)
        q = self._ready
        while q:
            r = q[0]
            if r.phase is not Phase.READY:
                q.popleft()
                continue
            if self.running_seqs + r.seqs > cap:
                break
            q.popleft()
            self._start(r)

    def _start(self, r: ModelRequest) -> None:
        self._set_phase(r, Phase.RUNNING)
        self._running[r.rid] = r
        self.max_running = max(self.max_running, self.running_seqs)

    def _mark_queued(self) -> None:
        # Whoever is still queued after an admission pass waits for batch room or KV.
        for r in self._fresh:
            if not r.queued and r.phase in (Phase.WAITING, Phase.PREALLOC, Phase.READY):
                r.queued = True
                self.queued_total += 1
        self._fresh.clear()

    def _decode_need(self) -> int:
        return sum(
            r.seqs for r in self._running.values() if r.generated > 0 and r.computed >= r.prefill_tokens
        )

    def _make_decode_room(self) -> bool:
        """Retract (SGLang) or preempt (vLLM) until this step's decode tokens fit; True if any."""
        need = self._decode_need()
        if self.free_kv >= need:
            return False
        if self._sglang:
            order = sorted(self._running.values(), key=lambda r: (r.generated, -r.prompt_tokens))
            steps = self.cfg.retract_decode_steps
            for r in order:
                enough = self.free_kv >= need
                if enough and (self.free_kv >= steps * self.running_seqs or len(self._running) == 1):
                    break
                if r.generated > 0 and r.computed >= r.prefill_tokens:
                    need -= r.seqs
                self.retracted_requests += 1
                self.retracted_input_tokens += r.prompt_tokens
                self.retracted_output_tokens += r.seqs * r.generated
                self._displace(r)
            rest = self._running.values()
            max_new = sum(r.seqs * r.max_new_tokens for r in rest)
            decoded = sum(r.seqs * r.generated for r in rest)
            if max_new:
                self.new_token_ratio = min(1.0, (decoded + steps * self.running_seqs) / max_new)
            else:
                self.new_token_ratio = 1.0
        else:
            while self._running and self.free_kv < need:
                if self._by_priority:  # the lowest priority, then the newest
                    r = max(self._running.values(), key=self._order)
                else:
                    r = self._running[next(reversed(self._running))]
                if r.generated > 0 and r.computed >= r.prefill_tokens:
                    need -= r.seqs
                self.preemptions += 1
                self._displace(r)
        return True

    def _displace(self, r: ModelRequest) -> None:
        """Retraction / preemption by recompute: free the KV, back to the front of the waiting queue."""
        self._free(r)
        del self._running[r.rid]
        r.prefill_tokens = r.prompt_tokens + r.seqs * r.generated
        r.computed = 0
        r.recomputing = True
        self._set_phase(r, Phase.WAITING)
        self._waiting.appendleft(r)
        self._unsorted = True
        self._fresh.append(r)
        self._events.retracted.append(r.rid)
