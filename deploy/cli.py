"""The `ferry` command line: model fetching and one-shot generation (serving comes with deploy/)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from actors.engine.errors import EngineError
from deploy.ops import add_ops_parsers



def _wait_serving(api: str, timeout_s: float = 120.0) -> None:
    """Until `/health` says a request can be served (the ingress has found its worker replicas),
    so that "ferry is up" is true of the first request sent after it."""
    import httpx2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx2.HTTPError, ValueError):
            if httpx2.get(f"{api}/health", timeout=10, trust_env=False).json().get("healthy"):
                return
        time.sleep(0.5)
    print(f"warning: /health did not report healthy within {timeout_s:g}s", file=sys.stderr, flush=True)


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from actors.engine.fetch import fetch_model

    path = fetch_model(args.name, force=args.force, progress=lambda msg: print(msg, file=sys.stderr))
    print(path)
    return 0


def _cmd_models_export(args: argparse.Namespace) -> int:
    from actors.engine.export import export_hf

    print(export_hf(args.name, Path(args.dir), dtype=args.dtype, force=args.force,
                    progress=lambda msg: print(msg, file=sys.stderr, flush=True)))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    engine = Engine.from_pretrained(args.model, EngineConfig(dtype=args.dtype, device=args.device))
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


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from deploy.local import loopback_env

    loopback_env()  # before anything imports ray: it reads these at import time
    from deploy.config import load_config, read_args

    raw = read_args(args.config)
    cfg = load_config(raw)  # validate before starting anything
    print(f"starting ferry ({cfg.mode}, model {cfg.model}) on a local Ray cluster ...", file=sys.stderr, flush=True)
    from ray import serve

    from deploy.apps import build_app
    from deploy.local import start_local

    urls = start_local(http_port=args.port)
    t0 = time.perf_counter()
    # The external scaler lets the ingress apply the scheduler's replica counts (`scheduler.scaling`).
    serve.run(build_app(raw), name="ferry", route_prefix="/", blocking=False,
              external_scaler_enabled=cfg.workers_as == "deployments")
    _wait_serving(urls.api)
    key_hint = ' -H "Authorization: Bearer <key>"' if cfg.api.auth_required else ""
    print(f"""ferry is up ({time.perf_counter() - t0:.0f}s)
  API        {urls.api}/v1  (OpenAI-compatible; docs at {urls.api}/docs)
  dashboard  {urls.api}/dashboard   Ray dashboard {urls.dashboard}
  metrics    {urls.metrics}
try:
  curl -s {urls.api}/v1/chat/completions{key_hint} -H 'Content-Type: application/json' \\
    -d '{{"model": "{cfg.model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "temperature": 0}}'
Ctrl-C stops it.""", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    _drain(serve, args.drain_timeout)
    import ray

    serve.shutdown()
    ray.shutdown()
    return 0


def _drain(serve: Any, timeout_s: float) -> None:
    """Lets the requests in flight finish (up to `timeout_s`) while new ones get 503; a second
    Ctrl-C or SIGTERM stops at once."""
    import signal

    if timeout_s <= 0:
        return

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    print(f"stopping: new requests get 503; waiting up to {timeout_s:g} s for those in flight "
          "(Ctrl-C again stops now) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        left = serve.get_app_handle("ferry").drain.remote(timeout_s).result(timeout_s=timeout_s + 5)
    except KeyboardInterrupt:
        print("stopping now", file=sys.stderr, flush=True)
        return
    except Exception as e:  # noqa: BLE001 - the stop goes on regardless
        print(f"could not drain ({type(e).__name__}: {e}); stopping now", file=sys.stderr, flush=True)
        return
    took = time.perf_counter() - t0
    print(f"drained in {took:.1f} s" if not left else f"{left} request(s) still in flight after {took:.0f} s; "
          "cutting them", file=sys.stderr, flush=True)


def add_plugin_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Subcommands other packages add through the `ferry.commands` entry points (bench/ adds
    `ferry bench`): deploy/ calls them without importing the packages above it."""
    for entry in importlib.metadata.entry_points(group="ferry.commands"):
        entry.load()(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Disaggregated LLM serving on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files").add_subparsers(dest="models_cmd", required=True)
    fetch = models.add_parser("fetch", help="download a known model into the cache ($FERRY_HOME)")
    fetch.add_argument("name", help="known model name, e.g. smollm2")
    fetch.add_argument("--force", action="store_true", help="download again even if cached")
    fetch.set_defaults(func=_cmd_models_fetch)
    export = models.add_parser("export", help="write a model as a Hugging Face folder (safetensors, config, "
                               "tokenizer, chat template), e.g. for vLLM to load the same weights")
    export.add_argument("name", help="known model name (fetched if missing) or a .gguf path")
    export.add_argument("dir", help="the folder to write")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    export.add_argument("--force", action="store_true", help="replace a non-empty folder")
    export.set_defaults(func=_cmd_models_export)

    srv = sub.add_parser("serve", help="run the disaggregated app on a local Ray cluster (127.0.0.1)")
    srv.add_argument("--config", default=None, help="YAML config (deploy/serve.yaml shows every field)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="on Ctrl-C or SIGTERM, seconds the requests in flight get to finish while new ones "
                          "get 503 (0: stop at once; default 30)")
    srv.set_defaults(func=_cmd_serve)

    add_ops_parsers(sub)
    add_plugin_parsers(sub)

    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("--model", default="smollm2", help="known name, .gguf file or HF folder")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="auto: cuda when torch sees a GPU (default)")
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (EngineError, ValueError) as e:
        print(f"ferry: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ferry status | head`: the reader left early; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush stays quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
