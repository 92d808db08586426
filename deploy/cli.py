"""The `ferry` command line: model fetching and one-shot generation (serving comes with deploy/)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from actors.engine.errors import EngineError


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from actors.engine.fetch import fetch_model

    path = fetch_model(args.name, force=args.force, progress=lambda msg: print(msg, file=sys.stderr))
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    engine = Engine.from_pretrained(args.model, EngineConfig(dtype=args.dtype))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.encode_chat([{"role": "user", "content": args.prompt}])
    engine.add_request("cli-0", prompt, params)
    t0 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None:
                first = time.perf_counter() - t0
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                reason = out.finish_reason
    total = time.perf_counter() - t0
    sys.stdout.write("\n")
    decode_rate = (n - 1) / (total - first) if n > 1 and first is not None and total > first else 0.0
    print(f"[{n} tokens, finish: {reason}, first token {first or 0:.2f}s, {decode_rate:.1f} tok/s decode]",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Disaggregated LLM serving on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files").add_subparsers(dest="models_cmd", required=True)
    fetch = models.add_parser("fetch", help="download a known model into the cache ($FERRY_HOME)")
    fetch.add_argument("name", help="known model name, e.g. smollm2")
    fetch.add_argument("--force", action="store_true", help="download again even if cached")
    fetch.set_defaults(func=_cmd_models_fetch)

    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("--model", default="smollm2", help="known name, .gguf file or HF folder")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EngineError as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
