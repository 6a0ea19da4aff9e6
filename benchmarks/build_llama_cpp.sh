#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize for the benchmarks that compare with it.
set -euo pipefail

VERSION=0.3.36
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_DIR="$REPO_ROOT/build/llama.cpp"

usage() {
    cat <<EOF
usage: benchmarks/build_llama_cpp.sh [-h] [DIR]

Builds llama.cpp's llama-server, llama-bench and llama-quantize (CPU, Release, -march=native
without AMX) from the llama.cpp tree vendored in llama-cpp-python $VERSION's source distribution
from PyPI, so the benchmarks compare against a fixed llama.cpp fetched with pip alone:

  1. python -m pip download --no-deps --no-binary :all: llama-cpp-python==$VERSION  (into DIR)
  2. unpack it in DIR
  3. cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
           -DLLAMA_BUILD_TESTS=OFF, C and C++ flags -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
           (in DIR/llama_cpp_python-$VERSION/vendor/llama.cpp/build)
  4. cmake --build build -j2 --target llama-server llama-bench llama-quantize

Each step already done (the archive there, the tree unpacked, build/ configured, the binaries
built) is skipped; delete DIR to start over. Then prints where the binaries and the vendored
convert_hf_to_gguf.py (which bench_serve.py runs to make its GGUFs) are.

DIR     where everything goes (default: $DEFAULT_DIR, ignored by git)
-h      this help

Environment: PYTHON (default: the repository's .venv/bin/python, else python3) runs pip;
JOBS (default 2) is cmake --build's -j. Needs cmake, a C++17 compiler and make.
EOF
}

while getopts ":h" option; do
    case "$option" in
        h) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ "$#" -gt 1 ]; then
    usage >&2
    exit 2
fi

DIR="${1:-$DEFAULT_DIR}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
JOBS="${JOBS:-2}"
for tool in cmake make; do
    command -v "$tool" >/dev/null || { echo "build_llama_cpp.sh: $tool is needed (apt-get install cmake build-essential)" >&2; exit 1; }
done

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
ARCHIVE="$DIR/llama_cpp_python-$VERSION.tar.gz"
TREE="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$TREE/build/bin"

if [ -f "$ARCHIVE" ]; then
    echo "have $ARCHIVE" >&2
else
    echo "downloading llama-cpp-python $VERSION's source distribution..." >&2
    "$PYTHON" -m pip download --no-deps --no-binary :all: --dest "$DIR" "llama-cpp-python==$VERSION" >&2
fi

if [ -f "$TREE/CMakeLists.txt" ]; then
    echo "have $TREE" >&2
else
    echo "unpacking..." >&2
    tar -xzf "$ARCHIVE" -C "$DIR"
fi

if [ -f "$TREE/build/CMakeCache.txt" ]; then
    echo "have $TREE/build configured" >&2
else
    echo "configuring..." >&2
    # no AMX: a virtual machine can list the AMX flags without granting their use, and llama.cpp
    # compiled for them died of SIGILL on its first prompt there (every other -march=native
    # instruction kept)
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    (cd "$TREE" && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX") >&2
fi

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-quantize" ]; then
    echo "have $BIN/llama-server, llama-bench and llama-quantize" >&2
else
    echo "building llama-server, llama-bench and llama-quantize (-j$JOBS; some minutes)..." >&2
    (cd "$TREE" && cmake --build build -j"$JOBS" --target llama-server llama-bench llama-quantize) >&2
fi

cat <<EOF
llama-server:        $BIN/llama-server
llama-bench:         $BIN/llama-bench
llama-quantize:      $BIN/llama-quantize
convert_hf_to_gguf:  $TREE/convert_hf_to_gguf.py
serve benchmark:     .venv/bin/python benchmarks/bench_serve.py --llama-server $BIN/llama-server
EOF
