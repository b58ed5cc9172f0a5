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

and, for a run with preemption (`run_trace(preempt="swap" | "recompute")`), five more:
  fits_now(req, running) -> bool    whether req fits by what it needs now (its stored tokens and the
                                    next step's token) beside the next step of every running request
  step_fits(running) -> bool        whether the next step's token of every running request fits
  preempt(req) -> str               takes req out of the cache: "swap" (its bytes moved to host swap
                                    space, resumed bit for bit) or "recompute" (released; resumed by
                                    prefilling its prompt and generated tokens again)
  resume(req) -> bool               brings a preempted req back as preempt left it; False (nothing
                                    held, still preempted) when the cache refused it after all
  swap_traffic() -> (out, in)       bytes swapped out and in since creation (optional; kvq's stats)
KvqPreempt implements the five over a kvq cache for serve.py's kvq backend and the CPU tests. With
preemption on, a step may also raise StepRefused (the cache refused it although step_fits said it
fits, with nothing of it left stored): the newest running request is preempted and the step retried.
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
    preemptions: int = 0           # times it was preempted
    preempted_by: str = ""         # while preempted: how it left the cache ("swap" or "recompute")
    recomputed: int = 0            # tokens prefilled again for it (recompute resumptions)
    next_bytes: int = 0            # swap: budget bytes its next token took when it was swapped out

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
    refused: int = 0                                # admissions (resumptions) that passed can_admit (fits_now) but failed
    unfinished: list = field(default_factory=list)  # Requests still running (or preempted) when the run stopped
    # preemption (run_trace's `preempt`; all zero when it is "off")
    preempt: str = "off"
    step_preempt_seconds: list = field(default_factory=list)  # per counted step: preempt + resume time before it
    preemptions: int = 0
    swap_outs: int = 0                              # preemptions by swap_out
    swap_fallbacks: int = 0                         # swap mode: preemptions released instead (swap space full)
    resumes: int = 0
    swap_ins: int = 0                               # resumptions by swap_in
    recomputed_tokens: int = 0                      # tokens prefilled again by recompute resumptions
    swap_out_seconds: float = 0.0                   # whole run (warm-up included), each call synchronized
    swap_in_seconds: float = 0.0
    recompute_seconds: float = 0.0                  # releases and re-prefills of recompute preemptions
    swapped_out_bytes: int = 0                      # the backend's swap_traffic() at the end of the run
    swapped_in_bytes: int = 0
    max_preempted: int = 0                          # most requests preempted at once
    step_retries: int = 0                           # steps the cache refused although step_fits said they fit


class StepRefused(Exception):
    """A decode step the cache refused although `step_fits` said it fits (kvq: the free bytes lie in
    pieces smaller than a page block, or two sequences counted the same free window lanes); the
    backend left nothing of the step stored."""


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


def exact_step_fits(running, bytes_per_token, budget):
    """Preemption, a cache of exact bytes (the BF16 peer): every running request's stored tokens
    and next token within the budget."""
    return sum(r.length + 1 for r in running) * bytes_per_token <= budget


def exact_fits_now(req, running, bytes_per_token, budget):
    """Admission by current need, a cache of exact bytes: the request's stored tokens (its context,
    or context and generated tokens when it resumes by recompute) and its next token beside the
    running requests' next step."""
    return (sum(r.length + 1 for r in running) + req.length + 1) * bytes_per_token <= budget


def kvq_step_bytes(cache, running):
    """Budget bytes the next decode step takes: `bytes_for(1, seq)` of every running sequence (zero
    for most; a page's blocks where a sequence's window fills and a page is encoded)."""
    return sum(cache.bytes_for(1, r.rid) for r in running)


def kvq_step_fits(cache, running):
    """Preemption by kvq's own accounting: the running sequences' next tokens within the free bytes."""
    return kvq_step_bytes(cache, running) <= cache.stats()["free_bytes"]


def kvq_fits_now(cache, req, running):
    """Admission (and resumption) by current need, kvq's accounting: what the request takes now
    plus the running sequences' next step, within the free bytes. A new sequence (or one resumed by
    recompute) takes `bytes_for(length + 1)`: its stored tokens and the step's token; a swapped-out
    one `swap_in_bytes` plus what its next token took when it left (`next_bytes`: bytes_for refuses
    a swapped-out sequence; swap_in restores it bit for bit, so its next token takes the same)."""
    if cache.is_swapped(req.rid):
        need = cache.swap_in_bytes(req.rid) + req.next_bytes
    else:
        need = cache.bytes_for(req.length + 1)
    return need + kvq_step_bytes(cache, running) <= cache.stats()["free_bytes"]


class KvqPreempt:
    """The kvq half of a backend with preemption (bench/serve/README.md, "Preemption"), torch-free:
    serve.py's KvqBackend (CUDA, torch tensors) and test_serve.py's CPU backend (numpy) share it.
    The class it is mixed into provides `cache` (a kvq.Cache), `preempt_mode` ("swap" or
    "recompute"), `fill(req, tokens)` (writes a new sequence's first `tokens` tokens), `refill(req)`
    (writes the req.length tokens of its re-created sequence: the recompute prefill) and `sync()`
    (waits for the cache's stream: swaps and fills are asynchronous on it)."""

    def can_admit(self, req, running):
        return kvq_fits(self.cache, req, running)

    def admit(self, req):
        """A new sequence with the request's context; False, with nothing held, when the cache
        refuses it (OutOfBudget)."""
        import kvq
        try:
            self.cache.create_sequence(req.rid)
        except kvq.OutOfBudget:
            return False
        try:
            self.fill(req, req.context)
        except kvq.OutOfBudget:
            self.cache.release_sequence(req.rid)
            return False
        self.sync()
        return True

    def fits_now(self, req, running):
        return kvq_fits_now(self.cache, req, running)

    def step_fits(self, running):
        return kvq_step_fits(self.cache, running)

    def preempt(self, req):
        """swap: `swap_out` (the sequence keeps its id and lengths; its budget bytes and slot are
        freed), its next token's bytes noted for its resumption; when the swap space is full
        (OutOfBudget, nothing changed) it is released instead. recompute: `release_sequence`."""
        import kvq
        if self.preempt_mode == "swap":
            req.next_bytes = self.cache.bytes_for(1, req.rid)
            try:
                self.cache.swap_out(req.rid)
                self.sync()  # the copy runs asynchronously on the stream: its time is the preemption's
                return "swap"
            except kvq.OutOfBudget:
                pass
        self.cache.release_sequence(req.rid)
        return "recompute"

    def resume(self, req):
        """`swap_in` of a swapped-out sequence, or a new sequence of its prompt and generated tokens
        (`refill`); False, with nothing held, when the cache refuses it (OutOfBudget)."""
        import kvq
        if req.preempted_by == "swap":
            try:
                self.cache.swap_in(req.rid)
            except kvq.OutOfBudget:
                return False
            self.sync()
            return True
        try:
            self.cache.create_sequence(req.rid)
        except kvq.OutOfBudget:
            return False
        try:
            self.refill(req)
        except kvq.OutOfBudget:
            self.cache.release_sequence(req.rid)
            return False
        self.sync()
        return True

    def swap_traffic(self):
        st = self.cache.stats()
        return st["swapped_out_bytes"], st["swapped_in_bytes"]

    def refuse_step(self, running, layer, error):
        """A decode step's append of `layer` refused (`error`, kvq.OutOfBudget: nothing of that call
        stored) although kvq_step_fits counted the bytes free: kvq's byte count does not see the
        arena's free ranges. Cuts the layers before it back to the sequences' lengths before the
        step (`truncate`) and raises StepRefused."""
        if layer > 0:
            for r in running:
                self.cache.truncate(r.rid, r.length)
        raise StepRefused(f"layer {layer}: {error}") from error


def p90(xs):
    """The 90th percentile (nearest rank) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.9 * len(s)) - 1))]


PREEMPT_MODES = ("off", "swap", "recompute")


def run_trace(backend, trace, max_batch, log, max_steps=None, tagger=None, progress=None, warmup=0, preempt="off"):
    """Continuous batching over `trace` (all requests waiting at the start, served in order):
    before each step, finished requests leave and waiting ones are admitted in order while the
    backend says they fit (the first that does not fit waits, and so do those behind it); then
    one decode step for every running request. `tagger(step)` may return an A/B arm tag for a
    step (called before it). Stops when every request finished or after `max_steps` steps.
    Step times are the backend's step only; admissions (context fills) are timed apart.

    preempt "off": a request is admitted only with its whole output reserved (`can_admit`), so
    none is ever preempted. "swap" or "recompute" (the backend's `preempt` does what its mode
    says): before each step, preempted requests resume first, oldest first, while they fit
    (`fits_now`: what they need now); new requests are admitted only when none is preempted, by
    what they need now (their context and the step's token) rather than their whole output; then,
    while the step does not fit (`step_fits`: the running requests' next tokens), the newest
    running request is preempted. The preemptions and resumptions before a step are timed
    (`step_preempt_seconds`, each call synchronized by the backend) and are part of the run's
    time (summary's tokens_per_s). Should the cache refuse the step all the same (StepRefused,
    nothing of it stored), the newest is preempted and the step retried (`step_retries`; the
    refused attempt's time counts as preemption time). Every preempted request arrived after
    every running one (the newest is the one preempted, and new requests wait while any is
    preempted), so `running` stays in arrival order with the newest last, and `preempted` oldest
    first."""
    if preempt not in PREEMPT_MODES:
        raise ValueError(f"run_trace: preempt = {preempt!r}, not one of {PREEMPT_MODES}")
    preempting = preempt != "off"
    fits = backend.fits_now if preempting else backend.can_admit
    log.preempt = preempt
    waiting = list(trace)
    running = []
    preempted = []
    step = 0

    def preempt_newest():
        """Preempts the newest running request (into `preempted`, oldest first); its seconds."""
        r = running.pop()
        t0 = time.perf_counter()
        kind = backend.preempt(r)
        seconds = time.perf_counter() - t0
        if kind == "swap":
            log.swap_outs += 1
            log.swap_out_seconds += seconds
        else:
            if preempt == "swap":  # the swap space was full
                log.swap_fallbacks += 1
            log.recompute_seconds += seconds
        log.preemptions += 1
        r.preemptions += 1
        r.preempted_by = kind
        preempted.insert(0, r)  # older than every request preempted before (see above)
        if not running:
            raise RuntimeError(f"{log.backend}: request {r.rid} (context {r.context}, {r.done} of {r.output} "
                               "produced): its next token does not fit in an empty cache")
        return seconds

    while (waiting or running or preempted) and (max_steps is None or step < max_steps):
        moved = 0.0  # seconds of this round's preemptions and resumptions
        resumed = 0
        while preempted and len(running) < max_batch and backend.fits_now(preempted[0], running):
            r = preempted[0]
            t0 = time.perf_counter()
            ok = backend.resume(r)
            seconds = time.perf_counter() - t0
            moved += seconds
            if not ok:
                log.refused += 1
                break
            preempted.pop(0)
            if r.preempted_by == "swap":
                log.swap_ins += 1
                log.swap_in_seconds += seconds
            else:
                log.recompute_seconds += seconds
                log.recomputed_tokens += r.length
                r.recomputed += r.length
            log.resumes += 1
            r.preempted_by = ""
            running.append(r)
            resumed += 1
        admitted = 0
        while not preempted and waiting and len(running) < max_batch and fits(waiting[0], running):
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
        if admitted or resumed:
            log.kv_bytes_per_token.append(backend.kv_bytes_per_token())
        if not running:
            r = preempted[0] if preempted else waiting[0]
            raise RuntimeError(f"{log.backend}: request {r.rid} (context {r.context}, output {r.output}"
                               + (f", {r.done} produced" if r.done else "") + ") does not fit in an empty cache")
        tag = tagger(step) if tagger else ""
        while True:
            while preempting and not backend.step_fits(running):
                moved += preempt_newest()
            t0 = time.perf_counter()
            try:
                seconds = backend.step(running)
                break
            except StepRefused:
                if not preempting:
                    raise
                log.step_retries += 1
                moved += time.perf_counter() - t0 + preempt_newest()
        log.max_preempted = max(log.max_preempted, len(preempted))
        counted = step >= warmup
        if counted:
            log.step_seconds.append(seconds)
            log.step_batch.append(len(running))
            log.step_tag.append(tag)
            log.step_preempt_seconds.append(moved)
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
    log.unfinished = list(running) + list(preempted)
    if preempting and hasattr(backend, "swap_traffic"):
        log.swapped_out_bytes, log.swapped_in_bytes = backend.swap_traffic()
    return running, waiting


def summary(log):
    """The numbers the report needs: decode tokens/s (output tokens over decode time, the
    preemptions and resumptions before the counted steps included), time per output token over the
    requests that decoded (finished or still running at the end; mean and p90 of each request's
    mean step time: every running request gets one token per step), the largest batch, KV bytes per
    token, fill time; with preemption, its counts, traffic and times (`preempt_summary`)."""
    decode_s = sum(log.step_seconds)
    preempt_s = sum(log.step_preempt_seconds)
    tokens = sum(log.step_batch)
    tpot = [sum(r.step_times) / len(r.step_times) for r in log.finished + log.unfinished if r.step_times]
    out = {
        "backend": log.backend,
        "steps": len(log.step_seconds),
        "output_tokens": tokens,
        "decode_s": decode_s,
        "tokens_per_s": tokens / (decode_s + preempt_s) if decode_s > 0 else 0.0,
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
    out.update(preempt_summary(log))
    out.update(ab_summary(log))
    return out


def preempt_summary(log):
    """A run with preemption: the mode; decode tokens/s of the steps alone (beside tokens_per_s,
    which counts the preemption time too) and that time (`preempt_s`, over the counted steps);
    preemptions (by swap, and swap's fallbacks to recompute when the swap space was full),
    resumptions, the most preempted at once, the swap traffic (the backend's, from kvq's stats), the
    tokens prefilled again, and the whole run's seconds in swap_out, swap_in and recompute (releases
    and re-prefills; warm-up included). Empty when preemption is off."""
    if log.preempt == "off":
        return {}
    decode_s = sum(log.step_seconds)
    return {
        "preempt": log.preempt,
        "step_tokens_per_s": sum(log.step_batch) / decode_s if decode_s > 0 else 0.0,
        "preempt_s": sum(log.step_preempt_seconds),
        "preemptions": log.preemptions,
        "swap_outs": log.swap_outs,
        "swap_fallbacks": log.swap_fallbacks,
        "resumes": log.resumes,
        "swap_ins": log.swap_ins,
        "max_preempted": log.max_preempted,
        "step_retries": log.step_retries,
        "swapped_out_bytes": log.swapped_out_bytes,
        "swapped_in_bytes": log.swapped_in_bytes,
        "recomputed_tokens": log.recomputed_tokens,
        "swap_out_s": log.swap_out_seconds,
        "swap_in_s": log.swap_in_seconds,
        "recompute_s": log.recompute_seconds,
    }


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
