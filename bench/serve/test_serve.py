#!/usr/bin/env python3
"""CPU-only tests of the serving benchmark's pieces (no torch, no GPU): the trace generator, the
scheduler and its admission rules with a fake backend, the A/B summary, and what the kvq backend
relies on through the kvq package on the CPU backend (bytes_for against what a fill takes,
admission, append_batch + attend against a hand computation, failed calls changing nothing, the
EchoKV canary switch); preemption (swap and recompute) with a fake backend and with kvq's CPU cache
(every request finishing, preemptions that a run without them shows to be needed, a swapped
sequence reading after swap_in what it read before, the swap traffic kvq's stats report, the
tokens recompute prefills again), and its report.

    PYTHONPATH=build/python python3 bench/serve/test_serve.py
"""
import json
import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvq  # noqa: E402  (the package: PYTHONPATH=<build>/python)
import report_serve  # noqa: E402
import serve  # noqa: E402  (torch-free parts only: torch is imported under a guard)
import serve_sched as ss  # noqa: E402

class FakeBackend:
    """A backend whose cache holds every request exactly (the peer's rule) and whose step takes
    1 ms per running request; it records the batches it saw."""

    def __init__(self, budget, bytes_per_token):
        self.budget, self.bpt = budget, bytes_per_token
        self.held = {}
        self.batches = []

    def can_admit(self, req, running):
        return ss.exact_fits(req, running, self.bpt, self.budget)

    def admit(self, req):
        self.held[req.rid] = (req.context + req.output) * self.bpt
        assert sum(self.held.values()) <= self.budget, "admitted past the budget"
        return True

    def step(self, running):
        self.batches.append([r.rid for r in running])
        return 1e-3 * len(running)

    def release(self, req):
        del self.held[req.rid]

    def kv_bytes_per_token(self):
        return float(self.bpt)


class OverBudget(AssertionError):
    """The fake cache held more tokens than its budget."""


class FakePreemptBackend(FakeBackend):
    """FakeBackend (1 byte a token) with preemption by exact tokens: it stores each request's
    tokens, its step adds one to every running request and raises OverBudget past the budget;
    preempt keeps a swapped request's tokens aside or drops them (recompute), resume brings them
    back or stores the request's length again. It records the preemptions and resumptions."""

    def __init__(self, budget, mode):
        super().__init__(budget, 1)
        self.mode = mode
        self.swapped = {}
        self.events = []     # ("preempt" | "resume", rid)
        self.refilled = 0    # tokens stored again by recompute resumptions
        self.refuse_at = None  # a batch size at which the next step is refused once (StepRefused)

    def admit(self, req):
        self.held[req.rid] = req.context
        assert sum(self.held.values()) <= self.budget, "admitted past the budget"
        return True

    def fits_now(self, req, running):
        return ss.exact_fits_now(req, running, 1, self.budget)

    def step_fits(self, running):
        return ss.exact_step_fits(running, 1, self.budget)

    def step(self, running):
        if self.refuse_at is not None and len(running) >= self.refuse_at:
            self.refuse_at = None
            raise ss.StepRefused("refused once")
        for r in running:
            assert self.held[r.rid] == r.length, (r.rid, self.held[r.rid], r.length)
            self.held[r.rid] += 1
        if sum(self.held.values()) > self.budget:
            raise OverBudget(f"{sum(self.held.values())} tokens held, budget {self.budget}")
        return super().step(running)

    def preempt(self, req):
        self.events.append(("preempt", req.rid))
        tokens = self.held.pop(req.rid)
        if self.mode == "swap":
            self.swapped[req.rid] = tokens
            return "swap"
        return "recompute"

    def resume(self, req):
        self.events.append(("resume", req.rid))
        if req.preempted_by == "swap":
            self.held[req.rid] = self.swapped.pop(req.rid)
        else:
            self.held[req.rid] = req.length
            self.refilled += req.length
        return True

    def release(self, req):
        assert self.held[req.rid] == req.context + req.output, "released before its last token"
        super().release(req)


