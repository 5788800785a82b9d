"""What `kie serve` runs behind HTTP: one worker thread owns the engine and decodes one job at a time, in FIFO
order (the engine is built for single-request latency, not batching), turning token ids into text deltas with
stop strings cut out. The event loop talks to it only through Job: events come back via call_soon_threadsafe,
and `cancelled` (a threading.Event) is checked between tokens, so a client that leaves frees the engine at once.
Nothing here knows about HTTP."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from kie_moe.metrics import ServerMetrics
from kie_moe.sampling import SamplingParams

log = logging.getLogger("kie_moe.server")


# ---------------------------------------------------------------------------------------------- detokenizer

class TextStream:
    """Token ids -> text deltas, with stop strings cut out.

    Decodes a sliding window (ids since the last emitted boundary) rather than the whole output each token, so
    the cost per token stays flat; text ending in U+FFFD is an incomplete UTF-8 sequence and waits for its next
    byte. Any tail that could still grow into a stop string is held back, so a stop string never reaches the
    client even in part."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tok, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix = self.read = 0     # window: ids[prefix:read] is already decoded into self.text
        self.text, self.sent, self.stopped = "", 0, False

    def _decode_new(self, final: bool) -> str:
        if self.tok is None:
            return ""
        old = self.tok.decode(self.ids[self.prefix:self.read])
        new = self.tok.decode(self.ids[self.prefix:])
        if len(new) > len(old) and (final or not new.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(old):]
        return ""

    def push(self, tid: int) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string was hit: generation must end)."""
        self.ids.append(tid)
        self.text += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.text += self._decode_new(final=True)
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        # no stop occurrence can start before self.sent: we only ever sent text that could not begin one
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent, self.stopped = self.text[self.sent:cut], len(self.text), True
            return out, True
        safe = len(self.text)
        if not final:
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        safe = min(safe, len(self.text) - k)
                        break
        out, self.sent = self.text[self.sent:safe], safe
        return out, False


# ---------------------------------------------------------------------------------------------- scheduler

class QueueFull(Exception):
    """More requests than --max-queue are waiting (the server answers 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work (503)."""


@dataclass
class Delta:
    text: str
    token_id: int | None


@dataclass
class Done:
    finish_reason: str            # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class Job:
    """One request's generation. The worker thread fills `queue` through the event loop (call_soon_threadsafe);
    `cancelled` is the only thing the event loop tells the worker."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 arrival: float | None = None):
        self.prompt_ids, self.params, self.loop = prompt_ids, params, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrival = time.perf_counter() if arrival is None else arrival   # perf_counter() when the request came
        self.started = False

    def emit(self, ev):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:          # the event loop is closed: the server is going down
            self.cancelled.set()

    def cancel(self):
        self.cancelled.set()

    async def events(self) -> AsyncIterator[Delta | Done]:
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, Done):
                return


class Scheduler:
    """Owns the engine: one worker thread decodes one job at a time, in arrival order."""

    def __init__(self, engine, metrics: ServerMetrics, max_queue: int):
        self.engine, self.m, self.max_queue = engine, metrics, max_queue
        self.fifo: queue.SimpleQueue = queue.SimpleQueue()
        self.active: set[Job] = set()     # admitted and not yet answered; touched on the event loop only
        self.thread: threading.Thread | None = None
        self.closing = False

    def start(self):
        self.thread = threading.Thread(target=self._work, name="kie-engine", daemon=True)
        self.thread.start()

    def close(self):
        """Refuse new jobs and cancel every admitted one, so open streams end now rather than after uvicorn's
        graceful-shutdown timeout. Safe to call from a signal handler (it only sets flags)."""
        self.closing = True
        for j in list(self.active):
            j.cancel()

    def stop(self, timeout: float = 5.0):
        self.close()
        self.fifo.put(None)
        if self.thread is not None:
            self.thread.join(timeout)

    def submit(self, job: Job):
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        # one slot decodes, max_queue wait; past that the client should back off rather than pile up
        if len(self.active) >= self.max_queue + 1:
            raise QueueFull(f"the server is busy: {self.max_queue} requests are already waiting; retry later")
        self.active.add(job)
        self.fifo.put(job)

    def release(self, job: Job):
        job.cancel()                  # a no-op when it has finished; frees the engine when it has not
        self.active.discard(job)

    def update_gauges(self):
        running = sum(1 for j in self.active if j.started and not j.cancelled.is_set())
        self.m.running.set(running)
        self.m.queue_depth.set(sum(1 for j in self.active if not j.started and not j.cancelled.is_set()))

    def _work(self):
        while True:
            job = self.fifo.get()
            if job is None:
                return
            if job.cancelled.is_set():    # its client left while it waited
                self.m.finished.inc(reason="cancelled")
                job.emit(Done("cancelled", len(job.prompt_ids), 0))
                continue
            job.started = True
            try:
                self._decode(job)
            except Exception as e:  # a backend failure fails this request only; the next one still runs
                log.exception("generation failed")
                self.m.finished.inc(reason="error")
                job.emit(Done("error", len(job.prompt_ids), 0, f"generation failed: {type(e).__name__}: {e}"))

    def _decode(self, job: Job):
        eng, p, m = self.engine, job.params, self.m
        text = TextStream(eng.tokenizer, p.stop)
        m.prompt_tokens.inc(len(job.prompt_ids))
        n, reason, hit, t_first = 0, "length", False, None
        t_start = time.perf_counter()
        gen = eng.stream(job.prompt_ids, p)
        try:
            for tid in gen:
                n += 1
                if t_first is None:
                    t_first = time.perf_counter()
                    m.ttft.observe(t_first - job.arrival)
                    m.prefill.observe(t_first - t_start)
                    if t_first > t_start:
                        m.prefill_rate.observe(len(job.prompt_ids) / (t_first - t_start))
                delta, hit = text.push(tid)
                if hit or (tid in eng.eos_ids and not p.ignore_eos):
                    reason = "stop"
                job.emit(Delta(delta, tid))
                if hit:
                    break
                if job.cancelled.is_set():   # checked before the generator computes the next token
                    reason = "cancelled"
                    break
        finally:
            gen.close()
        t_end = time.perf_counter()
        if not hit and reason != "cancelled":
            tail = text.flush()
            if text.stopped:
                reason = "stop"
            if tail:
                job.emit(Delta(tail, None))
        m.generation_tokens.inc(n)
        if n and reason != "cancelled":
            m.sampling_fallbacks.inc(eng.sampling_fallbacks(p))
        if n > 1:
            m.tpot.observe((t_end - t_first) / (n - 1))
        m.e2e.observe(t_end - job.arrival)
        m.finished.inc(reason=reason)
        job.emit(Done(reason, len(job.prompt_ids), n))
