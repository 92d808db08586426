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
        command("vllm", spec, 8123, tmp_path)
    monkeypatch.setattr("bench.loadgen.peers._find", lambda name: None)
    with pytest.raises(PeerUnavailable, match="build_peers.sh"):
        command("llama-server", spec, 8123, tmp_path)



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
