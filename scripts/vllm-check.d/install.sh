#!/usr/bin/env bash
# Device call 1 (a fresh GPU machine, no network): copies bundle `a` to /tmp/keep, installs
# the 71 small wheels and vLLM 0.24.0's Python part into /tmp/site, an xgrammar stub,
# siesta's binaries into /tmp/keep/bin, writes the wrapper /tmp/keep/vllm (siesta's
# `executable`) and builds the tiny model in /tmp/keep/tiny. Details into $K/install.log.
#   usage: install.sh BUNDLE_A_DIR
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
A=${1:?usage: install.sh BUNDLE_A_DIR}
K=${VLLM_CHECK_KEEP:-/tmp/keep}
SITE=${VLLM_CHECK_SITE:-/tmp/site}
LOG=$K/install.log
mkdir -p "$K/bin" "$SITE"
t=$SECONDS
fail() {
    echo "FAIL install $* log=$LOG"
    exit 1
}
[ -f "$A/vllm-py.tar.xz" ] && [ -f "$A/siesta-bin.tar.xz" ] || fail "bundle a not found at $A (carry .vllm/a)"
cp -r "$A"/. "$K/" || fail "copy of $A to $K"
{
    echo "== machine"
    date -u
    uname -a
    nproc
    free -g | head -2
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    nvidia-smi topo -m
    python3 -V
    python3 -c 'import torch, transformers, tokenizers; print("torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)'
    env | grep -E '^(NCCL|TORCH|NVSHMEM|CUDA|LD_LIBRARY|PYTHON)' | sort
    echo "== wheels"
} >"$LOG" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$K"/deps/*.whl >>"$LOG" 2>&1 ||
    fail "pip install of $K/deps"
tar -xJf "$K/vllm-py.tar.xz" -C "$SITE" || fail "unpacking vllm-py.tar.xz"
# xgrammar is imported at start-up (a type annotation); the real wheel is 43 MB, so a stub
# stands in: structured output does not work with this install.
mkdir -p "$SITE/xgrammar"
cat >"$SITE/xgrammar/__init__.py" <<'PY'
# STUB: the real xgrammar is not carried (43 MB); only structured output needs it.
__version__ = "0.2.3"
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
PY
tar -xJf "$K/siesta-bin.tar.xz" -C "$K/bin" || fail "unpacking siesta-bin.tar.xz"
rm -f "$K/vllm-py.tar.xz" "$K/siesta-bin.tar.xz" && rm -rf "$K/deps"
# siesta's `executable`: vLLM 0.24.0 from /tmp/site on the machine's python3. It execs, so the
# pid siesta records is the API server's. NVLink multicast stays off (see KINDS.md).
cat >"$K/vllm" <<W
#!/bin/bash
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec $(command -v python3) -m vllm.entrypoints.cli.main "\$@"
W
chmod +x "$K/vllm"
{
    echo "== siesta binaries"
    ls -la "$K/bin"
    "$K/bin/siesta-p2p-probe" --inventory
    echo "== tiny model"
} >>"$LOG" 2>&1
python3 "$D/mk_tiny.py" "$K/tiny" >>"$LOG" 2>&1 || fail "building the tiny model (mk_tiny.py)"
[ -f "$K/tiny/model.safetensors" ] || fail "no $K/tiny/model.safetensors"
echo "PASS install wheels=$(ls "$SITE" | grep -c dist-info) bins=$(ls "$K/bin" | wc -l)" \
    "tiny_model_kb=$(du -sk "$K/tiny" | cut -f1) gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') seconds=$((SECONDS - t))"
