"""The KV pool plan: explicit sizes win, the planned pool follows the free memory, the step peak,
the fraction and the share exactly, the caps apply in order, a pool too small for one full-context
request is refused at start-up, and the CPU memory readings come from the kernel's own files.
The measured (CUDA) peak is checked by the gpu-marked test at the end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from actors.engine import memory
from actors.engine.config import EngineConfig
from actors.engine.device import MemoryInfo, host_memory_info, resolve_device
from actors.engine.engine import Engine
from actors.engine.memory import InsufficientKVMemory, KVPlan
from actors.engine.model_runner import kv_bytes_per_block
from transfer.units import MIB


def _engine(model_dir: Path, **cfg: object) -> Engine:
    return Engine.from_pretrained(model_dir, EngineConfig(device="cpu", **cfg))  # type: ignore[arg-type]


@pytest.fixture
def free_mib(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Makes the device report `value` MiB free (the plan's only reading of the machine)."""

    def set_free(value: int) -> None:
        monkeypatch.setattr(memory, "memory_info", lambda device: MemoryInfo(value * MIB, 2 * value * MIB, "test"))

    return set_free


def test_explicit_sizes_win(tiny_llama_dir: Path) -> None:
    e = _engine(tiny_llama_dir, num_blocks=37)
    assert (e.kv_plan.source, e.num_blocks, e.kv.pool.stats().num_blocks) == ("num_blocks", 37, 37)
    per_block = e.kv_plan.bytes_per_block
    e = _engine(tiny_llama_dir, kv_cache_bytes=100 * per_block + 5)
    assert (e.kv_plan.source, e.num_blocks) == ("kv_cache_bytes", 100)
    assert e.kv_plan.free_bytes is None and e.kv_plan.activation_peak_bytes is None


def test_planned_pool_is_fraction_times_share_of_what_is_left(tiny_llama_dir: Path, free_mib) -> None:  # type: ignore[no-untyped-def]
    free_mib(40)
    e = _engine(tiny_llama_dir, kv_memory_fraction=0.5, kv_memory_share=0.5, max_num_seqs=1024)
    plan = e.kv_plan
    assert plan.source == "planned" and plan.capped_by is None and plan.activation_peak_bytes is not None
    assert plan.activation_peak_bytes > 0 and not plan.activation_measured  # CPU: estimated
    assert plan.activation_peak_bytes == memory.estimate_step_bytes(e.runner.model, e.cfg, 512, 512)
    want = int((40 * MIB - plan.activation_peak_bytes) * 0.25) // plan.bytes_per_block
    assert e.num_blocks == plan.num_blocks == want
    assert plan.kv_bytes == want * plan.bytes_per_block and plan.max_tokens == want * 16
    assert plan.bytes_per_block == kv_bytes_per_block(e.model_config, 16, torch.float32)
    # every figure a status page shows is JSON-able, and the log line names the source
    d = plan.to_dict()
    assert d["max_tokens"] == plan.max_tokens and d["device"] == "cpu" and "planned" in plan.describe()


def test_caps_apply_rows_at_full_context_then_the_cpu_cap(tiny_llama_dir: Path, free_mib) -> None:  # type: ignore[no-untyped-def]
    free_mib(4096)
    e = _engine(tiny_llama_dir, max_num_seqs=3, max_model_len=200)
    assert e.kv_plan.capped_by == "max_rows_context"
    assert e.num_blocks == 3 * math.ceil(200 / 16)
    per_block = e.kv_plan.bytes_per_block
    e = _engine(tiny_llama_dir, max_model_len=200, kv_cpu_max_bytes=40 * per_block + 1)
    assert (e.kv_plan.capped_by, e.num_blocks) == ("kv_cpu_max_bytes", 40)


def test_a_pool_short_of_one_full_context_request_is_refused(tiny_llama_dir: Path, free_mib) -> None:  # type: ignore[no-untyped-def]
    free_mib(4096)
    per_block = _engine(tiny_llama_dir, num_blocks=1).kv_plan.bytes_per_block
    with pytest.raises(InsufficientKVMemory, match="max_model_len=1024"):
        _engine(tiny_llama_dir, kv_cpu_max_bytes=10 * per_block)
    free_mib(0)
    with pytest.raises(InsufficientKVMemory, match="kv_cache_mib"):
        _engine(tiny_llama_dir)


