"""Prometheus text-format metrics for `kie serve`, without a prometheus_client dependency: a handful of counters,
gauges and histograms, updated from both the event loop and the engine's worker thread (hence one lock each)."""
from __future__ import annotations

import math
import threading

# latency buckets in seconds: per-token times on a GPU are ~1 ms, first-token times include queueing
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# prompt tokens/s of a prefill: a short prompt on the CPU is ~100, an 8K prompt on an H200 is ~10^4
PREFILL_RATE_BUCKETS = (100, 300, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def _fmt(v: float) -> str:
    return "+Inf" if v == math.inf else repr(float(v))


def _labels(names: tuple[str, ...], values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()
        self._values: dict[tuple, object] = {}

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.label_names)}")
        return tuple(labels[n] for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels):
        k = self._key(labels)
        with self._lock:
            self._values[k] = self._values.get(k, 0.0) + amount

    def get(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items(), key=lambda kv: tuple(map(str, kv[0])))
        if not items and not self.label_names:
            items = [((), 0.0)]  # an unlabelled counter is always exported, so dashboards see 0 not "no data"
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels):
        k = self._key(labels)
        with self._lock:
            self._values[k] = float(value)

    def dec(self, amount: float = 1.0, **labels):
        self.inc(-amount, **labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum, self._n = 0.0, 0

    def observe(self, v: float):
        with self._lock:
            for i, b in enumerate(self.buckets):
                if v <= b:
                    self._counts[i] += 1
                    break
            self._sum += v
            self._n += 1

    @property
    def count(self) -> int:
        return self._n

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._n
        out, cum = self.header(), 0
        for b, c in zip(self.buckets, counts):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {cum}')
        return out + [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {n}"]


class ServerMetrics:
    """Everything `/metrics` exports. Names follow Prometheus conventions (unit suffixes, _total counters)."""

    def __init__(self, model: str):
        self.model = model
        self.requests = Counter("kie_requests_total", "HTTP requests answered, by endpoint and status code",
                                ("endpoint", "status"))
        self.finished = Counter("kie_generations_finished_total",
                                "Generations ended, by reason (stop, length, cancelled, error)", ("reason",))
        self.prompt_tokens = Counter("kie_prompt_tokens_total", "Prompt tokens prefilled")
        self.generation_tokens = Counter("kie_generation_tokens_total", "Tokens generated")
        self.sampling_fallbacks = Counter("kie_sampling_fallback_draws_total",
                                          "Draws of top-k / top-p requests taken as plain temperature samples: the "
                                          "nucleus was wider than the GPU sampler's candidates (kernels/sampling.py)")
        self.queue_depth = Gauge("kie_queue_depth", "Requests waiting for the engine (not counting the one running)")
        self.running = Gauge("kie_requests_running", "Requests decoding now (0 or 1: one request at a time)")
        self.ttft = Histogram("kie_time_to_first_token_seconds",
                              "From request arrival (so including queueing) to the first generated token",
                              TTFT_BUCKETS)
        self.prefill = Histogram("kie_prefill_seconds",
                                 "From the engine starting a request to its first token (prompt prefill + one "
                                 "decode step; no queueing)", TTFT_BUCKETS)
        self.prefill_rate = Histogram("kie_prefill_tokens_per_second",
                                      "Prompt tokens over kie_prefill_seconds, one sample per request",
                                      PREFILL_RATE_BUCKETS)
        self.tpot = Histogram("kie_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, one sample per request",
                              TPOT_BUCKETS)
        self.e2e = Histogram("kie_request_latency_seconds", "From request arrival to the last generated token",
                             TTFT_BUCKETS)
        self.queue_depth.set(0)
        self.running.set(0)

    def render(self) -> str:
        lines = ["# HELP kie_model_info The model this server serves", "# TYPE kie_model_info gauge",
                 f'kie_model_info{{model="{_escape(self.model)}"}} 1']
        for m in (self.requests, self.finished, self.prompt_tokens, self.generation_tokens, self.sampling_fallbacks,
                  self.queue_depth, self.running, self.ttft, self.prefill, self.prefill_rate, self.tpot, self.e2e):
            lines += m.render()
        return "\n".join(lines) + "\n"
