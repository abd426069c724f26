"""The host side of continuous batching: which sequences run in the next step, and how much.

Each step (as vLLM's chunked prefill schedules it, "Efficient Memory Management for Large
Language Model Serving with PagedAttention" for the pages):
  1. admit waiting requests, first come first served, into free slots while the pool can
     hold their prompts (after mapping the pages of their longest cached prefix);
  2. every running sequence with one token left to feed decodes it;
  3. the rest of the step's token budget goes to the other running sequences, oldest first,
     as prefill chunks (at most `prefill_lanes` of them, their rows padded to one bucket
     within the budget: `_plan_chunks`);
  4. a step without prefill chunks decodes up to `decode_steps` tokens per sequence in one
     dispatch (each bounded by its max_new_tokens, its window and the pages free now; a
     sequence with more stop ids than the device checks takes one).
A sequence that needs a page when none is free or idle makes the newest running sequence
give all of its pages back (preemption); that one waits at the head of the queue and is
recomputed from its tokens when readmitted (its prompt and the tokens it had produced), so
its output does not change.

The engine runs one step ahead of what the host knows (models/serving/engine.py): `book`
counts a dispatched step's tokens as fed and appends a PLACEHOLDER for each token it will
draw, which the next step already feeds from the device; `complete` fills the placeholders
in once the host has the values, hands the tokens to their requests and applies the stop
checks (a sequence that stopped may thus run one wasted step, whose result is dropped).
A sequence is never scheduled past its max_new_tokens or its window, counting
placeholders, and gives its slot back as soon as its last token is booked. Preempting a
sequence first asks the engine to `resolve` its placeholder (the host waits for the step in
flight), so that it can be recomputed from known tokens.
A multi-step dispatch whose sequence drew a stop id on the device leaves its later
placeholders undrawn: `fill` then counts only the tokens fed before the stop as cached.
"""
from __future__ import annotations

import collections
import dataclasses
import math

from models.qwen2.allocator import OutOfPagesError, PageAllocator
from models.serving.prefix_cache import PrefixCache, page_keys
from models.serving.request import RequestHandle

PLACEHOLDER = -1  # a token drawn by a step in flight, not yet known to the host

# (sequence, index of its token in `tokens`, row of the step's output that draws it)
Booking = tuple["Sequence", int, int]


@dataclasses.dataclass(eq=False)
class Sequence:
  """A request's state: `tokens` (its prompt, then its new tokens), of which the first
  `cached` are in its pages; it holds pool row `slot` while running."""

  handle: RequestHandle
  tokens: list[int]
  slot: int | None = None
  cached: int = 0
  keys: list[bytes] = dataclasses.field(default_factory=list)  # keys of its full pages so far
  registered: int = 0  # full pages offered to the prefix cache
  sampling_row: object = None  # the engine's row of its sampling table, made once

  @property
  def pending(self) -> int:
    """Tokens still to feed; 1 for a decoding sequence (its last new token)."""
    return len(self.tokens) - self.cached

  @property
  def generated(self) -> int:
    """New tokens, placeholders included."""
    return len(self.tokens) - len(self.handle.request.prompt)

  @property
  def known(self) -> int:
    """Leading tokens whose values the host has (all but trailing placeholders)."""
    known = len(self.tokens)
    while known and self.tokens[known - 1] == PLACEHOLDER:
      known -= 1
    return known


@dataclasses.dataclass
class ScheduledStep:
  """The sequences one engine step feeds (how the model computes them is its own
  models.qwen2.StepPlan)."""

  decodes: list[Sequence]
  prefills: list[tuple[Sequence, int]]  # (sequence, tokens of its chunk)
  chunk_bucket: int  # T of the step's prefill rows (0: no prefill)
  decode_steps: list[int]  # tokens each of `decodes` decodes (1 unless no prefill runs)


