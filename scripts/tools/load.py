"""Concurrent load on a real server: a request mix, the client that sends it, and the checks.

The load test (tests/engine/test_serve.py) and the soak (scripts/soak.py) share this module:

* `prompt_pool(tokenizer, lengths)`: code prompts (token ids) of the given lengths, cut from the
  standard library sources the tiny models were trained on;
* `build_requests(pool, count, seed, mix)`: a deterministic mix of prompt lengths, max_tokens,
  streaming and not, greedy and seeded sampling, and streaming clients that disconnect early;
* `run_load(url, model, requests, concurrency)`: sends them over aiohttp with at most
  `concurrency` in flight, polls /health throughout, and returns every request's result;
* `references(llm, requests)` and `mismatches(requests, results, references)`: what an offline
  engine answers to the same requests (greedy ones: the target alone, float32; seeded ones: GSD
  in a quiet batch, since seeded text does not depend on the batch), and where the server differs.

Prompts are sent as token ids so that server and offline engine see the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_gsd.testing.engines import MAX_MODEL_LEN

# The server a load runs against: 256 sequences in one step, each verifying up to 1 + 24 rows,
# so the per-step token budget holds 256 full trees (the CPU server's default, 2048, holds about
# 80: the scheduler would keep the others waiting). Prefill surges still make it truncate some
# trees (any breadth-first prefix is a tree).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
SERVER_ARGS = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS))

# vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s). A client that keeps
# idle connections longer (aiohttp's default: 15 s) races the server's close: a request sent as the
# server hangs up fails with a reset or a disconnect, and POSTs are not retried. Clients here drop
# idle connections well before the server would.
CLIENT_KEEPALIVE_S = 1.0


@dataclass(frozen=True)
class LoadRequest:
    """One completion request of the mix."""

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True
    disconnect_after_chunks: int | None = None  # streaming only: the client hangs up

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def disconnects(self) -> bool:
        return self.disconnect_after_chunks is not None

    def payload(self, model: str) -> dict:
        body = {"model": model, "prompt": list(self.prompt_token_ids), "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "ignore_eos": self.ignore_eos,
                "stream": self.stream, "return_token_ids": True}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass
class LoadResult:
    index: int
    completed: bool = False  # a finish_reason arrived
    aborted: bool = False  # the client hung up on purpose
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    latency_s: float = 0.0


@dataclass(frozen=True)
class LoadMix:
    """Fractions of the mix; max_tokens and prompt lengths are drawn uniformly from the lists."""

    max_tokens: tuple[int, ...] = (1, 2, 5, 8, 16, 24, 32)
    stream: float = 0.5
    sampled: float = 0.35
    disconnect: float = 0.3  # of the streaming requests, with max_tokens >= 8
    honour_eos: float = 0.25  # requests that stop at EOS (ignore_eos false)
    at_context_limit: float = 0.05  # prompts that leave exactly max_tokens of room


@dataclass
class ServerWatch:
    health_checks: int = 0
    health_failures: list[str] = field(default_factory=list)
    peak_running: int = 0  # the server's vllm:num_requests_running, sampled


@dataclass
class LoadReport:
    results: list[LoadResult]
    wall_s: float
    peak_in_flight: int  # requests the client had in flight at once
    server: ServerWatch

    @property
    def served(self) -> int:
        return sum(r.completed for r in self.results)

    @property
    def aborted(self) -> int:
        return sum(r.aborted for r in self.results)

    @property
    def errors(self) -> list[LoadResult]:
        return [r for r in self.results if r.error is not None]


# ------------------------------------------------------------------------------------ the mix


def prompt_pool(tokenizer, lengths: Sequence[int], per_length: int = 3) -> list[tuple[int, ...]]:
    """`per_length` code prompts of each length (token ids, no BOS), from different places of the
    standard library sources (the tiny models' training text)."""
    from vllm_gsd.testing.tiny_models import stdlib_source_files

    files = stdlib_source_files()
    pool = []
    for k, length in enumerate(lengths):
        for j in range(per_length):
            source = files[(37 * k + 11 * j) % len(files)].read_text(encoding="utf-8", errors="replace")
            ids = tokenizer(source, add_special_tokens=False)["input_ids"]
            start = (97 * (j + 1)) % max(len(ids) - length, 1)
            window = ids[start:start + length]
            pool.append(tuple((window * (length // max(len(window), 1) + 1))[:length]))
    return pool


def build_requests(pool: Sequence[tuple[int, ...]], count: int, seed: int = 0,
                   mix: LoadMix = LoadMix(), first_index: int = 0) -> list[LoadRequest]:
    """`count` requests drawn deterministically (given `seed`) from `pool` and `mix`."""
    rng = random.Random(seed)
    requests = []
    for index in range(first_index, first_index + count):
        max_tokens = rng.choice(mix.max_tokens)
        prompt = rng.choice(pool)
        if rng.random() < mix.at_context_limit:
            prompt = (prompt * (MAX_MODEL_LEN // len(prompt) + 1))[:MAX_MODEL_LEN - max_tokens]
        prompt = prompt[:MAX_MODEL_LEN - max_tokens]
        stream = rng.random() < mix.stream
        sampled = rng.random() < mix.sampled
        disconnect = stream and max_tokens >= 8 and rng.random() < mix.disconnect
        requests.append(LoadRequest(
            index=index, prompt_token_ids=tuple(prompt), max_tokens=max_tokens, stream=stream,
            temperature=rng.choice((0.7, 1.0)) if sampled else 0.0,
            top_p=rng.choice((0.9, 1.0)) if sampled else 1.0,
            seed=rng.randrange(2**31) if sampled else None,
            ignore_eos=rng.random() >= mix.honour_eos,
            disconnect_after_chunks=rng.randint(1, 3) if disconnect else None,
        ))
    return requests


# ------------------------------------------------------------------------------------ the client


async def _send(session, url: str, model: str, request: LoadRequest, timeout_s: float) -> LoadResult:
    import aiohttp

    result = LoadResult(index=request.index)
    start = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=request.payload(model),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:500]}"
                return result
            if not request.stream:
                choice = (await reply.json())["choices"][0]
                result.text, result.token_ids = choice["text"], list(choice["token_ids"] or [])
                result.finish_reason = choice["finish_reason"]
            else:
                chunks = 0
                async for line in reply.content:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[len(b"data: "):])
                    if "error" in chunk:  # the server reports a failure inside the stream
                        result.error = f"stream error: {chunk['error']}"
                        break
                    choice = chunk["choices"][0]
                    result.text += choice["text"]
                    result.token_ids += choice.get("token_ids") or []
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    chunks += 1
                    if request.disconnects and chunks >= request.disconnect_after_chunks \
                            and result.finish_reason is None:
                        result.aborted = True
                        reply.close()  # hang up mid-stream: the server must abort the request
                        break
            result.completed = (result.finish_reason is not None and not result.aborted
                                and result.error is None)
            if not result.completed and not result.aborted and result.error is None:
                result.error = "no finish_reason"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency_s = time.monotonic() - start
    return result


async def _watch_server(session, url: str, stop: asyncio.Event, watch: ServerWatch,
                        interval_s: float) -> None:
    """Until `stop`: /health must answer 200; /metrics gives the peak of running requests.

    Each probe opens its own connection (as a load balancer's would): a failure is the server's,
    never a pooled connection's keep-alive running out under the probe."""
    import aiohttp

    from scripts.tools.server import parse_metrics

    timeout = aiohttp.ClientTimeout(total=30)
    while not stop.is_set():
        try:
            async with session.get(f"{url}/health", timeout=timeout) as reply:
                if reply.status != 200:
                    watch.health_failures.append(f"/health {reply.status} at check {watch.health_checks}")
            async with session.get(f"{url}/metrics", timeout=timeout) as reply:
                metrics = parse_metrics(await reply.text())
                watch.peak_running = max(watch.peak_running,
                                         int(metrics.get("vllm:num_requests_running", 0)))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            watch.health_failures.append(
                f"{type(exc).__name__} ({exc}) at check {watch.health_checks}")
        watch.health_checks += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except asyncio.TimeoutError:
            pass


async def _run(url, model, requests, concurrency, timeout_s, health_interval_s, on_done):
    import aiohttp

    in_flight = peak = 0
    slots = asyncio.Semaphore(concurrency)
    watch = ServerWatch()
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=CLIENT_KEEPALIVE_S)
    probes = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, \
            aiohttp.ClientSession(connector=probes) as probe_session:
        watcher = asyncio.create_task(_watch_server(probe_session, url, stop, watch, health_interval_s))

        async def one(request: LoadRequest) -> LoadResult:
            nonlocal in_flight, peak
            async with slots:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    result = await _send(session, url, model, request, timeout_s)
                finally:
                    in_flight -= 1
            if on_done is not None:
                on_done(result)
            return result

        start = time.monotonic()
        results = await asyncio.gather(*(one(r) for r in requests))
        wall = time.monotonic() - start
        stop.set()
        await watcher
    return LoadReport(results=list(results), wall_s=wall, peak_in_flight=peak, server=watch)


def run_load(url: str, model: str, requests: Sequence[LoadRequest], concurrency: int,
             timeout_s: float = 600.0, health_interval_s: float = 0.25,
             on_done: Callable[[LoadResult], None] | None = None) -> LoadReport:
    """Send `requests` with at most `concurrency` in flight; /health is polled meanwhile."""
    return asyncio.run(_run(url, model, list(requests), concurrency, timeout_s,
                            health_interval_s, on_done))


# ------------------------------------------------------------------------------------ the checks


def _key(request: LoadRequest) -> tuple:
    return (request.prompt_token_ids, request.max_tokens, request.ignore_eos, request.temperature,
            request.top_p, request.seed)


def references(llm, requests: Sequence[LoadRequest]) -> dict[tuple, tuple[list[int], str, str]]:
    """(token ids, text, finish reason) an offline engine gives each distinct request, alone
    with its kind (greedy requests: the target alone; seeded ones: GSD in a quiet batch)."""
    from vllm import SamplingParams

    keys = sorted({_key(r) for r in requests}, key=repr)
    outputs = llm.generate(
        [{"prompt_token_ids": list(key[0])} for key in keys],
        [SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=temperature,
                        top_p=top_p, seed=seed)
         for _, max_tokens, ignore_eos, temperature, top_p, seed in keys],
        use_tqdm=False)
    return {key: (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for key, o in zip(keys, outputs)}


def problems(requests: Sequence[LoadRequest], report: LoadReport) -> list[str]:
    """What went wrong apart from greedy mismatches: errors, requests left unfinished or cut
    short, aborts nobody asked for, failed health checks."""
    out = [f"request {r.index}: {r.error}" for r in report.errors]
    for request, result in zip(requests, report.results):
        if result.aborted and not request.disconnects:
            out.append(f"request {request.index}: aborted without the client hanging up")
        if result.completed and request.ignore_eos and (
                (len(result.token_ids), result.finish_reason) != (request.max_tokens, "length")):
            out.append(f"request {request.index}: {len(result.token_ids)} tokens "
                       f"({result.finish_reason}), want {request.max_tokens} (length)")
    return out + [f"server: {failure}" for failure in report.server.health_failures]


def mismatches(requests: Sequence[LoadRequest], results: Sequence[LoadResult],
               references: dict[tuple, tuple[list[int], str, str]]) -> list[str]:
    """Every completed request with a reference whose tokens, text or finish reason differ."""
    out = []
    for request, result in zip(requests, results):
        want = references.get(_key(request))
        if want is None or not result.completed:
            continue
        if (result.token_ids, result.text, result.finish_reason) != want:
            out.append(f"request {request.index} (prompt {len(request.prompt_token_ids)} tokens, "
                       f"max_tokens {request.max_tokens}, stream {request.stream}, "
                       f"seed {request.seed}): got {result.token_ids} {result.finish_reason}, "
                       f"want {want[0]} {want[2]}")
    return out
