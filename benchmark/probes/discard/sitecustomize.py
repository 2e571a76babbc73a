"""Put first on PYTHONPATH of a live-capture server in bench_live.py: while the file named by
$SGLANG_HS_DISCARD_FLAG exists, the directory sink's `put` returns without building or writing
the sample. Everything before it still runs (the hooks, the gather, the device->host copy, the
writer thread waiting for it, the outcome), so an arm with the flag set measures capture without
the file writing: the A/B that says what writing takes from the scheduler."""

import os

FLAG = os.environ.get("SGLANG_HS_DISCARD_FLAG")

if FLAG:
    from sglang_hs.overlay import sinks

    _put = sinks.DirectorySink.put

    def put(self, st):
        if os.path.exists(FLAG):
            return sinks.Placed(bytes=0, path="(discarded)")
        return _put(self, st)

    sinks.DirectorySink.put = put