class Scheduler:
  """Slots, the waiting queue, page reservation and preemption, prefix cache bookkeeping."""

  def __init__(self, allocator: PageAllocator, prefix_cache: PrefixCache | None, *, max_slots: int,
               token_budget: int, prefill_lanes: int, chunked_prefill: bool, buckets: tuple[int, ...],
               max_seq_len: int, decode_steps: int = 1, stop_ids_on_device: int = 0):
    self.allocator = allocator
    self.prefix_cache = prefix_cache
    self.page_size = allocator.page_size
    self.slots: list[Sequence | None] = [None] * max_slots
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.token_budget = token_budget
    self.prefill_lanes = prefill_lanes
    self.chunked_prefill = chunked_prefill
    self.buckets = buckets
    self.max_seq_len = max_seq_len
    self.decode_steps = decode_steps
    self.stop_ids_on_device = stop_ids_on_device
    self.stats = collections.Counter()
    self.resolve = lambda: None  # the engine's: fills in the placeholders of the step in flight

  def add(self, seq: Sequence) -> None:
    self.waiting.append(seq)

  @property
  def running(self) -> list[Sequence]:
    return sorted((s for s in self.slots if s is not None), key=lambda s: s.handle.id)

  def has_work(self) -> bool:
    return bool(self.waiting) or any(s is not None for s in self.slots)

  # ----------------------------------------------------------------------------- admission

  def _full_page_keys(self, seq: Sequence, num_pages: int) -> list[bytes]:
    if len(seq.keys) < num_pages:
      seq.keys += page_keys(seq.tokens[:num_pages * self.page_size], self.page_size,
                            seq.keys[-1] if seq.keys else b"", start=len(seq.keys))
    return seq.keys[:num_pages]

  def _admit(self) -> None:
    while self.waiting and None in self.slots:
      seq = self.waiting[0]
      hits = []
      if self.prefix_cache is not None:
        # The last token is always fed: its logits give the next token.
        hits = self.prefix_cache.lookup(self._full_page_keys(seq, (len(seq.tokens) - 1) // self.page_size))
      need = math.ceil(len(seq.tokens) / self.page_size) - len(hits)
      available = self.allocator.available_pages - sum(self.allocator.is_idle(p) for p in hits)
      if need > available:
        return  # first come first served: the head waits for pages
      self.waiting.popleft()
      seq.slot = self.slots.index(None)
      self.slots[seq.slot] = seq
      self.allocator.share(seq.slot, hits)
      seq.registered = len(hits)
      seq.cached = len(hits) * self.page_size
      seq.handle.prefix_hit_tokens += seq.cached
      self.stats["prefix_hit_tokens"] += seq.cached

  def _preempt(self, seq: Sequence) -> None:
    self.resolve()  # it will be recomputed from its tokens: all must be known
    self._register(seq)  # its computed pages stay findable: recomputing may hit them
    self.allocator.release(seq.slot)
    self.slots[seq.slot] = None
    seq.slot, seq.cached, seq.registered = None, 0, 0
    self.waiting.appendleft(seq)
    seq.handle.preemptions += 1
    self.stats["preemptions"] += 1

  def _grow(self, seq: Sequence, num_tokens: int) -> bool:
    """Pages for `num_tokens` tokens of `seq`, preempting the newest running sequences
    while the pool has none; False when `seq` itself was the one preempted."""
    while True:
      try:
        self.allocator.reserve(seq.slot, num_tokens)
        return True
      except OutOfPagesError:
        victim = self.running[-1]
        self._preempt(victim)
        if victim is seq:
          return False

  # ----------------------------------------------------------------------------- one step

  def schedule(self) -> ScheduledStep | None:
    """The next step's work (None: nothing to run)."""
    self._admit()
    # (A sequence preempted by an older one's growth in this loop has no slot any more.)
    decodes = [s for s in self.running if s.slot is not None and s.pending == 1
               and not self._exhausted(s) and self._grow(s, s.cached + 1)]
    prefills = []
    for seq, chunk in self._plan_chunks(self.token_budget - len(decodes)):
      if self._grow(seq, seq.cached + chunk):
        prefills.append((seq, chunk))
    # A sequence preempted after it was planned drops out of the step.
    decodes = [s for s in decodes if s.slot is not None]
    prefills = [(s, c) for s, c in prefills if s.slot is not None]
    if not decodes and not prefills:
      return None
    longest = max((c for _, c in prefills), default=0)
    bucket = min(b for b in self.buckets if b >= longest) if prefills else 0
    steps = [1 if prefills else self._lookahead(s) for s in decodes]
    return ScheduledStep(decodes, prefills, bucket, steps)

  def _plan_chunks(self, budget: int) -> list[tuple[Sequence, int]]:
    """The step's prefill chunks (sequence, tokens), oldest sequences first, within `budget`
    tokens. The model computes every lane of the step's [lanes, T] rows, T the bucket of the
    longest chunk, so with chunking the plan takes the bucket T whose chunks feed the most
    tokens while the rows stay within the token budget (lanes * T <= token_budget): one
    long chunk or several short ones, never a short chunk padded beside a long one."""
    candidates = [s for s in self.running if s.slot is not None and s.pending > 1][:self.prefill_lanes]
    if budget <= 0 or not candidates:
      return []
    if not self.chunked_prefill:  # whole prompts: one past the budget runs only alone
      plan = [(candidates[0], candidates[0].pending)]
      budget -= candidates[0].pending
      for seq in candidates[1:]:
        if seq.pending > budget:
          break
        plan.append((seq, seq.pending))
        budget -= seq.pending
      return plan
    best, best_key = [], None
    for bucket in self.buckets:
      plan, left = [], budget
      for seq in candidates[:self.lanes_at(bucket)]:
        chunk = min(seq.pending, bucket, left)
        if chunk <= 0:
          break
        plan.append((seq, chunk))
        left -= chunk
      key = (budget - left, -bucket * len(plan))  # most tokens, then fewest rows
      if best_key is None or key > best_key:
        best, best_key = plan, key
    return best

  def lanes_at(self, bucket: int) -> int:
    """Prefill lanes a step of chunk bucket `bucket` may run."""
    if not self.chunked_prefill:
      return self.prefill_lanes
    return min(self.prefill_lanes, max(1, self.token_budget // bucket))

  def _lookahead(self, seq: Sequence) -> int:
    """Tokens a decoding sequence may take in one multi-step dispatch (pages for the first
    are reserved): never past its max_new_tokens or window, nor into pages the pool would
    have to preempt for."""
    request = seq.handle.request
    steps = min(self.decode_steps, request.max_new_tokens - seq.generated,
                self.max_seq_len + 1 - len(seq.tokens))
    if steps <= 1 or len(request.stop_ids) > self.stop_ids_on_device:
      return 1
    try:
      self.allocator.reserve(seq.slot, seq.cached + steps)
    except OutOfPagesError:  # the pages it could take stay reserved
      steps = int(self.allocator.pages_held[seq.slot]) * self.page_size - seq.cached
    return max(1, steps)

  def _exhausted(self, seq: Sequence) -> bool:
    """Its last (maybe not yet known) token ends it: no further step for it."""
    return (seq.generated >= seq.handle.request.max_new_tokens or len(seq.tokens) > self.max_seq_len)

  def book(self, step: ScheduledStep, lanes: int, rows: int) -> list[Booking]:
    """Counts a dispatched step's tokens as fed; a row that fed its last pending token gets a
    PLACEHOLDER for the token it draws. Output rows: the `lanes` prefill rows, then one per
    slot, `rows` in all, repeated for each decode step (row j * rows + r: step j's row r).
    -> the step's bookings, for `complete`."""
    self.stats["steps"] += 1
    bookings = []
    for lane, (seq, chunk) in enumerate(step.prefills):
      seq.cached += chunk
      seq.handle.computed_tokens += chunk
      self.stats["prefill_tokens"] += chunk
      if seq.pending == 0:
        seq.tokens.append(PLACEHOLDER)
        bookings.append((seq, len(seq.tokens) - 1, lane))
    for seq, steps in zip(step.decodes, step.decode_steps):
      for j in range(steps):
        seq.cached += 1
        seq.handle.computed_tokens += 1
        self.stats["decode_tokens"] += 1
        seq.tokens.append(PLACEHOLDER)
        bookings.append((seq, len(seq.tokens) - 1, j * rows + lanes + seq.slot))
    for seq in {id(s): s for s, _, _ in bookings}.values():
      if self._exhausted(seq):
        self._vacate(seq)
    return bookings

  def _vacate(self, seq: Sequence) -> None:
    """Frees the slot and pages of a sequence whose last token is in flight (its length or
    window reached): the next step may admit a request there, a dispatch before the host
    learns the token. Steps run in order on the device, so the step in flight writes these
    pages before a later one reuses them; the pages holding its unknown tokens are not
    offered to the prefix cache."""
    self._register(seq)
    self.allocator.release(seq.slot)
    self.slots[seq.slot] = None
    seq.slot = None

  @staticmethod
  def fill(bookings: list[Booking], values) -> None:
    """Writes a step's drawn tokens (values, host ints, indexed by booking row) over their
    placeholders. A PLACEHOLDER value was not drawn (the sequence stopped on the device at
    the token before): only the tokens before that stop token were fed."""
    for seq, index, row in bookings:
      if seq.tokens[index] == PLACEHOLDER:
        token = seq.tokens[index] = int(values[row])
        if token == PLACEHOLDER:
          seq.cached = min(seq.cached, index - 1)

  def complete(self, bookings: list[Booking], values, now: float) -> None:
    """Books a step's drawn tokens once the host has them: each goes to its request, then
    the stop checks; finished requests give their slots back."""
    self.fill(bookings, values)
    for seq, index, _ in bookings:
      if not seq.handle.done:  # else it stopped a step earlier: this token is dropped
        self._emit(seq, index, now)
    for seq in self.running:
      self._register(seq)

  def _emit(self, seq: Sequence, index: int, now: float) -> None:
    token = seq.tokens[index]
    seq.handle._push(token, now)
    request = seq.handle.request
    if token in request.stop_ids:
      self.finish(seq, "stop")
    elif index + 1 - len(request.prompt) >= request.max_new_tokens:
      self.finish(seq, "length")
    elif index + 1 > self.max_seq_len:
      self.finish(seq, "window")  # its next token would have no place in the cache

  def finish(self, seq: Sequence, reason: str) -> None:
    seq.handle.finish_reason = reason
    if seq.slot is None and seq in self.waiting:  # preempted, then its last token stopped it
      self.waiting.remove(seq)
    if seq.slot is not None:
      self._vacate(seq)  # pages back at once (kept ones go idle)

  def cancel(self, handle: RequestHandle) -> None:
    """Finishes the request of `handle` as "cancelled", waiting or running (no-op if done)."""
    for seq in [*self.waiting, *(s for s in self.slots if s is not None)]:
      if seq.handle is handle and not handle.done:
        self.finish(seq, "cancelled")

  def _register(self, seq: Sequence) -> None:
    """Offers the sequence's newly full, computed pages to the prefix cache."""
    if self.prefix_cache is None or seq.slot is None:
      return
    full = min(seq.cached, seq.known) // self.page_size  # pages of computed, known tokens
    keys = self._full_page_keys(seq, full)
    for j in range(seq.registered, full):
      self.prefix_cache.insert(keys[j], int(self.allocator.block_table[seq.slot, j]))
    seq.registered = max(seq.registered, full)
