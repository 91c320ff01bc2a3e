#!/usr/bin/env bash
# Regenerate the gRPC stubs (+ .pyi) from protos/ into services/common/proto/ (committed, so a
# fresh clone needs no generation step). Usage: scripts/gen_protos.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
OUT=services/common/proto
rm -rf "$OUT/qos"
mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -I protos --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  protos/qos/v1/*.proto
# protoc writes absolute imports (`from qos.v1 import ...`); make them package-relative to ours.
find "$OUT/qos" -name '*.py' -o -name '*.pyi' | xargs sed -i 's/^from qos\.v1 import/from services.common.proto.qos.v1 import/'
touch "$OUT/__init__.py" "$OUT/qos/__init__.py" "$OUT/qos/v1/__init__.py"
echo "generated $(ls "$OUT"/qos/v1/*.py | wc -l) modules in $OUT/qos/v1"
