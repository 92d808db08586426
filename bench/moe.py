"""MoE routing control on skewed random-weight MoE models: the controller, table swaps, expert budgets.

No MoE weights ship as packages here, so every figure comes from tiny Mixtral-layout models with
random weights whose router is made skewed (bench/moe_model.py: a few experts take most tokens, as
in real MoE traffic). float32 on CPU, one torch thread. Three parts:

- controller: the routing controller (cluster/moe) steering one engine through `RoutingSync`, for
  several quality budgets (`min_base_agreement`: logit-sample routing agreement with no bias that
  all its updates together may not go under). Each round serves a batch of random prompts, syncs
  and ticks once. Reported: live expert-load imbalance (max/mean, worst layer) on the same held-out
  traffic before and after, its cut (ratio and excess over 1), and the greedy-token change: the
  share of positions whose teacher-forced argmax next token differs from the unbiased model's, the
  share of positions per layer whose expert set the table moved, and tokens changed per row moved.
  Its model's head is first made as confident as a real model's (bench/moe_model.py:
  SmolLM2-135M's median top-1/top-2 z-margin on real text, `--calibrate-to`); both models' margins
  and bf16-vs-float32 change rates are printed.
- swap: tables swapped from another thread every few ms while an engine serves; requests finished
  with all their tokens, steps whose tokens a one-table-per-step replay reproduces, and how many
  steps after an apply call its table was first used (0: the next step to start; 1: after the step
  in flight).
- budget: request-level expert budgets (B experts per layer chosen from the prompt's routing mass):
  decode step time against unrestricted, distinct experts per layer per decode step, and the quality
  cost on the generated positions: greedy agreement and KL(unrestricted || budgeted).

Run:
    python bench/moe.py [--json] [--parts controller,swap,budget]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from actors.engine.model_runner import ModelRunner, SeqChunk  # noqa: E402
from actors.engine.moe.budget import ExpertBudgets  # noqa: E402
from actors.engine.moe.control import MoEControl, moe_control_of  # noqa: E402
from actors.engine.moe.routing import imbalance  # noqa: E402
from actors.engine.moe.routing_table import RoutingTable  # noqa: E402
from actors.engine.moe.sync import RoutingSync  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from bench.common import bench_parser, csv, format_table, progress, run  # noqa: E402
from bench.moe_model import (calibrate_head, changed_share, dtype_token_change, margin_stats, next_token_argmax,  # noqa: E402
                             random_prompts, real_yardstick, rows_moved, skewed_moe_engine, text_prompts)
from cluster.moe.controller import ControllerConfig, RoutingController  # noqa: E402


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def served_loads(engine: Any, control: MoEControl, prompts: list[list[int]], max_tokens: int) -> torch.Tensor:
    before = torch.tensor(control.report().tokens)
    engine.generate(prompts, greedy(max_tokens))
    return torch.tensor(control.report().tokens) - before


def worst(loads: torch.Tensor) -> float:
    return max(imbalance(row) for row in loads.double())


# --------------------------------------------------------------------------------- controller
def controller_part(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine, control = skewed_moe_engine(root, num_experts=8, top_k=2, strength=args.strength, seed=0)
    make = text_prompts if args.prompts == "text" else random_prompts
    held_out = make(args.num_requests, args.prompt_len, seed=7)
    sequences = make(32, args.prompt_len + args.output_len, seed=99)
    calibration = calibrate(engine, control, make, args)
    base_loads = served_loads(engine, control, held_out, args.output_len)
    ref = next_token_argmax(engine, control, sequences)
    bf16_change = dtype_token_change(engine, control, sequences, ref, torch.bfloat16)
    calibration["calibrated"] = {"bf16_token_change": bf16_change, **margin_stats(
        next_token_argmax(engine, control, sequences, with_logits=True))}
    rows = []
    for budget in args.quality_budgets:
        control.apply_table(RoutingTable.zeros(control.state.num_layers, control.state.num_experts,
                                               control.state.active.version + 1))
        ctl = RoutingController(ControllerConfig(step_size=args.step_size, min_tokens=args.min_tokens,
                                                 min_base_agreement=budget))
        sync = RoutingSync(control, ctl, "moe", "w0", sample_every=1)
        actions: dict[str, int] = {}
        for r in range(args.rounds):
            sync.sync_once()  # takes the published table
            engine.generate(make(args.num_requests, args.prompt_len, seed=1000 + r), greedy(args.output_len))
            sync.sync_once()  # reports what was routed under it
            d = ctl.tick("moe")
            if d is not None:
                actions[d.action] = actions.get(d.action, 0) + 1
        sync.sync_once()
        after = served_loads(engine, control, held_out, args.output_len)
        change = changed_share(ref, next_token_argmax(engine, control, sequences))
        moved = rows_moved(engine, control, sequences)
        before_imb, after_imb = worst(base_loads), worst(after)
        rows.append({"min_base_agreement": budget, "imbalance_before": before_imb, "imbalance_after": after_imb,
                     "cut_ratio": before_imb / after_imb, "cut_excess": (before_imb - 1) / max(after_imb - 1, 1e-9),
                     "greedy_token_change": change, "rows_moved": moved,
                     "tokens_changed_per_row_moved": change / max(statistics.fmean(moved), 1e-9), "table_version": control.state.active.version,
                     "max_abs_bias": float(control.state.active.tensor().abs().max()), "decisions": actions})
        progress(f"controller budget {budget}: imbalance {before_imb:.2f} -> {after_imb:.2f}, "
                 f"tokens changed {change:.3%}")
    return {"rows": rows, "bf16_token_change": bf16_change, "positions": sum(map(len, ref)),
            "calibration": calibration}


def calibrate(engine: Any, control: MoEControl, make: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The random MoE's head made as confident as the real model's (bench/moe_model.py):
    the real model's figures, the raw random model's, and the strength that matches them."""
    fit = make(32, args.prompt_len + args.output_len, seed=55)  # not the sequences quality is scored on
    raw_logits = next_token_argmax(engine, control, fit, with_logits=True)
    raw = {"bf16_token_change": dtype_token_change(engine, control, fit, [x.argmax(-1) for x in raw_logits],
                                                   torch.bfloat16), **margin_stats(raw_logits)}
    out: dict[str, Any] = {"raw": raw, "real": None, "strength": 0.0}
    if args.calibrate_to == "none":
        return out
    try:
        target = float(args.calibrate_to)
    except ValueError:
        progress(f"calibration: measuring {args.calibrate_to} on real text")
        out["real"] = real_yardstick(args.calibrate_to, args.real_sequences, args.real_length)
        target = out["real"]["median_z_margin"]
    out.update(calibrate_head(engine, control, fit, target, seed=0))
    progress(f"calibration: head strength {out['strength']:.2f} for median z-margin {target:.3f}")
    return out


