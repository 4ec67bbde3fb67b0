#!/usr/bin/env bash
# Device call 3, first step: reassembles vLLM's two big .so files (bundles b and c, staged
# into /tmp/keep as big.part-*) into /tmp/site/vllm and checks them against big.sha256.
set -uo pipefail
K=${VLLM_CHECK_KEEP:-/tmp/keep}
SITE=${VLLM_CHECK_SITE:-/tmp/site}
t=$SECONDS
fail() {
    echo "FAIL setup-big $*"
    exit 1
}
ls "$K"/big.part-* >/dev/null 2>&1 || fail "no $K/big.part-* (stage .vllm/b and .vllm/c first)"
[ -d "$SITE/vllm" ] || fail "no $SITE/vllm (run \`vllm-check install\` first)"
mkdir -p "$K/big"
cat "$K"/big.part-* | tar -xf - -C "$K/big" || fail "the parts do not make a tar (one missing?)"
xz -d -T4 -c "$K/big/_C_stable_libtorch.abi3.so.xz" >"$SITE/vllm/_C_stable_libtorch.abi3.so" || fail "xz _C"
xz -d -T4 -c "$K/big/_vllm_fa3_C.abi3.so.xz" >"$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" || fail "xz fa3"
chmod +x "$SITE/vllm/_C_stable_libtorch.abi3.so" "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
if [ -f "$K/big.sha256" ]; then
    (cd "$SITE/vllm" && cp "$K/big.sha256" . &&
        sha256sum --quiet -c big.sha256) || fail "sha256 mismatch"
fi
rm -rf "$K/big" "$K"/big.part-*
touch "$SITE/.big-ready"
echo "PASS setup-big seconds=$((SECONDS - t))"
