#!/usr/bin/env bash
# Seeds the fuzz corpora with the payloads of ../shared/vectors/wire-vectors.json (the corpus is
# not committed: it is made from shared material at run time).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
vectors=${KVPEER_VECTORS:-$here/../../shared/vectors/wire-vectors.json}
for target in decode decode_value json_roundtrip; do
  mkdir -p "$here/corpus/$target"
  python3 - "$vectors" "$here/corpus/$target" <<'PY'
import json, sys, pathlib
vectors, out = sys.argv[1], pathlib.Path(sys.argv[2])
for v in json.load(open(vectors))["vectors"]:
    (out / f"vector-{v['name']}").write_bytes(bytes.fromhex(v["msgpack_hex"]))
PY
done
echo "seeded $(ls "$here/corpus/decode" | wc -l) payloads per target"