# -------------------------------------------------------------------------------------- swap
def swap_part(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine, control = skewed_moe_engine(root, num_experts=8, top_k=2, strength=args.strength, seed=1)
    versions: list[int] = []
    started: list[float] = []
    inner = control.begin_step

    def begin_step(*a: Any, **kw: Any) -> None:
        started.append(time.perf_counter())
        inner(*a, **kw)
        versions.append(control.state.step_version)

    control.begin_step = begin_step  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(3)
    s = control.state
    tables = [RoutingTable.of(v, (torch.randn(s.num_layers, s.num_experts, generator=g)).clamp(-2, 2))
              for v in range(1, args.num_swaps + 1)]
    applied_at: list[float] = []
    stop = threading.Event()

    def swapper() -> None:
        for t in tables:
            if stop.wait(0.003):
                return
            applied_at.append(time.perf_counter())
            control.apply_table(t)

    prompts = random_prompts(args.num_requests, args.prompt_len, seed=11)
    output_len = 4 * args.output_len  # long enough for many steps
    thread = threading.Thread(target=swapper)
    thread.start()
    outs = engine.generate(prompts, greedy(output_len))
    stop.set()
    thread.join()
    complete = sum(len(o.token_ids) == output_len for o in outs)
    # steps after the apply call until its table routed: steps that began between the call and use
    lags = []
    for v, at in enumerate(applied_at, start=1):
        first = next((i for i, ver in enumerate(versions) if ver >= v), None)
        if first is not None:
            lags.append(sum(1 for t in started[:first] if t > at))
    replay, _unused = skewed_moe_engine(root, num_experts=8, top_k=2, strength=args.strength, seed=1)
    by_version = {t.version: t for t in tables}
    replay_control = moe_control_of(replay.runner.model)
    assert replay_control is not None
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        replay.add_request(rid, p, greedy(output_len))
    tokens: dict[str, list[int]] = {}
    for v in versions:
        if v != replay_control.state.active.version:
            replay_control.apply_table(by_version[v])
        for o in replay.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    same = sum(tokens.get(f"r{i}") == list(o.token_ids) for i, o in enumerate(outs))
    return {"requests": len(prompts), "completed_all_tokens": complete, "replay_identical": same,
            "steps": len(versions), "swaps_applied": len(applied_at), "versions_used": len(set(versions)),
            "lag_steps_max": max(lags) if lags else None,
            "lag_steps_mean": statistics.fmean(lags) if lags else None}


# ------------------------------------------------------------------------------------ budget
def budget_part(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    kw = dict(num_experts=args.budget_experts, top_k=2, hidden=args.budget_hidden,
              intermediate=4 * args.budget_hidden, strength=args.strength, seed=2)
    make = text_prompts if args.prompts == "text" else random_prompts
    prompts = make(args.num_requests, args.prompt_len, seed=21)
    built = {}  # budget -> (engine, control, distinct experts per layer and step); all alive, timed in turns
    for b in [None, *args.budgets]:
        engine, control = skewed_moe_engine(root, **kw, max_num_seqs=args.num_requests)
        control.budget.budgets = ExpertBudgets(default=b)
        distinct: list[int] = []
        add = control.loads.add
        control.loads.add = lambda layer, top_e, add=add, distinct=distinct: (  # type: ignore[method-assign]
            distinct.append(int(top_e.unique().numel())), add(layer, top_e))
        built[b] = (engine, control, distinct)
    step_s: dict[int | None, list[float]] = {b: [] for b in built}
    per_step: dict[int | None, list[int]] = {b: [] for b in built}
    outputs: dict[int | None, list[Any]] = {}
    for rep in range(args.repeats):  # in turns, so a busy moment of the host hits every budget alike
        for b, (engine, control, distinct) in built.items():
            engine.take_step_records()
            del distinct[:]
            outputs[b] = engine.generate(prompts, greedy(args.output_len))
            decode = [r for r in engine.take_step_records() if r.num_prefill_tokens == 0]
            step_s[b] += [r.step_s for r in decode]
            per_step[b] += distinct[-len(decode) * control.state.num_layers:]  # the last steps: decode only
        progress(f"budget timing round {rep + 1}/{args.repeats}")
    reference = [p + list(o.token_ids) for p, o in zip(prompts, outputs[None])]  # every budget scored on these
    rows: list[dict[str, Any]] = []
    ref_logits = torch.empty(0)
    for b, (engine, control, _) in built.items():
        logits = budgeted_logits(engine, control, reference, args.prompt_len, b)
        if b is None:
            ref_logits = logits
        p_ref, q = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
        step_ms = 1e3 * statistics.median(step_s[b])
        rows.append({"budget": "all" if b is None else b, "decode_step_ms": step_ms,
                     "speedup": rows[0]["decode_step_ms"] / step_ms if rows else 1.0,
                     "distinct_experts_per_layer": statistics.fmean(per_step[b]),
                     "greedy_agreement": float((ref_logits.argmax(-1) == logits.argmax(-1)).double().mean()),
                     "kl_mean": float((p_ref.exp() * (p_ref - q)).sum(-1).mean())})
    return rows


@torch.inference_mode()
def budgeted_logits(engine: Any, control: MoEControl, sequences: list[list[int]], prompt_len: int,
                    budget: int | None) -> torch.Tensor:
    """Teacher-forced logits of the generated positions [sum, V]: each sequence's prompt as one step
    (its routing mass gathered), then its continuation as the next, restricted by the budget."""
    bs = engine.cfg.block_size
    n_blocks = -(-max(map(len, sequences)) // bs)
    runner = ModelRunner(engine.runner.model, n_blocks, bs, engine.runner.model_dtype)
    out = []
    for i, seq in enumerate(sequences):
        req = SimpleNamespace(request_id=f"tf{i}", tenant="", prompt_token_ids=seq[:prompt_len])
        control.budget.set_request_budget(req.request_id, budget)
        prompt = SeqChunk(seq[:prompt_len], 0, list(range(n_blocks)), True)
        control.begin_step([req], [prompt])
        runner.execute([prompt])
        rest = SeqChunk(seq[prompt_len:-1], prompt_len, list(range(n_blocks)), True,
                        num_logits=len(seq) - prompt_len - 1)
        control.begin_step([req], [rest])
        out.append(runner.execute([rest]))
    control.budget.retain(set())
    return torch.cat(out)


# ------------------------------------------------------------------------------------ output
def render(f: dict[str, Any]) -> str:
    out = []
    if "controller" in f:
        c = f["controller"]
        out.append(format_table(
            ["quality budget", "imbalance before", "after", "cut (ratio)", "cut (excess)", "tokens changed",
             "rows moved per layer", "changed/moved", "|bias| max", "table"],
            [[r["min_base_agreement"], r["imbalance_before"], r["imbalance_after"], r["cut_ratio"], r["cut_excess"],
              f"{100 * r['greedy_token_change']:.2f}%", " ".join(f"{100 * m:.1f}%" for m in r["rows_moved"]),
              r["tokens_changed_per_row_moved"], r["max_abs_bias"], f"v{r['table_version']}"]
             for r in c["rows"]],
            title="controller: live expert-load imbalance (max/mean, worst layer) and greedy-token change"))
        out.append(f"yardstick: the same model in bfloat16 instead of float32 changes "
                   f"{100 * c['bf16_token_change']:.2f}% of the {c['positions']} teacher-forced greedy tokens")
        worst_before = max(r["imbalance_before"] for r in c["rows"])
        out.append(f"a 2x cut of max/mean {worst_before:.2f} needs at least {100 * 2 * worst_before / 16:.1f}% of the "
                   f"worst layer's tokens (top-2 of 8) to leave its hottest expert")
        cal = c["calibration"]
        named = [(f"{cal['real']['model']} (real, {cal['real']['positions']} positions)", cal["real"])] \
            if cal["real"] else []
        named += [("random MoE, raw head", cal["raw"]),
                  (f"random MoE, calibrated (strength {cal['strength']:.2f})", cal["calibrated"])]
        out.append(format_table(
            ["model", "median z-margin", "p10 z-margin", "near ties", "median top-1 p", "bf16 tokens changed"],
            [[name, r["median_z_margin"], r["p10_z_margin"], f"{100 * r['near_tie_share']:.1f}%",
              r["median_top1_prob"], f"{100 * r['bf16_token_change']:.2f}%"] for name, r in named],
            title="calibration: next-token confidence, teacher-forced (z-margin: top-1 minus top-2 logit over the "
                  "logit std; near tie: z < 0.05)"))
    if "swap" in f:
        s = f["swap"]
        out.append(format_table(["requests", "all tokens", "replay identical", "steps", "swaps", "tables used",
                                 "lag max (steps)", "lag mean"],
                                [[s["requests"], s["completed_all_tokens"], s["replay_identical"], s["steps"],
                                  s["swaps_applied"], s["versions_used"], s["lag_steps_max"], s["lag_steps_mean"]]],
                                title="swap: tables swapped every ~3 ms from another thread while serving"))
    if "budget" in f:
        out.append(format_table(
            ["budget", "decode step ms", "speedup", "experts/layer/step", "greedy agreement", "KL mean"],
            [[r["budget"], r["decode_step_ms"], r["speedup"], r["distinct_experts_per_layer"],
              f"{100 * r['greedy_agreement']:.1f}%", f"{r['kl_mean']:.4f}"] for r in f["budget"]],
            title="budget: request-level expert budgets, decode steps and quality vs unrestricted"))
    return "\n\n".join(out)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    parts = args.parts.split(",")
    figures: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "controller" in parts:
            figures["controller"] = controller_part(root, args)
        if "swap" in parts:
            figures["swap"] = swap_part(root, args)
        if "budget" in parts:
            figures["budget"] = budget_part(root, args)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, threads=1)
    p.add_argument("--parts", default="controller,swap,budget")
    p.add_argument("--strength", type=float, default=1.5, help="router skew (bench/moe_model.py)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--step-size", type=float, default=0.5)
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--quality-budgets", type=csv(float), default=[0.99, 0.95, 0.9, 0.8, 0.6, 0.5])
    p.add_argument("--calibrate-to", default="smollm2",
                   help="the controller part's random MoE is made as confident (median z-margin) as: a real model "
                        "(measured on real text), a number (that median z-margin), or none (raw random model)")
    p.add_argument("--real-sequences", type=int, default=24)
    p.add_argument("--real-length", type=int, default=64)
    p.add_argument("--num-swaps", type=int, default=200)
    p.add_argument("--budgets", type=csv(int), default=[8, 4, 2])
    p.add_argument("--budget-experts", type=int, default=16)
    p.add_argument("--budget-hidden", type=int, default=384)
    p.add_argument("--repeats", type=int, default=3, help="budget part: timed runs of each budget, in turns")
    p.add_argument("--prompts", choices=["text", "random"], default="text",
                   help="text: slices of real English text; random: uniformly random token ids")
    run(bench, p.parse_args(argv), render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
