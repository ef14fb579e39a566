#!/usr/bin/env bash
# Rewrites every fuzz target's seed corpus (fuzz/corpus/<target>/) from the
# unit tests that build the seeds (testing/corpus.h). Usage:
#   scripts/corpus.sh BUILD_DIR
set -euo pipefail
build=${1:?build dir}
root=$(cd "$(dirname "$0")/.." && pwd)
export KVB_WRITE_CORPUS="$root/fuzz/corpus"
for target in net_frame handshake engine_metadata tcp_frame store_object cuda_ipc_key; do rm -rf "$KVB_WRITE_CORPUS/$target"; done
"$build/src/net/net_test" --gtest_filter='*SeedCorpus*' > /dev/null
"$build/src/connector/handshake_test" --gtest_filter='*SeedCorpus*' > /dev/null
"$build/src/engine/engine_test" --gtest_filter='*SeedCorpus*' > /dev/null
"$build/src/transport/tcp_protocol_test" --gtest_filter='*SeedCorpus*' > /dev/null
"$build/src/store/store_object_test" --gtest_filter='*SeedCorpus*' > /dev/null
"$build/src/transport/cuda_ipc_key_test" --gtest_filter='*SeedCorpus*' > /dev/null
ls -R "$KVB_WRITE_CORPUS" | head -60
