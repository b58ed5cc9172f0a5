"""The torch-free half of the serving benchmark (bench/serve/README.md): the seeded request trace,
the continuous-batching scheduler with its admission rule, and the per-run summary. serve.py
drives it with real backends on the GPU; test_serve.py with a fake one on any machine.

A backend gives the scheduler five things:
  can_admit(req, running) -> bool   whether req fits beside the running requests, reserving
                                    every running request's remaining tokens
  admit(req) -> bool                creates req's cache entry and fills its context; False
                                    (nothing held) when the cache refused it after all
  step(running)                     one decode step: a token for every running request
  release(req)                      frees req's cache entry
  kv_bytes_per_token() -> float     cache bytes held per stored token (all layers), now
"""
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class Request:
    """One request: a context of `context` tokens (filled synthetically), then `output` decode steps."""
    rid: int
    context: int
    output: int
    done: int = 0                  # output tokens produced so far
    step_times: list = field(default_factory=list)  # seconds of each decode step it took part in

    @property
    def length(self):
        """Tokens stored now (context plus produced)."""
        return self.context + self.done

    @property
    def remaining(self):
        return self.output - self.done


def make_trace(n, seed, context_mean=32768, context_spread=0.25, output_min=128, output_max=512, context_max=None):
    """`n` requests, seeded: contexts uniform in context_mean x [1 - spread, 1 + spread], rounded to
    a multiple of 64 (and at most context_max), outputs uniform in [output_min, output_max]."""
    if n < 1:
        raise ValueError(f"trace: n = {n} below 1")
    if not 0 <= context_spread < 1:
        raise ValueError(f"trace: context_spread = {context_spread} outside [0, 1)")
    if not 1 <= output_min <= output_max:
        raise ValueError(f"trace: outputs [{output_min}, {output_max}] are not 1 <= min <= max")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        c = context_mean * rng.uniform(1 - context_spread, 1 + context_spread)
        c = max(64, int(round(c / 64)) * 64)
        if context_max is not None:
            c = min(c, context_max)
        out.append(Request(i, c, rng.randint(output_min, output_max)))
    return out


@dataclass
class RunLog:
    """What a run measured; `summary` condenses it."""
    backend: str
    step_seconds: list = field(default_factory=list)
    step_batch: list = field(default_factory=list)
    step_tag: list = field(default_factory=list)    # per step: "" or the A/B arm (e.g. "on"/"off")
    fill_seconds: float = 0.0                       # time of the synthetic context fills
    filled_tokens: int = 0
    kv_bytes_per_token: list = field(default_factory=list)  # samples, one per admission round
    finished: list = field(default_factory=list)    # Requests, in finishing order
    refused: int = 0                                # admissions that passed can_admit but failed
    unfinished: list = field(default_factory=list)  # Requests still running when the run stopped


def exact_fits(req, running, bytes_per_token, budget):
    """Admission of a cache that holds every request's context and output exactly (the BF16 peer):
    the new request's tokens plus every running request's whole reservation within the budget."""
    held = sum(r.context + r.output for r in running)
    return (held + req.context + req.output) * bytes_per_token <= budget


def kvq_fits(cache, req, running):
    """Admission by kvq's own accounting: what the new request's context and output take
    (`bytes_for` of a new sequence, its window's ring block included) plus what every running
    request's remaining tokens will take (`bytes_for` of the sequence), within the free bytes."""
    need = cache.bytes_for(req.context + req.output)
    need += sum(cache.bytes_for(r.remaining, r.rid) for r in running if r.remaining > 0)
    return need <= cache.stats()["free_bytes"]


