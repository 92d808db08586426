"""The peers' command lines: loopback only, the same model file, and a ferry config the app accepts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.loadgen.peers import REPO, PeerSpec, PeerUnavailable, command
from deploy.config import load_config


@pytest.mark.parametrize("name,mode", [("ferry-disagg", "disaggregated"), ("ferry-colocated", "colocated")])
def test_ferry_peers_get_a_valid_config_with_the_spec_applied(tmp_path: Path, name: str, mode: str) -> None:
    if not (REPO / ".venv" / "bin" / "ferry").exists():
        pytest.skip("no .venv/bin/ferry (pip install -e . in .venv)")
    from deploy.config import read_args
    from deploy.scheduler_config import SchedulerSection

    spec = PeerSpec(gguf=Path("/models/m.gguf"), parallel=12, ctx_per_slot=512, ferry_stream_interval=3,
                    slo_ttft_ms=3000, slo_tpot_ms=250)
    argv = command(name, spec, 8123, tmp_path)
    assert argv[-2:] == ["--port", "8123"]
    path = Path(argv[argv.index("--config") + 1])
    cfg = load_config(path)
    assert cfg.mode == mode and cfg.model == "/models/m.gguf" and cfg.stream_interval == 3
    assert cfg.engine.max_num_seqs == 12 and cfg.engine.max_model_len == 512 and cfg.loopback_only
    sched = SchedulerSection.model_validate(read_args(path)["scheduler"]).to_scheduler_config()
    assert sched.placement.local_prefill and sched.placement.preempt_batch and sched.default_tenant is not None
    off = SchedulerSection.model_validate(read_args(Path(command(
        name, replace(spec, ferry_preempt_batch=False), 8124, tmp_path)[argv.index("--config") + 1]))["scheduler"])
    assert not off.to_scheduler_config().placement.preempt_batch
    assert not cfg.engine.lend_cores  # the app's default, left unsaid
    lent = read_args(Path(command(name, replace(spec, ferry_lend_cores=True), 8124, tmp_path)[argv.index("--config") + 1]))
    assert lent["engine"]["lend_cores"] is True
    assert (sched.default_tenant.slo.ttft_ms, sched.default_tenant.slo.tpot_ms) == (3000, 250)


def test_unknown_peer_and_missing_binaries_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = PeerSpec(gguf=Path("/models/m.gguf"))
    with pytest.raises(ValueError, match="unknown peer"):
        command("vllm-gpu", spec, 8123, tmp_path)
    monkeypatch.setattr("bench.loadgen.peers._find", lambda name: None)
    with pytest.raises(PeerUnavailable, match="build_peers.sh"):
        command("llama-server", spec, 8123, tmp_path)


    monkeypatch.setattr("bench.loadgen.peers.VLLM_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(PeerUnavailable, match="build_peers.sh vllm"):
        command("vllm", spec, 8123, tmp_path)


def test_vllm_serves_the_exported_folder_on_loopback_with_the_same_slots_and_dtype(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.loadgen import peers

    python = tmp_path / "vllm-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setattr(peers, "VLLM_PYTHON", python)
    monkeypatch.setattr(peers, "PEER_DIR", tmp_path)
    gguf = tmp_path / "m.gguf"
    folder = tmp_path / "models" / "m-bfloat16"
    folder.mkdir(parents=True)  # an export already there, as `ferry models export` records it
    (folder / "ferry_export.json").write_text('{"source": "m.gguf", "dtype": "bfloat16"}')
    spec = PeerSpec(gguf=gguf, parallel=12, ctx_per_slot=1152, threads=2, ferry_dtype="bfloat16")
    argv = command("vllm", spec, 8125, tmp_path)
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert flags == {"--model": str(folder), "--host": "127.0.0.1", "--port": "8125", "--served-model-name": "smollm2",
                     "--max-num-seqs": "12", "--max-model-len": "1152", "--dtype": "bfloat16"}
    env = peers.peer_env("vllm", spec)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    # another dtype is another export: not the folder above
    monkeypatch.setattr("actors.engine.export.export_hf", lambda g, dest, **kw: dest)
    assert peers.hf_folder(gguf, "float32") == tmp_path / "models" / "m-float32"


def test_stop_signals_the_peer_first_then_what_is_left_of_its_group() -> None:
    import subprocess
    import time

    from bench.loadgen.peers import _group_alive, _stop

    # The leader exits on SIGTERM (as ferry does after its drain); its child ignores SIGTERM (a
    # straggler), so only the group's SIGKILL ends it.
    script = "trap 'echo leader-got-term; exit 0' TERM; (trap '' TERM; exec sleep 300) & wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert _group_alive(proc.pid)
    t0 = time.monotonic()
    _stop(proc, grace_s=5.0, straggler_wait_s=1.0)
    assert not _group_alive(proc.pid) and time.monotonic() - t0 < 15.0
    assert proc.stdout is not None and proc.stdout.read() == "leader-got-term\n"