class TraceTest(unittest.TestCase):
    def test_seeded_and_in_range(self):
        a = ss.make_trace(50, seed=3, context_mean=32768, context_spread=0.25, output_min=128, output_max=512)
        b = ss.make_trace(50, seed=3, context_mean=32768, context_spread=0.25, output_min=128, output_max=512)
        self.assertEqual([(r.context, r.output) for r in a], [(r.context, r.output) for r in b])
        c = ss.make_trace(50, seed=4)
        self.assertNotEqual([r.context for r in a], [r.context for r in c])
        for r in a:
            self.assertEqual(r.context % 64, 0)
            self.assertTrue(0.75 * 32768 - 64 <= r.context <= 1.25 * 32768 + 64, r.context)
            self.assertTrue(128 <= r.output <= 512)
        self.assertGreater(len({r.context for r in a}), 10, "contexts spread")
        self.assertTrue(all(r.context <= 30000 for r in ss.make_trace(20, 1, context_max=30000)))

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "n = 0"):
            ss.make_trace(0, 1)
        with self.assertRaisesRegex(ValueError, "context_spread"):
            ss.make_trace(5, 1, context_spread=1.0)
        with self.assertRaisesRegex(ValueError, "outputs"):
            ss.make_trace(5, 1, output_min=10, output_max=5)


class SchedulerTest(unittest.TestCase):
    def test_admission_within_budget_in_order(self):
        trace = [ss.Request(i, c, o) for i, (c, o) in enumerate([(1000, 10), (2000, 5), (500, 20), (3000, 1),
                                                                  (100, 3)])]
        be = FakeBackend(budget=4000 * 8, bytes_per_token=8)
        log = ss.RunLog("fake")
        running, waiting = ss.run_trace(be, trace, max_batch=8, log=log)
        self.assertEqual((running, waiting), ([], []))
        # 1010 + 2020 + 520 = 3550 tokens fit 4000; 3001 waits (first in line) until enough leaves
        self.assertEqual(be.batches[0], [0, 1, 2])
        first_with_3 = next(i for i, b in enumerate(be.batches) if 3 in b)
        self.assertEqual(first_with_3, 10, "request 3 waits for request 1 (5 steps) and 0 (10 steps)")
        self.assertNotIn(4, be.batches[first_with_3 - 1], "request 4 waits behind request 3 (in order)")
        self.assertEqual(log.step_batch, [len(b) for b in be.batches])
        s = ss.summary(log)
        self.assertEqual(s["output_tokens"], 10 + 5 + 20 + 1 + 3)
        self.assertEqual(s["finished"], 5)
        self.assertEqual(s["max_batch"], 3)
        self.assertEqual(s["filled_tokens"], 1000 + 2000 + 500 + 3000 + 100)
        self.assertAlmostEqual(s["tokens_per_s"], s["output_tokens"] / sum(log.step_seconds))
        # request 0 ran its 10 steps at batch 3, 3, 3, 3, 3, 2, ... : its TPOT is its mean step time
        r0 = next(r for r in log.finished if r.rid == 0)
        self.assertEqual(len(r0.step_times), 10)
        self.assertAlmostEqual(r0.step_times[0], 3e-3)

    def test_max_batch_and_too_big(self):
        trace = ss.make_trace(10, seed=1, context_mean=100, output_min=2, output_max=4)
        be = FakeBackend(budget=10 ** 9, bytes_per_token=1)
        log = ss.RunLog("fake")
        ss.run_trace(be, trace, max_batch=3, log=log)
        self.assertEqual(max(log.step_batch), 3)
        with self.assertRaisesRegex(RuntimeError, "does not fit in an empty cache"):
            ss.run_trace(FakeBackend(10, 1), [ss.Request(0, 100, 5)], 4, ss.RunLog("fake"))

    def test_max_steps_and_p90(self):
        log = ss.RunLog("fake")
        running, waiting = ss.run_trace(FakeBackend(10 ** 9, 1), ss.make_trace(4, 2, 100), 8, log, max_steps=7)
        self.assertEqual(len(log.step_seconds), 7)
        self.assertEqual(len(running), 4)
        self.assertEqual(ss.p90(list(range(1, 11))), 9)
        self.assertEqual(ss.p90([5.0]), 5.0)

    def test_ab_summary(self):
        log = ss.RunLog("fake")
        # blocks of 2 steps: on 1.1, off 1.0, on 1.1, off 1.0 -> +10 %
        for tag, s in [("on", 1.1), ("on", 1.1), ("off", 1.0), ("off", 1.0)] * 2:
            log.step_tag.append(tag)
            log.step_seconds.append(s)
        ab = ss.ab_summary(log)
        self.assertEqual(ab["ab_pairs"], 2)
        self.assertAlmostEqual(ab["ab_overhead_pct"], 10.0)
        self.assertAlmostEqual(ab["ab_overhead_sem_pct"], 0.0)
        self.assertEqual(ss.ab_summary(ss.RunLog("none")), {})