def p90(xs):
    """The 90th percentile (nearest rank) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.9 * len(s)) - 1))]


def run_trace(backend, trace, max_batch, log, max_steps=None, tagger=None, progress=None, warmup=0):
    """Continuous batching over `trace` (all requests waiting at the start, served in order):
    before each step, finished requests leave and waiting ones are admitted in order while the
    backend says they fit (the first that does not fit waits, and so do those behind it); then
    one decode step for every running request. `tagger(step)` may return an A/B arm tag for a
    step (called before it). Stops when every request finished or after `max_steps` steps.
    Step times are the backend's step only; admissions (context fills) are timed apart."""
    waiting = list(trace)
    running = []
    step = 0
    while (waiting or running) and (max_steps is None or step < max_steps):
        admitted = 0
        while waiting and len(running) < max_batch and backend.can_admit(waiting[0], running):
            r = waiting[0]
            t0 = time.perf_counter()
            ok = backend.admit(r)
            log.fill_seconds += time.perf_counter() - t0
            if not ok:
                log.refused += 1
                break
            waiting.pop(0)
            log.filled_tokens += r.context
            running.append(r)
            admitted += 1
        if admitted:
            log.kv_bytes_per_token.append(backend.kv_bytes_per_token())
        if not running:
            raise RuntimeError(f"{log.backend}: request {waiting[0].rid} (context {waiting[0].context}, output "
                               f"{waiting[0].output}) does not fit in an empty cache")
        tag = tagger(step) if tagger else ""
        seconds = backend.step(running)
        counted = step >= warmup
        if counted:
            log.step_seconds.append(seconds)
            log.step_batch.append(len(running))
            log.step_tag.append(tag)
        still = []
        for r in running:
            r.done += 1
            if counted:
                r.step_times.append(seconds)
            if r.remaining == 0:
                backend.release(r)
                log.finished.append(r)
            else:
                still.append(r)
        running = still
        step += 1
        if progress:
            progress(step, running, waiting, log)
    log.unfinished = list(running)
    return running, waiting


def summary(log):
    """The numbers the report needs: decode tokens/s (output tokens over decode time), time per
    output token over the requests that decoded (finished or still running at the end; mean and p90
    of each request's mean step time: every running request gets one token per step), the largest
    batch, KV bytes per token, fill time."""
    decode_s = sum(log.step_seconds)
    tokens = sum(log.step_batch)
    tpot = [sum(r.step_times) / len(r.step_times) for r in log.finished + log.unfinished if r.step_times]
    out = {
        "backend": log.backend,
        "steps": len(log.step_seconds),
        "output_tokens": tokens,
        "decode_s": decode_s,
        "tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,
        "tpot_ms_mean": 1e3 * sum(tpot) / len(tpot) if tpot else float("nan"),
        "tpot_ms_p90": 1e3 * p90(tpot) if tpot else float("nan"),
        "step_ms_mean": 1e3 * decode_s / len(log.step_seconds) if log.step_seconds else float("nan"),
        "max_batch": max(log.step_batch) if log.step_batch else 0,
        "mean_batch": tokens / len(log.step_batch) if log.step_batch else 0.0,
        "finished": len(log.finished),
        "kv_bytes_per_token": (sum(log.kv_bytes_per_token) / len(log.kv_bytes_per_token)
                               if log.kv_bytes_per_token else float("nan")),
        "refused": log.refused,
        "fill_s": log.fill_seconds,
        "filled_tokens": log.filled_tokens,
    }
    out.update(ab_summary(log))
    return out


def ab_summary(log, a="on", b="off"):
    """Paired A/B over interleaved blocks of steps tagged `a` and `b`: the mean step time of each
    arm and the relative difference (a - b) / b from adjacent block pairs, with its standard error.
    Empty when the run has no tags."""
    blocks = []  # [tag, step seconds] of each maximal run of one tag
    for t, s in zip(log.step_tag, log.step_seconds):
        if t and blocks and blocks[-1][0] == t:
            blocks[-1][1].append(s)
        elif t:
            blocks.append([t, [s]])
    means = [(t, sum(x) / len(x)) for t, x in blocks]
    pairs = [(means[i][1], means[i + 1][1]) if means[i][0] == a else (means[i + 1][1], means[i][1])
             for i in range(0, len(means) - 1, 2) if {means[i][0], means[i + 1][0]} == {a, b}]
    if not pairs:
        return {}
    rel = [(x - y) / y for x, y in pairs]
    mean = sum(rel) / len(rel)
    sem = (math.sqrt(sum((r - mean) ** 2 for r in rel) / (len(rel) - 1) / len(rel)) if len(rel) > 1 else float("nan"))
    arm = {t: [s for tt, s in zip(log.step_tag, log.step_seconds) if tt == t] for t in (a, b)}
    return {
        f"step_ms_{a}": 1e3 * sum(arm[a]) / len(arm[a]),
        f"step_ms_{b}": 1e3 * sum(arm[b]) / len(arm[b]),
        "ab_pairs": len(pairs),
        "ab_overhead_pct": 100 * mean,
        "ab_overhead_sem_pct": 100 * sem,
    }
