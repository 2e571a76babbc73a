"""What installing sglang-hs costs a server that does not export: SGLang with our plugin
loaded and no export flag ("installed") against the same SGLang with the plugin kept out by
SGLang's own plugin whitelist (SGLANG_PLUGINS naming every other plugin; "not_loaded"), side by
side on one GPU, in alternating rounds: prefill (prompt tokens/s, one output token) and decode
(output tokens/s, inter-token latency).

Llama-3-8B geometry with dummy weights, triton attention, decode CUDA graphs, equal KV caches.

    python benchmark/bench_plugin_off.py --rounds 5 --out benchmark/results/gpu_plugin_off_h100.json
"""

import argparse
import json
import os
import sys
import tempfile
from importlib.metadata import entry_points

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dev harness

from bench_gpu_export import LLAMA3_8B  # noqa: E402
from bench_live import kv_tokens  # noqa: E402
from harness.bench import measure_decode, measure_prefill, provenance, random_prompts, spread  # noqa: E402
from sglang_hs.tools.serve import LocalServer  # noqa: E402

KV_TOKENS = 65536
FLAGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
         "--sampling-backend", "pytorch", "--skip-server-warmup", "--mem-fraction-static", "0.4",
         "--max-total-tokens", str(KV_TOKENS), "--cuda-graph-backend-prefill", "disabled"]
ARMS = ("installed", "not_loaded")


def whitelist_without_us() -> str:
    """SGLANG_PLUGINS for the arm without our plugin: every other installed plugin stays loaded."""
    others = sorted({ep.name for ep in entry_points(group="sglang.srt.plugins")} - {"sglang_hs"})
    return ",".join(others) or "no-plugin-but-sglang-hs-is-excluded"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefill-prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-requests", type=int, default=64)
    p.add_argument("--decode-prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--work", default="/tmp")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    model = tempfile.mkdtemp(prefix="llama3-8b-geometry-")
    json.dump(LLAMA3_8B, open(f"{model}/config.json", "w"))
    res = {"benchmark": "gpu_plugin_installed_flag_off_vs_not_loaded", "provenance": provenance([sys.executable, *sys.argv]),
           "server_flags": FLAGS, "shape": vars(a), "sglang_plugins_not_loaded": whitelist_without_us(),
           "rounds": {arm: [] for arm in ARMS}}

    def save():
        json.dump(res, open(a.out, "w"), indent=2)

    installed = LocalServer(["--model-path", model, *FLAGS], f"{a.work}/plugin-installed.log", cpu=False)
    bare = LocalServer(["--model-path", model, *FLAGS], f"{a.work}/plugin-not-loaded.log", cpu=False)
    bare.env["SGLANG_PLUGINS"] = res["sglang_plugins_not_loaded"]
    with installed, bare:  # one after the other: each sizes its KV cache from the memory free at its start
        servers = {"installed": installed, "not_loaded": bare}
        res["kv_tokens"] = {k: kv_tokens(s.log_path) for k, s in servers.items()}
        warm = random_prompts(a.concurrency, a.decode_prompt_len, seed=3, vocab=128000)
        for name, srv in servers.items():
            measure_decode(srv.url, warm, a.concurrency, 32, rid_prefix=f"warm-{name}")
        for r in range(a.rounds):
            pre = random_prompts(a.prefill_prompts, a.prompt_len, seed=100 + r, vocab=128000)
            dec = random_prompts(a.decode_requests, a.decode_prompt_len, seed=200 + r, vocab=128000)
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for name in order:
                srv = servers[name]
                m = {"prefill": measure_prefill(srv.url, pre, a.concurrency),
                     "decode": measure_decode(srv.url, dec, a.concurrency, a.max_new_tokens, rid_prefix=f"r{r}-{name}"),
                     "position_in_round": order.index(name)}
                res["rounds"][name].append(m)
                save()
                print(f"round {r} {name}: prefill {m['prefill']['tokens_per_s']:.0f} tok/s, decode "
                      f"{m['decode']['output_tokens_per_s']:.0f} out tok/s, ITL p99 {m['decode']['itl_ms_p99']} ms",
                      flush=True)
        res["startup_s"] = {k: s.startup_s for k, s in servers.items()}
    rounds = res["rounds"]
    ratio = {
        "prefill_tokens_per_s": spread([i["prefill"]["tokens_per_s"] / n["prefill"]["tokens_per_s"]
                                        for i, n in zip(rounds["installed"], rounds["not_loaded"])]),
        "decode_output_tokens_per_s": spread([i["decode"]["output_tokens_per_s"] / n["decode"]["output_tokens_per_s"]
                                              for i, n in zip(rounds["installed"], rounds["not_loaded"])]),
        "decode_itl_ms_p99": spread([i["decode"]["itl_ms_p99"] / n["decode"]["itl_ms_p99"]
                                     for i, n in zip(rounds["installed"], rounds["not_loaded"])]),
    }
    res["summary"] = {"installed_over_not_loaded": ratio,
                      **{arm: {"prefill_tokens_per_s": spread([m["prefill"]["tokens_per_s"] for m in v]),
                               "decode_output_tokens_per_s": spread([m["decode"]["output_tokens_per_s"] for m in v])}
                         for arm, v in rounds.items()}}
    res["goals"] = {"prefill_ratio_ge_0.998": ratio["prefill_tokens_per_s"]["median"] >= 0.998,
                    "decode_ratio_ge_0.998": ratio["decode_output_tokens_per_s"]["median"] >= 0.998}
    save()
    print(json.dumps(res["summary"]["installed_over_not_loaded"], indent=1), json.dumps(res["goals"]))


if __name__ == "__main__":
    main()
