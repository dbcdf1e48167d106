"""Scheduler output -> model inputs -> logits -> accepted tokens. No policy here.

All scheduled requests (decodes, prefill chunks of different lengths, and
decodes carrying forced or draft tokens) run in ONE model forward per step;
engine/sample/acceptance.py turns the logits rows into each request's accepted tokens.

Blocks a lower tier holds for a request come back through the runner too:
their reads run on a reader thread (kv/tiers/reader.py) and the runner copies
what arrived into the request's blocks between steps; which blocks to load
was decided by the KV manager and the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.engine.sample.acceptance import AcceptRows, StepResult, TokenAcceptor
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.kv.attention import AttentionBackend, SequenceSlice
from kvserve.kv.context_shift import ShiftPlan, TokenMoves
from kvserve.kv.cache.packing import pack_tokens, unpack_tokens
from kvserve.kv.cache.storage import PagedKVCache
from kvserve.engine.observe.kept_tokens import KeptTokens
from kvserve.kv.compression.compact import compact_chunk, kept_record
from kvserve.kv.compression.spec import CompressionSpec
from kvserve.kv.state.context import StateSequence
from kvserve.kv.state.storage import StateCache
from kvserve.kv.tiers.connector import LoadResult, TierConnector, TierLoad
from kvserve.kv.tiers.reader import TierReader
from kvserve.model.causal_lm import CausalLM
from kvserve.structured.matcher import GrammarMatcher


@dataclass
class _StepInputs:
    """One forward's rows, in the attention backend's batch order."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slices: list[SequenceSlice] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits pick accepted tokens
    accept_rows: list[AcceptRows] = field(default_factory=list)  # each request's part of sample_rows
    # (request, first prompt position, first row, rows) of the rows that score prompt tokens
    prompt_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    states: list[StateSequence] = field(default_factory=list)  # a hybrid model's sequences, in row order


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, attention: AttentionBackend,
                 device: torch.device | str = "cpu", tiers: TierConnector | None = None,
                 states: StateCache | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        if (states is not None) != model.has_recurrent_state:
            raise ValueError("a hybrid model runs with a recurrent-state cache, and only a hybrid model does")
        self.states = states
        self.attention = attention  # the backend that allocated kv_cache
        self.device = torch.device(device)  # every tensor a step builds is made there
        cache_windows = kv_cache.spec.attention_layer_windows
        if tuple(model.layer_windows) != cache_windows:
            raise ValueError(f"the KV cache was laid out for layer windows {cache_windows}, "
                             f"the model has {tuple(model.layer_windows)}")
        self.acceptor = TokenAcceptor(model.config.vocab_size, self.device)
        # Whether the backend batches one-token decodes and only those (a verify is split into them).
        self._single_token_decodes = attention.is_decode(1) and not attention.is_decode(2)
        # Per request, per KV group: its block table, kept across steps and changed by each step's updates.
        self._block_tables: dict[str, list[list[int]]] = {}
        self.tier_reader = TierReader(tiers) if tiers is not None else None
        self._compression: dict[str, CompressionSpec] = {}  # compressing requests' resolved specs
        self.kept_tokens: KeptTokens | None = None  # the lab's record of kept tokens (the engine sets it)

    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
                    matcher: GrammarMatcher | None = None, kv_compression: CompressionSpec | None = None) -> None:
        self.acceptor.add_request(request_id, params, prompt_token_ids, matcher)
        if kv_compression is not None:
            self._compression[request_id] = kv_compression

    def remove_request(self, request_id: str) -> None:
        self.acceptor.remove_request(request_id)
        self._compression.pop(request_id, None)
        self._block_tables.pop(request_id, None)
        if self.tier_reader is not None:
            self.tier_reader.cancel(request_id)  # its blocks go back to the pool: nothing may land in them

    def start_loads(self, loads: Sequence[TierLoad]) -> None:
        """Start reading these tier blocks off the compute thread (`complete_loads` takes them in)."""
        for load in loads:
            self.tier_reader.submit(load)

    def complete_loads(self) -> list[LoadResult]:
        """Copy the tier blocks that have arrived into their requests' blocks; what each load delivered.
        A load whose copy fails delivers nothing (its blocks are recomputed)."""
        if self.tier_reader is None:
            return []
        results = []
        for load, payloads, error in self.tier_reader.take_arrived():
            if error is None and payloads:
                try:
                    self.kv_cache.write_blocks(list(load.block_ids[: len(payloads)]), payloads)
                except Exception as exc:  # the blocks' contents are unknown: none of them counts
                    error = exc
            results.append(LoadResult(load, len(payloads) if error is None else 0, error))
        return results

    def wait_for_loads(self, timeout_s: float) -> None:
        """Idle until a tier read ends or `timeout_s` passes (only when no step has anything to run)."""
        if self.tier_reader is not None:
            self.tier_reader.wait(timeout_s)

    def loads_in_flight(self) -> dict[str, TierLoad]:
        return self.tier_reader.in_flight() if self.tier_reader is not None else {}

    def close(self) -> None:
        if self.tier_reader is not None:
            self.tier_reader.close()

    def begin_step(self, out: SchedulerOutput) -> None:
        """Apply the step's block table updates and context shifts: once per step, before `execute` (which
        may run again request by request when the batch fails)."""
        newest = -1
        for item in out.scheduled:
            update = item.block_update
            if update.replace:
                self._block_tables[item.request_id] = [list(ids) for ids in update.block_ids]
            else:
                for table, ids in zip(self._block_tables[item.request_id], update.block_ids):
                    table.extend(ids)
            newest = max([newest, *(max(ids, default=-1) for ids in update.block_ids)])
        # Blocks used for the first time are zeroed before the forward reads them (only new ids can be).
        self.kv_cache.initialize_blocks_through(newest)
        for _, plan in out.shifts:  # before the forward writes into any block a shift freed
            self.apply_shift(plan)
        for item in out.scheduled:  # chunks the last forward completed, before any later token is computed
            for compaction in item.compactions:  # one per full-attention group: that group's layers
                layers = self.kv_cache.spec.layout.groups[compaction.group].layers
                kept = compact_chunk(self.attention, self.kv_cache, compaction, self._compression[item.request_id],
                                     layers)
                if self.kept_tokens is not None and self.kept_tokens.enabled:  # only while the lab reads them
                    self.kept_tokens.record(item.request_id, compaction.chunk_index, compaction.first_position,
                                            kept_record(kept), len(compaction.src_blocks) * self.kv_cache.block_size,
                                            tuple(layers))

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step (after `begin_step`): the accepted tokens of every request that reached its last token."""
        inputs = self._prepare_inputs(out)
        logits = self._forward(inputs)
        result = StepResult()
        self.acceptor.accept(result, inputs.accept_rows, logits[: len(inputs.sample_rows)])
        if inputs.prompt_rows:
            self.acceptor.prompt_logprobs(result, inputs.prompt_rows, logits[len(inputs.sample_rows):])
        result.drop_failed()
        return result

    def apply_shift(self, plan: ShiftPlan) -> None:
        """Move a context shift's K/V: kept rows copied as they are, the rest moved `drop` positions earlier
        with their keys re-rotated by the model (quantized caches decode, rotate and re-encode)."""
        self._move_tokens(plan.copied, 0)
        self._move_tokens(plan.moved, -plan.drop)

    def _move_tokens(self, moves: TokenMoves, delta: int) -> None:
        if not moves.src_blocks:
            return
        cache, backend = self.kv_cache, self.attention
        # A fresh block must be zeroed before rows land in it, not after (the forward zeroes lazily).
        cache.initialize_blocks_through(max(moves.dst_blocks))
        src = backend.token_slots(cache, self._tensor(moves.src_blocks), self._tensor(moves.src_rows))
        dst = backend.token_slots(cache, self._tensor(moves.dst_blocks), self._tensor(moves.dst_rows))
        spec = cache.spec
        for slots, layers in spec.slot_units():  # a packed layer's slots side by side, or the layers of one slot
            parts = [cache.read_rows(slot, src) for slot in slots]  # every source row read before any is written
            k, v = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
            if delta:
                for layer in layers:
                    used = spec.rows_of(layer)
                    rows = slice(used.start, used.stop) if len(slots) == 1 else slice(None)
                    k[:, rows], v[:, rows] = self._shifted(layer, k[:, rows], v[:, rows], delta)
            for slot, k_part, v_part in zip(slots, k.split(spec.num_kv_heads, 1), v.split(spec.num_kv_heads, 1)):
                cache.write(slot, dst, k_part.contiguous(), v_part.contiguous())

    def _shifted(self, layer: int, k: torch.Tensor, v: torch.Tensor, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored layer `layer`'s rows with their keys re-rotated `delta` positions on. A packed layer is
        unpacked to its heads and packed back; a K = V layer keeps no keys (they are derived from the values
        at each token's position as it is read), so it moves as it is."""
        spec = self.kv_cache.spec
        attention_layer = spec.layer_sources.index(layer) if spec.layer_sources else layer
        packed = spec.packed(layer)
        if packed is None:
            return self.model.shift_key_positions(attention_layer, k, delta), v
        if packed.k_eq_v:
            return k, v
        keys, values = unpack_tokens(packed, spec.head_dim, k, v)
        keys = self.model.shift_key_positions(attention_layer, keys, delta)
        return pack_tokens(packed, k.shape[1], spec.head_dim, keys, values)

    def _prepare_inputs(self, out: SchedulerOutput) -> _StepInputs:
        """Flatten the scheduled requests, in the attention backend's batch order, into one forward's rows."""
        inputs = _StepInputs()
        units = [unit for item in out.scheduled for unit in self._units(item)]
        order = self.attention.batch_order([count for _, _, count in units])
        rows: dict[str, list[int]] = {}  # request id -> its rows so far
        for item, offset, count in (units[i] for i in order):
            first_row = len(inputs.input_ids)
            start = item.num_computed_tokens + offset
            inputs.input_ids.extend(item.token_ids[offset : offset + count])
            inputs.positions.extend(range(start, start + count))
            # A compressing request's full-attention tables hold slots: its tokens sit `slot_offsets` before.
            inputs.slices.append(SequenceSlice(self._block_tables[item.request_id], start, count, item.slot_offsets))
            rows.setdefault(item.request_id, []).extend(range(first_row, first_row + count))
            if offset + count < len(item.token_ids):
                continue  # more of this request's tokens follow in the next units
            if item.sample:
                # From the row of the last forced token (or the request's last token): one per draft more;
                # with logprobs, the rows that score the forced tokens before those.
                forced_rows = len(item.forced_token_ids) if self.acceptor.wants_logprobs(item.request_id) else 0
                num_rows = forced_rows + len(item.draft_token_ids) + 1
                inputs.accept_rows.append(AcceptRows(item.request_id, len(inputs.sample_rows) + forced_rows,
                                                     item.forced_token_ids, item.draft_token_ids, forced_rows))
                inputs.sample_rows.extend(rows[item.request_id][-num_rows:])
            if item.state is not None:
                request_rows = rows[item.request_id]  # contiguous: a request's units stay together, in order
                if request_rows[-1] - request_rows[0] + 1 != len(request_rows):
                    raise ValueError(f"request {item.request_id}: its rows are not contiguous in the batch order")
                inputs.states.append(StateSequence(request_rows[0], len(request_rows), item.num_computed_tokens,
                                                   item.state.slot, item.state.snapshots, item.state.source))
            prompt = self.acceptor.prompt_token_ids(item.request_id)
            if prompt is not None:
                # Position p's logits score prompt token p + 1.
                end = min(item.num_computed_tokens + len(item.token_ids), len(prompt) - 1)
                if end > item.num_computed_tokens:
                    first = rows[item.request_id][0]
                    inputs.prompt_rows.append((item.request_id, item.num_computed_tokens, first,
                                               end - item.num_computed_tokens))
        return inputs

    def _units(self, item: ScheduledRequest) -> list[tuple[ScheduledRequest, int, int]]:
        """(item, offset, count) pieces of a request's tokens, each one slice of the forward. A decode that
        carries drafts or forced tokens is split into single-token decodes (one per query, each attending over
        the keys before it and its own: the step writes every token's K/V before any attention reads them), so
        its k + 1 queries go through the backend's batched decode kernel instead of its prefill path."""
        count = len(item.token_ids)
        # Only a decode (the last token and what it carries) is split: forced tokens riding on a prefill's
        # last chunk (after a preemption) go with the chunk.
        carried = count == item.num_speculative_tokens + 1
        if carried and count > 1 and self._single_token_decodes:
            return [(item, offset, 1) for offset in range(count)]
        return [(item, 0, count)]

    def _forward(self, inputs: _StepInputs) -> torch.Tensor:
        """One model forward; logits of the sampled rows, then of the prompt-logprob rows."""
        context = self.attention.build_context(self.kv_cache, inputs.slices)
        wanted = inputs.sample_rows + [row for _, _, first, count in inputs.prompt_rows
                                       for row in range(first, first + count)]
        # Every row in order (a batch of plain decodes): the forward's own rows, with no gather.
        every_row = len(wanted) == len(inputs.input_ids) and all(r == i for i, r in enumerate(wanted))
        # The step's integers go to the device in one tensor (each tensor made costs a dispatch, and a
        # decode step's Python runs with caches the weights just flushed).
        num_rows = len(inputs.input_ids)
        ids, positions, logits_rows = self._tensor(inputs.input_ids + inputs.positions + wanted).split(
            [num_rows, num_rows, len(wanted)])
        args = (ids, positions, context, None if every_row else logits_rows)
        if self.states is None:
            return self.model(*args)
        return self.model(*args, states=self.states.context(sorted(inputs.states, key=lambda seq: seq.first_row)))

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

