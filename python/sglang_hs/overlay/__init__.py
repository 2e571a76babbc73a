"""The overlay: what runs inside SGLang's processes (seams, admission, row planning, host
staging, the writer, notification). Only `seams` imports `sglang.srt`; the rest takes plain
values and is unit-tested without a server."""
