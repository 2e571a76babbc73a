"""`sglang-hs capture --regenerate` in one pass vs two, end to end, side by side on one server:
conversations exported per second, in rounds on the same records, each way first in turn.

One pass: the last answer is written by the exporting request (decode rows). Two passes: it
is generated, then the conversation is exported by prefill. The server runs without the
prefix cache, so neither way reuses what the other computed.

    .venv/bin/python benchmark/bench_regenerate.py --rounds 5
    python3 benchmark/bench_regenerate.py --gpu --model M --records 128 --max-new-tokens 256 \
        --out benchmark/results/gpu_regenerate_h200.json

--context-tokens N makes the long-context shape: each conversation is the bundled ones put
end to end until its chat-templated text reaches N tokens of the model's tokenizer.
"""

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from importlib import resources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the dev harness

from harness.bench import provenance, spread  # noqa: E402
from sglang_hs.tools import models  # noqa: E402
from sglang_hs.tools.capture import CaptureConfig, capture  # noqa: E402
from sglang_hs.tools.records import to_messages  # noqa: E402
from sglang_hs.tools.serve import LocalServer  # noqa: E402


def joined(chats, n, tokens, model):
    """n conversations, each the bundled ones (cycled) put end to end, system turns after the
    first left out, until the model's chat template makes it at least `tokens` long. Every
    bundled conversation ends with an assistant turn, so turns still alternate."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    src, out = itertools.cycle(chats), []
    for _ in range(n):
        msgs = list(next(src))
        while len(tok.encode(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)) < tokens:
            msgs += [m for m in next(src) if m["role"] != "system"]
        out.append(msgs)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--records", type=int, default=24, help="conversations per round (from the bundled 200)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--work-dir", default=".cache")
    p.add_argument("--model", help="default: SmolLM2-135M-Instruct from the embedded GGUF")
    p.add_argument("--gpu", action="store_true", help="the stock launcher on the GPU (triton attention) instead of CPU")
    p.add_argument("--out", default="benchmark/results/cpu_regenerate_smollm2.json")
    p.add_argument("--log", help="the server's log (default: in the run's temporary folder, removed after)")
    p.add_argument("--context-tokens", type=int, help="conversations of at least this many tokens (bundled ones joined)")
    a = p.parse_args()
    model = a.model or models.smollm2(os.path.join(a.work_dir, "models", "smollm2-135m-instruct"))
    work = tempfile.mkdtemp(prefix="sglang-hs-regenerate-")
    data = os.path.join(work, "chats.jsonl")
    with open(resources.files("sglang_hs").joinpath("data/chats_200.jsonl")) as src:
        lines = list(itertools.islice(src, None if a.context_tokens else a.records))
    if a.context_tokens:
        chats = [m for m in map(to_messages, map(json.loads, lines)) if m]
        lines = [json.dumps({"messages": m}) + "\n" for m in joined(chats, a.records, a.context_tokens, model)]
    with open(data, "w") as dst:
        dst.writelines(lines)
    args = ["--model-path", model, "--export-hidden-states-dir", os.path.join(work, "export"), "--skip-server-warmup",
            "--disable-radix-cache"]
    if a.gpu:
        args += ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
    ways = {"one_pass": 1, "two_passes": 2}
    rows = {w: [] for w in ways}
    try:
        with LocalServer(args, a.log or os.path.join(work, "server.log"), cpu=not a.gpu) as srv:
            def run(way, prefix):
                cfg = CaptureConfig(servers=[srv.url], data=data, out=srv.export_dir, regenerate=True,
                                    regenerate_passes=ways[way], max_new_tokens=a.max_new_tokens,
                                    concurrency=a.concurrency, id_prefix=prefix, progress=False)
                s = capture(cfg)
                assert s.failed == 0 and s.exported == a.records, s.line()
                return s

            for way in ways:
                run(way, f"warm-{way}-")
            for k in range(a.rounds):
                for way in list(ways)[k % 2:] + list(ways)[:k % 2]:  # each way first in turn
                    s = run(way, f"r{k}-{way}-")
                    rows[way].append({"seconds": s.seconds, "conversations_per_s": s.exported / s.seconds,
                                      "tokens": s.tokens, "bytes": s.bytes})
                    print(way, k, json.dumps(rows[way][-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = [o["conversations_per_s"] / t["conversations_per_s"] for o, t in zip(rows["one_pass"], rows["two_passes"])]
    result = {
        "what": "capture --regenerate end to end, conversations exported per second, one pass (the last answer's "
                "rows kept as it is decoded) vs two passes (generate, then prefill the conversation), on one server "
                "without the prefix cache, same records each round, each way first in turn",
        "model": model, "device": "gpu" if a.gpu else "cpu", "records_per_round": a.records,
        "context_tokens": a.context_tokens,
        "max_new_tokens": a.max_new_tokens, "concurrency": a.concurrency,
        **{w: {k: spread([r[k] for r in rows[w]]) for k in ("conversations_per_s", "tokens")} for w in ways},
        "one_pass_vs_two_passes": spread(ratio), "median_ratio": statistics.median(ratio),
        "rounds": rows, **provenance([sys.executable, *sys.argv]),
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"median_ratio": result["median_ratio"], "one_pass_vs_two_passes": result["one_pass_vs_two_passes"]}))


if __name__ == "__main__":
    main()
