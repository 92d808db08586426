"""The systems one run compares, each started on a free loopback port and stopped by its own PID.

Mental model: a `Peer` knows how to build its command line (same GGUF, same number of parallel
slots, 127.0.0.1 only) and whether it is installed; `launched(peer)` starts it in a new session,
waits until `GET /v1/models` answers, yields (base URL, served model name), and on exit sends
SIGTERM to the process group it created (SIGKILL after a grace period). A peer whose binary is
missing raises `PeerUnavailable` with the reason, and the harness skips it with that message.
Peers: ferry colocated, ferry disaggregated (`ferry serve --config`), vLLM's CPU build (its OpenAI
server, on the GGUF exported once to an HF folder by `ferry models export`, so both load the same
weights; bench/build_peers.sh vllm), llama.cpp's `llama-server --parallel N`, llama-cpp-python's
server (one request at a time; `--interrupt_requests False` so a new request does not kill the
running stream). Binaries are looked up in ~/.cache/ferry/peers/.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import yaml

from bench.loadgen.prefix_tiers import PoolReading, block_size_of
from deploy.ops import Unreachable, fetch_health, workers_of

log = logging.getLogger(__name__)
PEER_DIR = Path(os.environ.get("FERRY_PEERS", Path.home() / ".cache" / "ferry" / "peers"))
REPO = Path(__file__).resolve().parents[2]
ALL_PEERS = ("ferry-disagg", "ferry-colocated", "vllm", "llama-server", "llama-cpp-python")
VLLM_PYTHON = PEER_DIR / "vllm-venv" / "bin" / "python"


class PeerUnavailable(RuntimeError):
    """The peer is not installed or did not come up; the message says why."""


@dataclass(frozen=True, slots=True)
class PeerSpec:
    gguf: Path
    parallel: int = 16  # continuous-batching slots for everyone that has them
    ctx_per_slot: int = 1024
    threads: int = 2
    startup_timeout_s: float = 300.0
    ferry_src: Path | None = None  # run ferry from this source tree (a clean snapshot), else the repo
    ferry_dtype: str = "auto"  # as deploy/serve.yaml: bfloat16 on CPUs with native bf16, else float32
    ferry_stream_interval: int = 1  # tokens per streamed delta after the first (the app's default: 1)
    # The SLO the run measures, given to ferry's scheduler as its default tenant's contract (the
    # operator states it; llama.cpp has nothing to tell), and whether its decode workers may
    # prefill for themselves when the prefill workers are queued (deploy/serve.yaml turns it on).
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    ferry_local_prefill: bool = True
    ferry_preempt_batch: bool = True  # interactive requests may take batch-class rows (scheduler.preempt_batch)
    ferry_torch_threads: int | None = None  # threads per engine; None: the app's split of the CPUs
    ferry_workers_as: str | None = None  # "deployments" or "actors"; None: the app's default
    ferry_kv_recovery: str | None = None  # "shadow" or "recompute" for every tenant; None: the app's default
    ferry_speculation: str | None = None  # engine.speculation.method; None: the app's default
    ferry_lend_cores: bool = False  # engine.lend_cores: decode engines yield a node's cores to a prefill by slack
    vllm_kv_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE: vLLM's KV cache on CPU, GiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _find(name: str) -> Path | None:
    for root in (PEER_DIR, REPO / ".venv" / "bin"):
        hits = sorted(root.rglob(name)) if root.is_dir() else []
        hits = [h for h in hits if h.is_file() and os.access(h, os.X_OK)]
        if hits:
            return hits[0]
    found = shutil.which(name)
    return Path(found) if found else None


def command(name: str, spec: PeerSpec, port: int, workdir: Path) -> list[str]:
    """The argv that starts `name` on 127.0.0.1:port."""
    if name.startswith("ferry-"):
        ferry = REPO / ".venv" / "bin" / "ferry"
        if not ferry.exists():
            raise PeerUnavailable(f"{ferry} missing (pip install -e . in .venv)")
        cfg = {"model": str(spec.gguf), "mode": "colocated" if name == "ferry-colocated" else "disaggregated",
               # torch_threads left to the app: every engine on all the cores, sleeping when idle (engine.cpu_cores)
               "engine": {"max_num_seqs": spec.parallel, "max_model_len": spec.ctx_per_slot,
                          "dtype": spec.ferry_dtype},
               "stream_interval": spec.ferry_stream_interval, "api": {"auth_required": False},
               "scheduler": {"local_prefill": spec.ferry_local_prefill}}
        if spec.ferry_torch_threads is not None:
            cfg["engine"]["torch_threads"] = spec.ferry_torch_threads
        if spec.ferry_workers_as is not None:  # only when given: older snapshots (--ferry-src) do not know the key
            cfg["workers_as"] = spec.ferry_workers_as
        if spec.ferry_speculation is not None:  # only when given: older snapshots do not know the key
            cfg["engine"]["speculation"] = {"method": spec.ferry_speculation}
        if not spec.ferry_preempt_batch:  # only when off: older snapshots (--ferry-src) do not know the key
            cfg["scheduler"]["preempt_batch"] = False
        if spec.ferry_lend_cores:  # only when on: older snapshots (--ferry-src) do not know the key
            cfg["engine"]["lend_cores"] = True
        tenant = {k: v for k, v in (("ttft_ms", spec.slo_ttft_ms), ("tpot_ms", spec.slo_tpot_ms),
                                    ("kv_recovery", spec.ferry_kv_recovery)) if v is not None}
        if tenant:
            cfg["scheduler"]["default_tenant"] = tenant
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        # `python -m deploy.cli` with PYTHONPATH=ferry_src runs a snapshot ahead of the editable install.
        return [str(REPO / ".venv" / "bin" / "python"), "-m", "deploy.cli", "serve", "--config", str(path),
                "--port", str(port)]
    if name == "vllm":
        if not VLLM_PYTHON.exists():
            raise PeerUnavailable(f"vLLM not installed ({VLLM_PYTHON} missing: bench/build_peers.sh vllm)")
        dtype = vllm_dtype(spec)
        return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_folder(spec.gguf, dtype)),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
                "--max-num-seqs", str(spec.parallel), "--max-model-len", str(spec.ctx_per_slot), "--dtype", dtype]
    if name == "llama-server":
        exe = _find("llama-server")
        if exe is None:
            raise PeerUnavailable(f"llama-server not built (bench/build_peers.sh llama-server builds it into {PEER_DIR})")
        return [str(exe), "-m", str(spec.gguf), "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(spec.parallel), "-c", str(spec.ctx_per_slot * spec.parallel),
                "-t", str(spec.threads), "--cont-batching", "--alias", "smollm2"]
    if name == "llama-cpp-python":
        py = PEER_DIR / "lcp-venv" / "bin" / "python"
        probe = subprocess.run([str(py), "-c", "import llama_cpp.server"], capture_output=True) if py.exists() else None
        if probe is None or probe.returncode != 0:
            raise PeerUnavailable(f"llama-cpp-python[server] not installed in {py.parent.parent} "
                                  "(bench/build_peers.sh llama-cpp-python)")
        return [str(py), "-m", "llama_cpp.server", "--model", str(spec.gguf), "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", str(spec.ctx_per_slot), "--n_threads", str(spec.threads),
                "--interrupt_requests", "False", "--model_alias", "smollm2"]
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(ALL_PEERS)}")


def vllm_dtype(spec: PeerSpec) -> str:
    """The dtype vLLM runs: ferry's, with "auto" resolved as ferry's engine resolves it on this CPU."""
    if spec.ferry_dtype != "auto":
        return spec.ferry_dtype
    import torch

    from actors.engine.config import auto_dtype

    return auto_dtype(torch.device("cpu"))


def hf_folder(gguf: Path, dtype: str) -> Path:
    """`gguf` as a Hugging Face folder in `dtype` (`ferry models export`), written once under
    PEER_DIR/models and reused while its export record names the same file and dtype."""
    from actors.engine.export import export_hf, is_export_of

    dest = PEER_DIR / "models" / f"{gguf.stem}-{dtype}"
    if is_export_of(dest, gguf, dtype):
        return dest

    log.info("exporting %s to %s for vLLM", gguf.name, dest)
    return export_hf(gguf, dest, dtype=dtype, force=True)


def peer_env(name: str, spec: PeerSpec) -> dict[str, str]:
    """The environment a peer starts with: its threads, and for vLLM its CPU settings (OpenMP threads
    bound to cores 0..N-1, its KV cache size, its engine's queues on loopback)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads)}
    if name == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{spec.threads - 1}", VLLM_CPU_KVCACHE_SPACE=str(spec.vllm_kv_gib),
                   VLLM_HOST_IP="127.0.0.1")
    return env


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0, straggler_wait_s: float = 10.0) -> None:
    """SIGTERM the peer's own process first (ferry then drains and stops the Ray cluster it started,
    whose processes share its group and would die under it if signalled together), then whatever is
    left of the group this harness created (its leader is proc.pid): SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    for sig, wait_s in ((signal.SIGTERM, straggler_wait_s), (signal.SIGKILL, 10.0)):
        if not _group_alive(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
    proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


@contextlib.contextmanager
def launched(name: str, spec: PeerSpec, log_dir: Path) -> Iterator[tuple[str, str]]:
    """Start `name`, wait for /v1/models, yield (base URL, model id), always stop it."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as tmp:
        argv = command(name, spec, port, Path(tmp))
        out = (log_dir / f"{name}.log").open("wb")
        env = peer_env(name, spec)
        # vLLM starts in the scratch folder: from the repo, its `kernels` package would be ours.
        cwd = Path(tmp) if name == "vllm" else REPO
        if name.startswith("ferry-") and spec.ferry_src is not None:
            cwd = spec.ferry_src
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(spec.ferry_src), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=cwd)
        log.info("started %s (pid %d) on port %d", name, proc.pid, port)
        try:
            base = f"http://127.0.0.1:{port}"
            yield base, _wait_ready(base, proc, spec.startup_timeout_s, log_dir / f"{name}.log")
        finally:
            _stop(proc)
            out.close()


