"""bench/paging.py on a small synthetic trace: soft holds leave admission exactly as lazy paging's,
static reservation never preempts, and the table carries the figures."""

from __future__ import annotations

import argparse

import numpy as np

from bench import paging as pbench
from bench.sim.traces import TraceRequest


def _args(**kw) -> argparse.Namespace:
    base = dict(block_size=16, kv_tokens=16 * 160, max_seqs=64, step_tokens=512, long_tokens=256, run_blocks=8,
                snapshot_steps=[40, 80], no_prefix_caching=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _trace(n: int = 40) -> list[TraceRequest]:
    rng = np.random.default_rng(3)
    return [TraceRequest(0.0, int(rng.integers(40, 400)), int(rng.integers(5, 90))) for _ in range(n)]


def test_soft_holds_admit_exactly_as_lazy_and_reservation_never_preempts():
    args, trace = _args(), _trace()
    chosen = pbench.policies(args.long_tokens, args.run_blocks)
    results = [pbench.simulate(name, chosen[name], pbench.make_requests(trace, args.block_size), args)
               for name in ("lazy", "aware-soft", "aware-hard", "reserve-max")]
    lazy, soft, hard, reserve = results
    assert lazy.preemptions > 0 and lazy.saturated_steps > 10  # the budget binds
    assert soft.running == lazy.running and soft.preemptions == lazy.preemptions
    assert soft.recomputed_tokens == lazy.recomputed_tokens and soft.prefix_hit_tokens == lazy.prefix_hit_tokens
    assert soft.paging["num_runs"] > 0 and np.mean(soft.contiguity) > np.mean(lazy.contiguity)
    assert reserve.preemptions == 0 and reserve.recomputed_tokens == 0
    assert np.mean(reserve.running) < np.mean(lazy.running)  # reserving what is not yet written costs rows
    assert all(r.output_tokens == sum(t.output_len for t in trace) for r in results)
    figures = pbench.figures(results, {}, args, trace)
    assert [r["policy"] for r in figures["policies"]] == ["lazy", "aware-soft", "aware-hard", "reserve-max"]
    assert figures["policies"][1]["vs_lazy"] == 1.0 and 1.0 <= figures["bound_vs_lazy"] < 1.1
    table = pbench.render(figures)
    assert "aware-hard" in table and "bound:" in table
    assert figures["policies"][2]["held_blocks_mean"] > 0 and hard.paging["num_runs"] > 0