class WarmupAndReportTest(unittest.TestCase):
    def test_warmup_steps_left_out(self):
        log = ss.RunLog("fake")
        ss.run_trace(FakeBackend(10 ** 9, 1), [ss.Request(0, 10, 6), ss.Request(1, 10, 3)], 8, log, warmup=2)
        self.assertEqual(log.step_batch, [2, 1, 1, 1])
        self.assertEqual([len(r.step_times) for r in log.finished], [1, 4])
        self.assertEqual(ss.summary(log)["output_tokens"], 5)

    def test_report_table(self):
        runs = []
        for name, per_req, bpt in (("peer", 4e-3, 131072), ("kivi4/g32", 1e-3, 40000), ("echokv", 1e-3, 40000)):
            log = ss.RunLog(name)
            tagger = (lambda step: "on" if (step // 2) % 2 == 0 else "off") if name == "echokv" else None
            be = FakeBackend(10 ** 9, bpt)
            be.step = lambda running, per_req=per_req: per_req * len(running)
            ss.run_trace(be, ss.make_trace(6, 1, 1000, output_min=8, output_max=8), 4, log, tagger=tagger)
            runs.append(ss.summary(log))
        for r in runs:
            r["ratio_to_peer"] = r["tokens_per_s"] / runs[0]["tokens_per_s"]
        runs[1]["overhead_device_mib"] = 96.0
        meta = {"device": "fake", "sms": 1, "torch": "-", "cuda": "-", "date": "d", "commit": "c", "weights_gib": 1.0,
                "peer_attention": "varlen", "peer_kernels": {"batch": 8, "context": 32768, "sdpa_cudnn_us": 250.0,
                                                             "sdpa_flash_us": None, "varlen_flash_us": 270.5},
                "trace": {"requests": 6, "context_min": 1, "context_max": 2,
                                                      "context_mean": 1.5, "output_mean": 8},
                "args": {"layers": 2, "kv_gib": 1, "max_steps": 10, "warmup_steps": 0, "canary_block": 2}}
        md = report_serve.table({"meta": meta, "results": runs + [{"backend": "sym8", "error": "KvqError: boom"}]})
        self.assertIn("- sym8 failed: KvqError: boom", md)
        self.assertIn("outside the KV memory: kivi4/g32 96 MiB.", md)
        self.assertIn("| kivi4/g32 | ", md)
        self.assertIn("kivi4/g32 4.00x, met.", md)
        self.assertIn("at 8 x 32768 (equal lengths): sdpa cudnn 250.0 us, varlen flash 270.5 us.", md)
        self.assertIn("canary adds <= 0.1 % to the time per output token: +0.000 %", md)
        self.assertIn("on and off in the same run; step", md)
        # the verdict follows the two-standard-error bounds of the difference
        ab = next(r for r in runs if "ab_pairs" in r)
        for d, e, verdict in ((0.05, 0.01, "), met."), (-1.4, 0.5, "met (the difference is below zero"),
                              (0.05, 0.2, "not resolved by this run"), (1.0, 0.1, "), missed.")):
            ab["ab_overhead_pct"], ab["ab_overhead_sem_pct"] = d, e
            self.assertIn(verdict, report_serve.table({"meta": meta, "results": runs}))
        self.assertEqual(md.count("\n| "), 5, md)  # header, rule, three rows


class CanaryTaggerTest(unittest.TestCase):
    def test_blocks_alternate_and_switch_the_backend(self):
        class Switch:
            calls = []

            def set_canary(self, on):
                self.calls.append(on)

        sw = Switch()
        tag = serve.canary_tagger(sw, 2)
        self.assertEqual([tag(i) for i in range(6)], ["on", "on", "off", "off", "on", "on"])
        self.assertEqual(sw.calls, [True, True, False, False, True, True])


class RangeAllocatorTest(unittest.TestCase):
    def test_first_fit_and_coalescing(self):
        a = serve.RangeAllocator(100)
        self.assertEqual([a.take(30), a.take(30), a.take(30)], [0, 30, 60])
        self.assertIsNone(a.take(20))
        a.give(30, 30)
        self.assertEqual(a.take(20), 30)
        a.give(0, 30)
        a.give(30, 20)
        self.assertEqual(a.free, [(0, 60), (90, 100)])
        self.assertIsNone(a.take(61))
        self.assertEqual(a.take(60), 0)


class PackageTest(unittest.TestCase):
    """What serve.py's kvq backend relies on, through the kvq package on the CPU backend."""
    L, HQ, H, D = 2, 4, 2, 64

    def cache(self, policy="fp16", budget=8 << 20):
        return kvq.Cache(self.L, self.HQ, self.H, self.D, serve.POLICIES.get(policy, policy), budget_bytes=budget,
                         max_sequences=8, max_tokens=4096, check_values=False)

    def rows(self, tokens, value):
        return np.full((tokens, self.H, self.D), value, np.float32)

    def test_create_errors(self):
        with self.assertRaises(kvq.InvalidArgument) as e:
            self.cache("kivi5/g32")
        self.assertIn("kivi5", str(e.exception))

    def test_bytes_for_is_what_a_fill_takes(self):
        rng = np.random.default_rng(0)
        for policy in ("fp16", "kivi4/g32", "sym8"):
            c = self.cache(policy)
            tokens = 300
            predicted = c.bytes_for(tokens)
            free0 = c.stats()["free_bytes"]
            c.create_sequence(7)
            k = rng.standard_normal((tokens, self.H, self.D)).astype(np.float32)
            for layer in range(self.L):
                c.append(7, layer, k, k)
            self.assertEqual(free0 - c.stats()["free_bytes"], predicted, policy)
            self.assertEqual(c.stats()["tokens"], tokens * self.L)
            self.assertGreater(c.bytes_for(200, 7), 0)
            c.release_sequence(7)
            self.assertEqual(c.stats()["free_bytes"], free0)

    def test_kvq_admission(self):
        def first_request_held(budget):
            c = self.cache("fp16", budget=budget)
            c.create_sequence(1)
            for layer in range(self.L):
                c.append(1, layer, self.rows(200, 0.5), self.rows(200, 0.5))
            return c

        first, second = ss.Request(1, 200, 150), ss.Request(2, 200, 150)
        c = first_request_held(4 << 20)
        used, one, reserve = c.stats()["used_bytes"], c.bytes_for(350), c.bytes_for(150, 1)
        self.assertGreater(reserve, 0)
        self.assertFalse(ss.kvq_fits(c, ss.Request(2, 20000, 50), [first]))
        # the second request fits exactly when its bytes and the first's remaining 150 tokens fit
        for budget, fits in ((used + one + reserve, True), (used + one + reserve - 256, False)):
            c = first_request_held(budget)
            self.assertEqual(c.bytes_for(350), one)
            self.assertEqual(ss.kvq_fits(c, second, [first]), fits, budget)

    def test_decode_step_as_the_backend_issues_it(self):
        c = self.cache("fp16")
        for s in (3, 5):
            c.create_sequence(s)
        # sequence 3 gets V rows of 1.0 then 3.0, sequence 5 rows of 2.0 then 4.0; K zero, so q
        # attends uniformly and the output is the mean of the V rows; K and V are token-strided
        # views of one fused buffer, as serve.py's QKV output
        for vals in ([1.0, 2.0], [3.0, 4.0]):
            fused = np.zeros((2, 2 * self.H, self.D), np.float32)
            fused[0, self.H:], fused[1, self.H:] = vals
            for layer in range(self.L):
                c.append_batch([3, 5], [1, 1], layer, fused[:, :self.H], fused[:, self.H:])
        o = c.attend([3, 5], 1, np.full((2, self.HQ, self.D), 0.3, np.float32))
        np.testing.assert_allclose(o[0], 2.0, atol=1e-3)
        np.testing.assert_allclose(o[1], 3.0, atol=1e-3)
        st = c.stats()
        self.assertEqual(st["tokens"], 2 * 2 * self.L)
        with self.assertRaises(kvq.NotFound):
            c.append_batch([3, 9], [1, 1], 0, self.rows(2, 0.0), self.rows(2, 0.0))
        self.assertEqual(c.stats(), st)
        with self.assertRaises(kvq.Unsupported):
            c.freeze_policy(True)

    def test_echokv_canary_switch(self):
        c = self.cache("echokv")
        self.assertIn("echokv", c.policy)
        c.freeze_policy(True)
        c.freeze_policy(False)
        c.sync_policy()


class PreemptSchedulerTest(unittest.TestCase):
    """The preemption scheduling with the fake backend: 4 requests of 100 + 50 tokens and one of
    100 + 20 in 420 tokens. Reserving whole outputs admits two (3 x 150 > 420); by current need all
    four (4 x 101), until their growth no longer fits: after 5 steps 4 x 106 > 420 (request 3, the
    newest, preempted), after 40 steps 3 x 141 > 420 (request 2); when 0 and 1 finish (step 50), 2
    and 3 resume, oldest first, and only then is 4 admitted."""

    @staticmethod
    def trace():
        return [ss.Request(i, 100, 50) for i in range(4)] + [ss.Request(4, 100, 20)]

    def run_mode(self, mode, backend=None):
        be = backend or FakePreemptBackend(420, mode)
        log = ss.RunLog("fake")
        running, waiting = ss.run_trace(be, self.trace(), 8, log, preempt=mode)
        self.assertEqual((running, waiting, log.unfinished), ([], [], []))
        return be, log

    def test_whole_output_reserved_admits_fewer(self):
        be = FakePreemptBackend(420, "swap")
        ss.run_trace(be, self.trace(), 8, ss.RunLog("fake"))
        self.assertEqual(be.batches[0], [0, 1])
        self.assertEqual(be.events, [], "no preemption when outputs are reserved")

    def test_admission_by_current_need_alone_overflows(self):
        # (b): admitted by what they need now and never preempted, the fifth step holds 424 tokens
        # (the preemption runs below take the same trace and budget, and the same check)
        be = FakePreemptBackend(420, "swap")
        be.can_admit = be.fits_now
        with self.assertRaisesRegex(OverBudget, "424 tokens held, budget 420"):
            ss.run_trace(be, self.trace(), 8, ss.RunLog("fake"))
        self.assertEqual(len(be.batches), 5)

    def test_swap_and_recompute(self):
        for mode in ("swap", "recompute"):
            with self.subTest(mode=mode):
                be, log = self.run_mode(mode)
                # (a) every request finished with its tokens (the fake checks each step's lengths)
                self.assertEqual(sorted((r.rid, r.done) for r in log.finished),
                                 [(0, 50), (1, 50), (2, 50), (3, 50), (4, 20)])
                self.assertEqual(be.held, {})
                self.assertEqual(be.batches[0], [0, 1, 2, 3])
                # the newest preempted first, the oldest resumed first, 4 admitted after them
                self.assertEqual(be.events, [("preempt", 3), ("preempt", 2), ("resume", 2), ("resume", 3)])
                self.assertEqual(be.batches[5], [0, 1, 2])
                self.assertEqual(be.batches[40], [0, 1])
                self.assertEqual(be.batches[50], [2, 3, 4])
                self.assertEqual((log.preemptions, log.resumes, log.max_preempted), (2, 2, 2))
                self.assertEqual(sum(log.step_batch), 4 * 50 + 20)
                s = ss.summary(log)
                self.assertEqual(s["preempt"], mode)
                self.assertEqual((s["preemptions"], s["resumes"], s["step_retries"]), (2, 2, 0))
                self.assertEqual(len(log.step_preempt_seconds), len(log.step_seconds))
                self.assertAlmostEqual(s["tokens_per_s"], s["output_tokens"] / (s["decode_s"] + s["preempt_s"]))
                self.assertGreaterEqual(s["step_tokens_per_s"], s["tokens_per_s"])
                if mode == "swap":
                    self.assertEqual((s["swap_outs"], s["swap_ins"], s["recomputed_tokens"]), (2, 2, 0))
                else:
                    # (d) request 2 left at 100 + 40 tokens, request 3 at 100 + 5
                    self.assertEqual((s["swap_outs"], s["swap_ins"]), (0, 0))
                    self.assertEqual(s["recomputed_tokens"], 140 + 105)
                    self.assertEqual(be.refilled, 140 + 105)
                    self.assertEqual({r.rid: r.recomputed for r in log.finished}, {0: 0, 1: 0, 2: 140, 3: 105, 4: 0})

    def test_refused_step_is_retried_without_the_newest(self):
        be = FakePreemptBackend(420, "swap")
        be.refuse_at = 4
        be, log = self.run_mode("swap", be)
        self.assertEqual(log.step_retries, 1)
        self.assertEqual(be.batches[0], [0, 1, 2], "the first step refused with 4, retried with 3")
        self.assertEqual(be.events[0], ("preempt", 3))
        self.assertEqual(sorted(r.done for r in log.finished), [20, 50, 50, 50, 50])
        be = FakePreemptBackend(10 ** 6, "swap")
        be.refuse_at = 1
        with self.assertRaises(ss.StepRefused):  # without preemption, a refused step is the run's failure
            ss.run_trace(be, self.trace(), 8, ss.RunLog("fake"))

    def test_too_big_and_bad_mode(self):
        with self.assertRaisesRegex(RuntimeError, "does not fit in an empty cache"):
            ss.run_trace(FakePreemptBackend(100, "swap"), [ss.Request(0, 100, 5)], 4, ss.RunLog("fake"),
                         preempt="swap")
        with self.assertRaisesRegex(RuntimeError, r"request 0 \(context 100, 2 of 5 produced\): its next token"):
            ss.run_trace(FakePreemptBackend(102, "swap"), [ss.Request(0, 100, 5)], 4, ss.RunLog("fake"),
                         preempt="swap")
        with self.assertRaisesRegex(ValueError, "preempt = 'sometimes'"):
            ss.run_trace(FakePreemptBackend(100, "swap"), [], 4, ss.RunLog("fake"), preempt="sometimes")
        self.assertEqual(ss.preempt_summary(ss.RunLog("off")), {})


class CpuKvqBackend(ss.KvqPreempt):
    """serve.py's kvq backend on kvq's CPU cache with numpy rows: the same scheduling calls and the
    same preemption (serve_sched.KvqPreempt). Token t of request r has K and V values of its own
    (`rows`), so a re-prefill writes what the sequence held. Records, at each preemption, what the
    sequence read (every layer's K and V) and its length; compares a swapped sequence's reads after
    swap_in with them; tracks the swap space each swap moves (stats' swap_used_bytes before and
    after) and the problems it saw (`problems`, for the test to assert empty)."""
    L, HQ, H, D = 2, 4, 2, 64

    def __init__(self, policy, budget, mode, swap_bytes=64 << 20, max_batch=8):
        self.cache = kvq.Cache(self.L, self.HQ, self.H, self.D, policy, budget_bytes=budget, max_sequences=max_batch,
                               max_tokens=4096, check_values=False, swap_bytes=swap_bytes)
        self.preempt_mode = mode
        self.refilled = 0           # tokens written by refill (recompute's re-prefill)
        self.released_tokens = 0    # lengths of the sequences preempted by release (recompute)
        self.reads = {}             # rid -> what it read when last preempted
        self.swap_checks = 0        # swap_ins whose reads were compared
        self.moved = [0, 0]         # swap space taken by swap_outs, given back by swap_ins
        self.problems = []

    def rows(self, rid, start, n, role):
        pos = np.arange(start, start + n, dtype=np.float32)[:, None, None]
        ch = np.arange(self.H * self.D, dtype=np.float32).reshape(1, self.H, self.D)
        return np.sin(0.37 * rid + (1.1 if role == "v" else 0.0) + 0.013 * pos * (1 + ch / 32)).astype(np.float32)

    def read_all(self, rid):
        return [self.cache.read(rid, layer, role) for layer in range(self.L) for role in "kv"]

    def fill(self, req, tokens):
        for layer in range(self.L):
            self.cache.append(req.rid, layer, self.rows(req.rid, 0, tokens, "k"), self.rows(req.rid, 0, tokens, "v"))

    def refill(self, req):
        self.fill(req, req.length)
        self.refilled += req.length

    def sync(self):
        pass

    def step(self, running):
        k = np.concatenate([self.rows(r.rid, r.length, 1, "k") for r in running])
        v = np.concatenate([self.rows(r.rid, r.length, 1, "v") for r in running])
        q = np.full((len(running), self.HQ, self.D), 0.1, np.float32)
        seqs = [r.rid for r in running]
        for layer in range(self.L):  # as serve.py's KvqBackend.attend
            try:
                self.cache.append_batch(seqs, [1] * len(seqs), layer, k, v)
            except kvq.OutOfBudget as e:
                self.refuse_step(running, layer, e)
            self.cache.attend(seqs, layer, q)
        return 1e-3 * len(running)

    def release(self, req):
        self.cache.release_sequence(req.rid)

    def kv_bytes_per_token(self):
        st = self.cache.stats()
        return st["used_bytes"] * self.L / st["tokens"] if st["tokens"] else float("nan")

    def preempt(self, req):
        self.reads[req.rid] = self.read_all(req.rid)
        used = self.cache.stats()["swap_used_bytes"]
        kind = super().preempt(req)
        self.moved[0] += self.cache.stats()["swap_used_bytes"] - used
        if kind == "recompute":
            self.released_tokens += req.length
        elif not self.cache.is_swapped(req.rid):
            self.problems.append(f"{req.rid}: not swapped out after swap_out")
        else:
            try:  # a swapped-out sequence refuses attention
                self.cache.attend([req.rid], 0, np.zeros((1, self.HQ, self.D), np.float32))
                self.problems.append(f"{req.rid}: attended while swapped out")
            except kvq.InvalidArgument as e:
                if "swapped out" not in str(e):
                    self.problems.append(f"{req.rid}: {e}")
        return kind

    def resume(self, req):
        used = self.cache.stats()["swap_used_bytes"]
        swapped = req.preempted_by == "swap"
        if not super().resume(req):
            return False
        self.moved[1] += used - self.cache.stats()["swap_used_bytes"]
        now = self.read_all(req.rid)
        if [a.shape[0] for a in now] != [req.length] * 2 * self.L:
            self.problems.append(f"{req.rid}: lengths {[a.shape[0] for a in now]} after resuming, not {req.length}")
        if swapped:  # (c): bit for bit what it read before it left
            if not all(np.array_equal(a, b) for a, b in zip(self.reads[req.rid], now)):
                self.problems.append(f"{req.rid}: reads otherwise after swap_in")
            self.swap_checks += 1
        return True


class KvqPreemptTest(unittest.TestCase):
    """Preemption on kvq's CPU cache (serve_sched.KvqPreempt, what serve.py's kvq backend runs): six
    requests of 100-200 context tokens and 150-300 output tokens in a budget of what the first four
    need at admission, so that their growth (a page of every layer each 64 tokens) overflows it."""
    SPECS = [(130, 260), (190, 200), (100, 300), (160, 240), (120, 180), (200, 150)]

    def trace(self):
        return [ss.Request(i, c, o) for i, (c, o) in enumerate(self.SPECS)]

    def budget(self, policy):
        probe = CpuKvqBackend(policy, 1 << 30, "swap").cache
        return sum(probe.bytes_for(r.context + 1) for r in self.trace()[:4])

    def run_mode(self, policy, mode, **kw):
        be = CpuKvqBackend(policy, self.budget(policy), mode, **kw)
        log = ss.RunLog(policy)
        running, waiting = ss.run_trace(be, self.trace(), 8, log, preempt=mode)
        self.assertEqual((running, waiting, log.unfinished), ([], [], []))
        # (a) every request finished with its tokens, and the cache is empty again
        self.assertEqual(sorted((r.rid, r.done) for r in log.finished), [(i, o) for i, (_, o) in enumerate(self.SPECS)])
        st = be.cache.stats()
        self.assertEqual((st["sequences"], st["used_bytes"], st["swapped_sequences"], st["swap_used_bytes"]),
                         (0, 0, 0, 0))
        self.assertEqual(be.problems, [])
        return be, log, ss.summary(log)

    def test_needed(self):
        # (b): admitted by current need (what the first four get) and never preempted, a step is
        # refused; reserving whole outputs admits two
        be = CpuKvqBackend("kivi4/g32", self.budget("kivi4/g32"), "swap")
        be.can_admit = be.fits_now
        with self.assertRaises(ss.StepRefused):
            ss.run_trace(be, self.trace(), 8, ss.RunLog("kivi4/g32"))
        log = ss.RunLog("kivi4/g32")
        ss.run_trace(CpuKvqBackend("kivi4/g32", self.budget("kivi4/g32"), "swap"), self.trace(), 8, log)
        self.assertEqual(max(log.step_batch), 2)

    def test_swap(self):
        be, log, s = self.run_mode("kivi4/g32", "swap")
        self.assertEqual(log.step_batch[0], 4)
        self.assertGreaterEqual(s["preemptions"], 2)
        self.assertEqual(s["step_retries"], 0, "kvq_step_fits foresaw every step (pages of one format)")
        self.assertEqual((s["swap_outs"], s["swap_ins"], s["resumes"]), (s["preemptions"],) * 3)
        self.assertEqual((s["swap_fallbacks"], s["recomputed_tokens"], be.refilled), (0, 0, 0))
        # (c) each swapped sequence read after swap_in what it read before (CpuKvqBackend.resume)
        self.assertEqual(be.swap_checks, s["swap_ins"])
        # the swap traffic: the summary's is kvq's stats', and it is the swap space each swap took
        st = be.cache.stats()
        self.assertEqual((s["swapped_out_bytes"], s["swapped_in_bytes"]), (st["swapped_out_bytes"], st["swapped_in_bytes"]))
        self.assertEqual(be.moved, [st["swapped_out_bytes"], st["swapped_in_bytes"]])
        self.assertGreater(st["swapped_out_bytes"], 0)
        self.assertEqual(st["swapped_in_bytes"], st["swapped_out_bytes"])
        self.assertGreater(s["swap_out_s"], 0)

    def test_recompute(self):
        be, log, s = self.run_mode("kivi4/g32", "recompute")
        self.assertGreaterEqual(s["preemptions"], 2)
        self.assertEqual(s["step_retries"], 0)
        self.assertEqual((s["swap_outs"], s["swap_ins"], s["swapped_out_bytes"]), (0, 0, 0))
        self.assertEqual(s["resumes"], s["preemptions"])
        # (d) each resumption prefilled the request's context and the tokens it had produced when
        # it was released: the lengths of the preempted sequences, summed
        self.assertGreater(be.released_tokens, 0)
        self.assertEqual(s["recomputed_tokens"], be.released_tokens)
        self.assertEqual(be.refilled, be.released_tokens)
        self.assertEqual(sum(r.recomputed for r in log.finished), be.released_tokens)

    def test_swap_space_full_falls_back_to_recompute(self):
        # room in the swap space for about one sequence: the others are released and recomputed
        be, log, s = self.run_mode("kivi4/g32", "swap", swap_bytes=200 << 10)
        self.assertGreaterEqual(s["swap_fallbacks"], 1)
        self.assertGreaterEqual(s["swap_outs"], 1)
        self.assertEqual(s["swap_outs"] + s["swap_fallbacks"], s["preemptions"])
        self.assertEqual(s["recomputed_tokens"], be.released_tokens)
        self.assertEqual(be.refilled, be.released_tokens)
        self.assertEqual(be.swap_checks, s["swap_ins"])

    def test_other_formats(self):
        # fp16 and sym8 pages; in fp16 the arena's free bytes come in pieces too small for a page
        # block at times (a refused step: the layers before cut back, the newest preempted)
        for policy in ("fp16", "sym8"):
            for mode in ("swap", "recompute"):
                with self.subTest(policy=policy, mode=mode):
                    be, log, s = self.run_mode(policy, mode)
                    self.assertGreaterEqual(s["preemptions"], 1)
                    self.assertEqual(be.swap_checks, s["swap_ins"])


class PreemptReportTest(unittest.TestCase):
    def test_report_and_ratio(self):
        runs = []
        for name, mode in (("peer", "recompute"), ("kivi4/g32", "swap"), ("kivi4/g32", "recompute")):
            be = FakePreemptBackend(420, mode)
            if name != "peer":
                be.step = lambda running, be=be, step=be.step: step(running) / 4
            log = ss.RunLog(name)
            ss.run_trace(be, PreemptSchedulerTest.trace(), 8, log, preempt=mode)
            runs.append(ss.summary(log))
        runs[1]["swapped_out_bytes"] = runs[1]["swapped_in_bytes"] = 3 << 29
        with tempfile.TemporaryDirectory() as d:
            serve.write_results(d, {}, runs, [])
            with open(os.path.join(d, "serve.json")) as f:
                doc = json.load(f)
        ratios = [r["ratio_to_peer"] for r in doc["results"]]
        self.assertAlmostEqual(ratios[0], 1.0)
        self.assertGreater(ratios[1], 1.0, "a swap run against the peer's recompute run")
        self.assertEqual(serve.label("kivi4/g32", "swap"), "kivi4/g32 [swap]")
        self.assertEqual(serve.label("peer", "off"), "peer")
        meta = {"device": "fake", "sms": 1, "torch": "-", "cuda": "-", "date": "d", "weights_gib": 1.0,
                "peer_attention": "varlen", "trace": {"requests": 5, "context_min": 100, "context_max": 100,
                                                      "context_mean": 100, "output_mean": 44},
                "args": {"layers": 2, "kv_gib": 1, "max_steps": 10, "warmup_steps": 0, "canary_block": 2}}
        doc["meta"] = meta
        md = report_serve.table(doc)
        self.assertIn("| kivi4/g32 [swap] | ", md)
        self.assertIn("| peer [recompute] | ", md)
        self.assertIn("| kivi4/g32 | swap | ", md)
        self.assertIn("| 2 (0) | 2 | 2 | 1.50 / 1.50 |", md)
        self.assertIn("| kivi4/g32 | recompute | ", md)
        self.assertIn("| 245 |", md)
        self.assertEqual(md.count("\n| "), 2 + 3 + 2 + 3, md)  # two tables of three rows
        self.assertNotIn("Preemption", report_serve.table({"meta": meta, "results": [runs[0] | {"preempt": "off"}]}))


def main():
    unittest.main(verbosity=2)


if __name__ == "__main__":
    main()