def served_model(base: str) -> str | None:
    """The first model id `GET /v1/models` lists, or None while the server does not answer."""
    with contextlib.suppress(httpx2.HTTPError, ValueError):
        r = httpx2.get(f"{base.rstrip('/').removesuffix('/v1')}/v1/models", timeout=2.0, trust_env=False)
        if r.status_code == 200 and (data := r.json().get("data")):
            return str(data[0]["id"])
    return None


@dataclass(frozen=True)
class HealthFigures:
    """From a ferry server's `/health`: the resident MiB of each worker (the process, for the
    in-process engine); the batch rows its ingress has preempted and resumed so far (None without
    a scheduler); healthy workers per kind (prefill, decode, colocated: the replica counts when
    the scheduler scales them); the prefix-cache pool's lookup counters and the engines' block
    size (bench/loadgen/prefix_tiers.py). Empty from a server that reports none (llama.cpp) or
    does not answer."""

    memory_mib: dict[str, int] = field(default_factory=dict)
    preemptions: tuple[int, int] | None = None
    workers: dict[str, int] = field(default_factory=dict)
    pool: PoolReading | None = None
    block_size: int | None = None


def health_figures(base: str) -> HealthFigures:
    try:
        _, health = fetch_health(base.rstrip("/").removesuffix("/v1"), None, timeout_s=5.0)
    except Unreachable:
        return HealthFigures()
    workers = workers_of(health)
    memory = {w.name: int(w.rss_mib) for w in workers if isinstance(w.rss_mib, (int, float))}
    kinds = collections.Counter(w.kind for w in workers if w.healthy)
    link = health.get("scheduler")
    preemptions = None
    if isinstance(link, dict) and isinstance(link.get("num_preempted"), int):
        preemptions = (int(link["num_preempted"]), int(link.get("num_resumed", 0)))
    return HealthFigures(memory, preemptions, dict(kinds), PoolReading.of(health),
                         block_size_of([w.kv_plan for w in workers]))


def _serving(base: str) -> bool:
    """Whether a ferry server's `/health` says a request can be served now (its ingress answers
    before its worker deployments do); True for servers without one (llama.cpp answers 200 or 404)."""
    with contextlib.suppress(httpx2.HTTPError, ValueError):
        r = httpx2.get(f"{base.rstrip('/').removesuffix('/v1')}/health", timeout=5.0, trust_env=False)
        if r.status_code == 404:
            return True
        if r.status_code == 200 and not r.content.strip():  # vLLM: an empty 200 once its engine is up
            return True
        body = r.json()
        return bool(body.get("healthy", True)) if isinstance(body, dict) else True
    return False


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-600:]
            raise PeerUnavailable(f"exited with {proc.returncode} before serving; log tail: {tail}")
        if (model := served_model(base)) and _serving(base):
            return model
        time.sleep(1.0)
    raise PeerUnavailable(f"not ready after {timeout_s:.0f}s (log: {log_path})")
