"""Parse launcher command lines exactly as `python -m sglang.launch_server` does (plugins
loaded, then prepare_server_args), without starting anything; print each outcome as JSON."""

import json
import sys

from sglang.srt.plugins import load_plugins

load_plugins()
from sglang.srt.server_args import prepare_server_args  # noqa: E402

results = []
for argv in json.loads(sys.argv[1]):
    try:
        prepare_server_args(argv)
        results.append({"ok": True})
    except SystemExit as e:
        results.append({"ok": False, "message": str(e.code)})
print("PROBE_JSON " + json.dumps(results))
