"""LLMEngine: requests in, streamed token outputs out, one scheduler step at a time.

Also the one KV seam of the cluster: a prefill-only request stops after its first token with
its blocks held; `export_kv` hands out its blocks as zero-copy byte frames. An importing engine
reserves blocks (`reserve_import`), lands arriving frames in them (`land_kv`), then
`commit_import`s the sequence into its decode batch.

Threading rule: one thread (the worker's engine thread) calls every method here, except
`land_kv`, which a receiver thread may call at any time. That is safe because `land_kv` writes
only the missing blocks of an open reservation, which no running sequence reads and no step
touches, under the reservation's lock; commit and abort close the reservation under the same
lock before those blocks join the batch or go back to the free list.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import TextStream
from engine.gemm_plan import choose_gemm_layout, pack_linears
from engine.hashing import hash_blocks
from engine.kv_cache import KVCache
from engine.linear import weights_into_huge_pages
from engine.loader import load_model
from engine.model_meta import KVLayout
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, KVExport, KVReservation, RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


class KVImportError(RuntimeError):
    """KV that cannot land: its reservation is gone or the frame does not fit it."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.dtype, config.device)
        self.model, self.spec, self.tokenizer = loaded.model, loaded.spec, loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.device = torch.device(config.device)
        self.gemm_layout = choose_gemm_layout(config.cpu_gemm, config.dtype, self.device)
        # Routes per weight shape, e.g. {"512x1024": "1-8 mkl, 9+ onednn"} (measured with "auto").
        self.gemm_routes = pack_linears(self.model, self.gemm_layout, config.max_num_batched_tokens,
                                        min(config.max_num_seqs, config.max_num_batched_tokens))
        weights_into_huge_pages(self.model)  # CPU weights only
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        per_block = KVCache.bytes_per_block(self.spec, config.block_size, config.dtype)
        num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no block "
                             f"({per_block} bytes each)")
        self.kv = KVCache(self.spec, num_blocks, config.block_size, config.dtype, self.device,
                          shared=config.kv_shared_memory)
        self.bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.bm)
        self.runner = ModelRunner(self.model, self.kv, self.device)
        # The weights' copies and routes are final here: the plan may point into them (its kernel
        # is built now, not in the first request's step).
        self.model.prepare_native_step(self.kv.layers, enabled=not config.enforce_eager)
        self.seqs: dict[str, Sequence] = {}
        self.streams: dict[str, TextStream] = {}
        self._pending: list[RequestOutput] = []
        self._reservations: dict[str, KVReservation] = {}
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self.num_preemptions = 0
        # Steps that ran the model, and their seconds from schedule to outputs: the engine's own
        # time, which a served stream's inter-token time can be set against (bench/overhead.py).
        self.num_steps, self.busy_s = 0, 0.0

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def validate(self, token_ids: Seq[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.spec.vocab_size
        bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab),
                   None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias names a token outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"model's context length {self.max_model_len}")
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            raise InvalidRequestError(f"request needs {self.bm.blocks_needed(total)} KV blocks; the pool has "
                                      f"{self.bm.num_blocks}")

    def _new_seq(self, request_id: str | None, prompt: str | Seq[int], params: SamplingParams | None,
                 prefill_only: bool, resume: Seq[int] = ()) -> Sequence:
        """`resume`: output tokens the client already has (a request resumed on another worker).
        They count as outputs (max_tokens, stop checks, the per-position sampling seed), so the
        resumed request draws exactly the tokens the first one would have."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        resume = list(resume)
        if len(resume) >= params.max_tokens or any(not 0 <= t < self.spec.vocab_size for t in resume):
            raise InvalidRequestError(f"cannot resume after {len(resume)} output tokens of max_tokens "
                                      f"{params.max_tokens} (or a resumed token is outside the vocabulary)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.seed is None and not params.greedy:
            # A per-request seed keeps sampling independent of batch composition.
            params.seed = self._rng.getrandbits(62)
        seq = Sequence(request_id, token_ids + resume, len(token_ids), params, prefill_only=prefill_only)
        self.seqs[request_id] = seq
        self.streams[request_id] = TextStream(self.tokenizer, token_ids + resume, params.stop)
        return seq

    def add_request(self, request_id: str | None, prompt: str | Seq[int], params: SamplingParams | None = None,
                    prefill_only: bool = False, resume: Seq[int] = (), stream_kv_from: int | None = None,
                    max_frame_bytes: int = 4 << 20, kv_chunks: bool = True) -> str:
        """`stream_kv_from` (prefill-only): export the KV from this block on as the prompt is
        computed, on the outputs (`kv_part`): each chunk's completed blocks as it finishes
        (`kv_chunks`; copies), and the rest with the first token (zero-copy). A prefill worker
        ships the parts while later chunks are computed, and has them without a call to this
        thread, which a running step would hold; with kv_chunks False, the whole KV comes with
        the first token, in the step that made it."""
        seq = self._new_seq(request_id, prompt, params, prefill_only, resume)
        if prefill_only and stream_kv_from is not None:
            seq.kv_stream, seq.kv_chunks = (stream_kv_from, max_frame_bytes), kv_chunks
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str, notify: bool = True) -> bool:
        """Free the request. notify=False emits no final "abort" output: for a caller that has
        stopped listening, whose request id a new request may already be reusing."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        if notify:
            self._pending.append(self._output(seq, [], [], ""))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    def _finish(self, seq: Sequence, reason: str | None, stop_reason: str | int | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._close_reservation(seq.request_id)
        if seq.status is not SequenceStatus.PREFILLED:
            self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.bm.free(seq)
        del self.seqs[seq.request_id]
        self.streams.pop(seq.request_id, None)

    def _output(self, seq: Sequence, toks: list[int], lps: list[float], text: str) -> RequestOutput:
        return RequestOutput(seq.request_id, toks, lps, text, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens,
                             seq.stop_reason, seq.status is SequenceStatus.PREFILLED)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if not batch:
            return outputs
        sampled, tokens, logprobs, tops, prompt = self.runner.execute(batch)
        for seq, lps, ptops in prompt:
            seq.prompt_logprobs += lps
            seq.prompt_top_logprobs += ptops
        if self.config.emulate_device_s_per_token:  # device emulation (EngineConfig): a slower chip
            time.sleep(self.config.emulate_device_s_per_token * sum(i.num_new_tokens for i in batch.scheduled))
        for item in batch.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.cache_full_blocks(seq)
            chunk_done = seq.num_computed_tokens < len(seq.token_ids)  # a chunk, no token yet
            if seq.kv_stream is not None and seq.kv_chunks and chunk_done:
                part = self._export_chunk(seq)
                if part is not None:
                    out = self._output(seq, [], [], "")
                    out.kv_part = part
                    outputs.append(out)
        for seq, tok, lp, top in zip(sampled, tokens, logprobs, tops, strict=True):
            if seq.num_output_tokens > 0:  # a decode step (an imported sequence holds its first token)
                seq.num_decode_steps += 1
                seq.decode_batch_sum += len(sampled)
            out = self._append_token(seq, tok, lp)
            out.new_top_logprobs = [top]
            outputs.append(out)
        self.num_steps += 1
        self.busy_s += time.perf_counter() - t0
        return outputs

    def _append_token(self, seq: Sequence, tok: int, lp: float) -> RequestOutput:
        seq.token_ids.append(tok)
        seq.output_logprobs.append(lp)
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = time.monotonic()
        stream = self.streams[seq.request_id]
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            reason, stop = "stop", tok
        else:
            stop_str = stream.add([tok])
            if stop_str is not None:
                reason, stop = "stop", stop_str
            elif seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason, stop = "length", None
            else:
                reason, stop = None, None
        if reason is not None:
            text = stream.take(final=True)
            self._finish(seq, reason, stop)
        else:
            text = stream.take(final=False)
            if seq.prefill_only:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.PREFILLED
        out = self._output(seq, [tok], [lp], text)
        if reason is not None and seq.num_decode_steps:
            out.decode_batch = seq.decode_batch_sum / seq.num_decode_steps
        if seq.kv_stream is not None and seq.status is SequenceStatus.PREFILLED:
            out.kv_part = self.export_kv(seq.request_id, *seq.kv_stream)
        if first and seq.first_scheduled_time is not None:
            out.prefill_s = seq.first_token_time - seq.first_scheduled_time
        if first and seq.params.prompt_logprobs is not None and not seq.needs_prompt_logprobs:
            out.prompt_logprobs, out.prompt_top_logprobs = seq.prompt_logprobs, seq.prompt_top_logprobs
        return out

    # ---- convenience -------------------------------------------------------------------------
    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[dict]:
        """Run prompts to completion; returns dicts with token_ids, text, logprobs, finish_reason
        (and prompt_logprobs, prompt_top_logprobs when asked for)."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(None, p, replace(sp) if sp else None)
               for p, sp in zip(prompts, plist, strict=True)]
        results = {i: {"token_ids": [], "text": "", "logprobs": [], "top_logprobs": [], "finish_reason": None,
                       "num_cached_tokens": 0} for i in ids}
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r["token_ids"] += out.new_token_ids
                r["logprobs"] += out.new_logprobs
                r["top_logprobs"] += out.new_top_logprobs
                r["text"] += out.text_delta
                r["num_cached_tokens"] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    r["prompt_logprobs"], r["prompt_top_logprobs"] = out.prompt_logprobs, out.prompt_top_logprobs
                if out.finished:
                    r["finish_reason"] = out.finish_reason
        return [results[i] for i in ids]

    # ---- KV export / import ------------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        return self.kv.layout

    def shared_kv_memory(self) -> tuple[int, memoryview] | None:
        """(memfd, the pool's bytes) when the pool is in shared memory (kv_shared_memory), else
        None: what a KV sender may offer to receivers on this host. Exported frames are views
        into it."""
        return None if self.kv.shared_fd is None else (self.kv.shared_fd, self.kv.memory())

    def export_kv(self, request_id: str, skip_blocks: int = 0, max_frame_bytes: int = 4 << 20) -> KVExport:
        """The prefilled request's KV from block `skip_blocks` on, as frames over its pool blocks;
        they stay valid until `release(request_id)`."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not SequenceStatus.PREFILLED:
            raise KeyError(f"request {request_id!r} has no prefilled KV to export")
        prompt = seq.token_ids[:-1]  # every token whose KV is computed (a resumed request's outputs too)
        return self._export(seq, prompt, skip_blocks, self.bm.blocks_needed(len(prompt)), max_frame_bytes,
                            (seq.token_ids[-1], seq.output_logprobs[-1]))

    def _export_chunk(self, seq: Sequence) -> KVExport | None:
        """The full blocks a prompt chunk completed since the last one's, as copies: a sequence
        still prefilling can be preempted, and its blocks reused before a zero-copy frame left."""
        start, frame_bytes = seq.kv_stream
        full = seq.num_computed_tokens // self.bm.block_size
        if full <= start:
            return None
        seq.kv_stream = (full, frame_bytes)
        return self._export(seq, seq.token_ids[:full * self.bm.block_size], start, full, frame_bytes, (-1, 0.0),
                            copy=True)

    def _export(self, seq: Sequence, prompt: list[int], first: int, end: int, max_frame_bytes: int,
                token: tuple[int, float], copy: bool = False) -> KVExport:
        bs = self.bm.block_size
        hashes = hash_blocks(prompt, bs, seq.block_hashes[:len(prompt) // bs])
        frames, counts = self.kv.frames(seq.block_table[first:end], max_frame_bytes, copy=copy)
        shipped = [hashes[i] if i < len(hashes) else None for i in range(first, end)]
        return KVExport(seq.request_id, prompt, self.kv.layout, first, shipped, frames, counts, *token)

    def release(self, request_id: str) -> None:
        """Drop a prefilled request once its KV has been shipped; its blocks stay in the prefix cache."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._finish(seq, seq.finish_reason)

    def reserve_import(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                       reserve_tokens: int | None = None, resume: Seq[int] = ()) -> KVReservation | None:
        """Set aside blocks and a batch slot for an incoming prefilled sequence; None when the pool
        or the batch (max_num_seqs) is full.

        Leading blocks already cached here (same hash chain, same tokens) are shared, not resent.
        `reserve_tokens` allocates room for growth up front (prompt + max_tokens) so the
        sequence can never be preempted once admitted."""
        if not self.scheduler.has_free_slot:
            return None
        seq = self._new_seq(request_id, list(prompt_ids), params, prefill_only=False, resume=resume)
        bs = self.bm.block_size
        seq.block_hashes = hash_blocks(seq.token_ids, bs)
        held = self.bm.lookup(seq.block_hashes, seq.token_ids)
        n_total = self.bm.blocks_needed(max(reserve_tokens or 0, len(seq.token_ids)))
        self.bm.acquire(held)
        new = self.bm.allocate_blocks(n_total - len(held))
        if new is None:
            self.bm.free_blocks(held)
            del self.seqs[request_id]
            self.streams.pop(request_id, None)
            return None
        seq.block_table = held + new
        seq.num_cached_tokens = len(held) * bs
        seq.num_registered_blocks = len(held)
        self.scheduler.add_awaiting(seq)
        res = KVReservation(request_id, self.kv.layout, list(seq.block_table), len(held),
                            self.bm.blocks_needed(len(seq.token_ids)), list(seq.block_hashes))
        self._reservations[request_id] = res
        return res

    def land_kv(self, res: KVReservation, offset: int, buf: memoryview | bytes) -> None:
        """Copy one frame into the reservation's missing blocks, starting `offset` blocks in.
        Callable from any thread (see the module's threading rule); raises KVImportError when
        the reservation was committed, aborted or the frame does not fit."""
        n = memoryview(buf).nbytes // res.layout.block_nbytes
        with res.lock:
            if not res.open:
                raise KVImportError(f"{res.request_id}: reservation is closed (cancelled or already committed)")
            dst = res.missing_block_ids[offset:offset + n]
            if offset < 0 or len(dst) != n or n * res.layout.block_nbytes != memoryview(buf).nbytes:
                raise KVImportError(f"{res.request_id}: frame of {memoryview(buf).nbytes} bytes at block {offset} "
                                    f"does not fit the {len(res.missing_block_ids)} missing blocks")
            self.kv.land(dst, buf)

    def _close_reservation(self, request_id: str) -> None:
        res = self._reservations.pop(request_id, None)
        if res is not None:
            with res.lock:  # waits for a frame being landed right now
                res.open = False

    def commit_import(self, request_id: str, first_token: int, first_logprob: float) -> RequestOutput | None:
        """All blocks landed and passed their checks: the sequence joins the decode batch.
        Returns a final output if the first token already ends the request."""
        seq = self.seqs[request_id]
        self._close_reservation(request_id)
        seq.num_computed_tokens = len(seq.token_ids)
        self.bm.cache_full_blocks(seq)
        self.scheduler.activate(seq)
        out = self._append_token(seq, first_token, first_logprob)
        return out if out.finished else None

    def orphan_refs(self) -> int:
        """Block references that no live request holds: 0 unless something leaked."""
        return self.bm.total_refs - sum(len(s.block_table) for s in self.seqs.values())

    def stats(self) -> EngineStats:
        bm = self.bm
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_blocks,
                           bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks, bm.usage,
                           bm.prefix_queries, bm.prefix_hits, self.num_preemptions, self.num_steps, self.busy_s)
