#!/usr/bin/env python3
"""CPU-only tests of the serving benchmark's pieces (no torch, no GPU): the trace generator, the
scheduler and its admission rules with a fake backend, the A/B summary, and what the kvq backend
relies on through the kvq package on the CPU backend (bytes_for against what a fill takes,
admission, append_batch + attend against a hand computation, failed calls changing nothing, the
EchoKV canary switch).

    PYTHONPATH=build/python python3 bench/serve/test_serve.py
"""
import os
import sys
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


def main():
    unittest.main(verbosity=2)


if __name__ == "__main__":
    main()