def test_the_planned_default_serves_a_full_context_request(tiny_llama_dir: Path) -> None:
    """No mocks: the real free memory of this machine, the default config."""
    e = _engine(tiny_llama_dir)
    assert e.kv_plan.source == "planned" and e.kv_plan.free_bytes and e.kv_plan.free_bytes > 0
    assert e.kv_plan.max_tokens >= e.max_model_len
    from actors.engine.sampling import SamplingParams

    prompt = [5 + i % 200 for i in range(e.max_model_len - 4)]
    out = e.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    e.check_integrity()


def test_the_estimate_used_without_a_measurement_grows_with_the_step(tiny_llama_dir: Path) -> None:
    e = _engine(tiny_llama_dir, kv_cache_bytes=MIB)
    model, cfg = e.runner.model, e.cfg
    m = e.model_config
    logits = 2 * 64 * m.vocab_size * 4
    assert memory.estimate_step_bytes(model, cfg, 2048, 64) > memory.estimate_step_bytes(model, cfg, 64, 64) > logits


def test_host_memory_reads_meminfo_and_a_cgroup_limit(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:   8000000 kB\n")
    info = host_memory_info(proc, tmp_path / "no-cgroup")
    assert (info.free_bytes, info.total_bytes, info.source) == (8000000 * 1024, 16000000 * 1024, "MemAvailable")


def test_devices_resolve_and_cuda_is_refused_without_one() -> None:
    from actors.engine.device import DeviceUnavailable

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="auto, cpu, cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceUnavailable, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        EngineConfig(kv_memory_fraction=0)


def test_kv_plan_round_trips_its_figures() -> None:
    plan = KVPlan("planned", "cpu", num_blocks=10, block_size=16, bytes_per_block=100, kv_bytes=1000,
                  weights_bytes=5, free_bytes=10_000, activation_peak_bytes=50, fraction=0.9, share=0.5)
    assert plan.to_dict()["max_tokens"] == 160 and "0.9 x 0.5" in plan.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_plan_measures_the_step_and_fits_in_free_memory(tiny_llama_dir: Path) -> None:
    e = Engine.from_pretrained(tiny_llama_dir, EngineConfig(device="cuda", max_num_batched_tokens=2048,
                                                          max_num_seqs=256, kv_memory_fraction=0.5))
    plan = e.kv_plan
    assert plan.source == "planned" and plan.activation_measured and plan.activation_peak_bytes > 0
    assert plan.device.startswith("cuda") and 0 < plan.kv_bytes < plan.free_bytes


def test_auto_dtype_follows_the_device_and_the_cpu(tmp_path: Path) -> None:
    from actors.engine.config import auto_dtype, cpu_has_native_bf16

    assert auto_dtype(torch.device("cuda")) == "bfloat16"
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor : 0\nflags\t\t: fpu avx avx2 avx512f\n")
    assert not cpu_has_native_bf16(str(flags))
    flags.write_text("processor : 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(str(flags))
    assert EngineConfig(dtype="auto").resolved(torch.device("cpu")).dtype == auto_dtype(torch.device("cpu"))
    with pytest.raises(ValueError, match="resolved per device"):
        EngineConfig(dtype="auto").kv_dtype


def test_a_cpu_pool_commits_memory_only_as_blocks_are_written(tiny_llama_dir: Path) -> None:
    """calloc'd caches: a planned multi-GiB pool costs no RAM at start-up."""
    from actors.engine.model_runner import _zeros

    t = _zeros((1024, 16, 8, 64), torch.bfloat16, torch.device("cpu"))  # 16 MiB
    assert t.shape == (1024, 16, 8, 64) and t.dtype == torch.bfloat16 and not t.any()
    t[3, 2] = 1.5
    assert float(t[3, 2, 7, 63]) == 1.5 and int(t.count_nonzero()) == 8 * 64


def test_the_profiled_step_never_runs_past_the_context(tiny_llama_dir: Path) -> None:
    """A step budget larger than the model's context (here 1,024 positions) is profiled as several
    prompt chunks; the step runs (on CPU here: CUDA runs the same chunks under the meter)."""
    chunks, num_blocks = memory.profile_chunks(2048, 256, 1024, 16)
    assert [len(c.token_ids) for c in chunks[:2]] == [1024, 769] and len(chunks) == 2 + 255
    assert all(c.start_pos + len(c.token_ids) <= 1024 for c in chunks)
    ids = [b for c in chunks for b in c.block_ids]
    assert sorted(ids) == list(range(num_blocks))  # every chunk in blocks of its own
    e = _engine(tiny_llama_dir, kv_cache_bytes=MIB)
    from actors.engine.model_runner import ModelRunner

    logits = ModelRunner(e.runner.model, num_blocks, 16, torch.float32).execute(chunks)
    assert logits.shape == (257, e.model_config.vocab_size) and bool(torch.isfinite(logits).all())
