#!/usr/bin/env python3
"""Checks that includes follow the layers of DESIGN.md: a file of src/<layer>/
includes only its own layer's headers, lower layers' and the public headers
(include/kvbridge/). Tests (*_test.cc, and the *_test_util.h helpers only they
include) may also include src/testing/. Exits 1
listing every include that points up or sideways.

Usage: check_layers.py SOURCE_ROOT
"""
import pathlib
import re
import sys

# What each layer may include besides itself and include/kvbridge/.
BELOW = {
    "common": set(),
    "layout": {"common"},
    "plan": {"common", "layout"},
    "net": {"common"},
    "device": {"common"},
    "transport": {"common", "net", "device"},
    "engine": {"common", "net", "device", "transport"},
    "connector": {"common", "net", "layout", "plan", "device", "transport", "engine"},
    "store": {"common", "net", "layout", "plan", "device", "transport"},
    "discovery": {"common", "net"},
    "discovery_sync": {"common", "net", "layout", "plan", "device", "transport", "engine", "connector", "discovery"},
    "testing": {"common", "net", "layout", "plan", "device", "transport", "engine", "connector", "store"},
}
# The layer each public header belongs to.
PUBLIC = {
    "status.h": "common", "transfer_op.h": "common", "host_memory.h": "common", "readiness.h": "common",
    "layout.h": "layout", "layout_json.h": "layout", "presets.h": "layout",
    "plan.h": "plan", "verify.h": "plan", "content.h": "plan", "execute.h": "plan",
    "engine.h": "engine", "connector.h": "connector", "store.h": "store", "store_key.h": "store",
    "discovery.h": "discovery", "discovery_sync.h": "discovery_sync",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/([^"]+)"')

root = pathlib.Path(sys.argv[1])
bad = []
for layer, allowed in BELOW.items():
    for path in sorted((root / "src" / layer).rglob("*")):
        if path.suffix not in (".h", ".cc", ".cu"):
            continue
        # Tests, and the helpers only they include (*_test_util.h).
        is_test = path.name.endswith("_test.cc") or path.name.endswith("_test_util.h")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            if target == "kvbridge":
                if m.group(2) not in PUBLIC:
                    bad.append(f"{path.relative_to(root)}:{n}: kvbridge/{m.group(2)} has no layer in PUBLIC here")
                    continue
                target = PUBLIC[m.group(2)]
            if target in ("kvbridge", layer) or target in allowed or (is_test and target == "testing"):
                continue
            if target not in BELOW:
                continue  # a directory of the including layer (e.g. "conformance/"), or a system one
            bad.append(f"{path.relative_to(root)}:{n}: {layer} includes {target}/ ({line.strip()})")
if bad:
    print("includes against the layers of DESIGN.md:")
    print("\n".join(bad))
    sys.exit(1)
print(f"layers: every include of src/ points down ({', '.join(BELOW)})")
