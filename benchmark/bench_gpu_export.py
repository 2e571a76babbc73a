"""Export on vs off on one GPU, side by side in one run, plus the two other ways people get
hidden states today (upstream return_hidden_states, and an HF transformers forward).

Llama-3-8B geometry with dummy weights, --attention-backend triton, CUDA graphs on (defaults),
64 concurrent clients, prompts of 1024 and 4096 tokens. The export-off and export-on servers
run at the same time on the same GPU and are measured in alternating rounds.

    python benchmark/bench_gpu_export.py --phase radix-on  --out results.json
    python benchmark/bench_gpu_export.py --phase radix-off --out results.json   # adds to the file
    python benchmark/bench_gpu_export.py --phase baselines --out results.json
    python benchmark/bench_gpu_export.py --phase fp8 --out fp8.json    # export bf16 vs fp8_e4m3
    python benchmark/bench_gpu_export.py --phase memory --out results.json   # one server at a time
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the dev harness

from harness.bench import measure_prefill, provenance, random_prompts  # noqa: E402
from sglang_hs.format import iter_samples, read_export_json, sample_errors  # noqa: E402
from sglang_hs.tools.serve import LocalServer  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
FLAGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
         "--sampling-backend", "pytorch", "--skip-server-warmup", "--mem-fraction-static", "0.45",
         "--max-total-tokens", "300000"]
# (prompt length, prompts per round, concurrent clients)
SHAPES = [(1024, 192, 64), (4096, 64, 64), (1024, 256, 128)]
# --phase long: rounds of >= 30 s, as a real capture runs, export off vs on only; each round
# exports ~40 GB, checked on its first samples and removed before the next round.
LONG = [(1024, 1280, 64)]


def gpu_mem_by_server(servers):
    """MiB of GPU memory per server (sum over its process group), from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    res = {name: 0 for name in servers}
    for line in out.strip().splitlines():
        pid, mib = (int(x) for x in line.split(","))
        for name, s in servers.items():
            try:
                if os.getpgid(pid) == s.proc.pid:
                    res[name] += mib
            except ProcessLookupError:
                pass
    return res


def last_stats(log_path):
    lines = [ln for ln in open(log_path, errors="replace") if "sglang-hs stats:" in ln]
    return json.loads(lines[-1].split("sglang-hs stats:", 1)[1]) if lines else None


def consume(export_dir, prefix, seen, check=None):
    """What a trainer does with a round's samples: read and check each (the first `check`
    only, if given), then delete it, so /dev/shm holds one round at a time (5 rounds of 8B
    rows would not fit in it)."""
    info = read_export_json(export_dir)
    done = {"samples": 0, "bytes": 0, "errors": []}
    for entry, path in iter_samples(export_dir):
        if entry["id"] in seen or not entry["id"].startswith(prefix):
            continue
        seen.add(entry["id"])
        if check is None or done["samples"] < check:
            errors, _ = sample_errors(info, entry["id"], path, entry.get("num_tokens"), None, True)
            done["errors"] += errors[:2]
        done["samples"] += 1
        done["bytes"] += os.path.getsize(path)
        os.remove(path)
    return done


def phase_pair(model_dir, work, radix: bool, rounds: int, fp8: bool = False, save=lambda res: None,
               shapes=SHAPES, opt_out: bool = True):
    """Two servers side by side, measured in rounds whose order rotates: "off" (no export) vs
    "on" (export), plus "on_opt_out" (the export server, requests that say export: false),
    which splits the cost of export mode (aux capture in the model) from that of staging and
    writing rows. With fp8, "off" exports in bf16 and "on" in fp8 (the fp8/bf16 ratio).
    `save(res)` after every measurement, so a run cut short by a time limit keeps its rounds."""
    extra = [] if radix else ["--disable-radix-cache"]
    export_dir = tempfile.mkdtemp(prefix="hs-", dir="/dev/shm")
    base_dir = tempfile.mkdtemp(prefix="hs-bf16-", dir="/dev/shm")
    res = {"radix_cache": radix, "export_dir": export_dir, "shapes": {},
           "pair": "export bf16 (off) vs export fp8_e4m3 (on)" if fp8 else "export off vs on"}
    off_extra = ["--export-hidden-states-dir", base_dir] if fp8 else []
    on_extra = ["--export-dtype", "fp8_e4m3"] if fp8 else []
    tag = "fp8" if fp8 else radix if shapes is SHAPES else "long"
    warm = random_prompts(64, 1024, seed=7, vocab=128000)
    seen = set()
    consumed = {"samples": 0, "bytes": 0, "errors": []}
    consumed_base = {"samples": 0, "bytes": 0, "errors": []}  # fp8: the bf16 export of "off"
    with LocalServer(["--model-path", model_dir, *FLAGS, *extra, *off_extra], f"{work}/off-{tag}.log",
                     cpu=False) as off:
        res["startup_s_off"] = off.startup_s
        measure_prefill(off.url, warm, 64, rid_prefix="warm" if fp8 else None)
        res["gpu_mem_mib_off_alone"] = gpu_mem_by_server({"off": off})["off"]  # before "on" exists
        with LocalServer(["--model-path", model_dir, *FLAGS, *extra, "--export-hidden-states-dir", export_dir,
                          *on_extra], f"{work}/on-{tag}.log", cpu=False) as on:
            res["startup_s_on"] = on.startup_s
            measure_prefill(on.url, warm, 64, rid_prefix="warm")
            res["gpu_mem_mib_idle"] = gpu_mem_by_server({"off": off, "on": on})
            arms = [("off", off, None), ("on", on, None)] + ([("on_opt_out", on, False)] if opt_out and not fp8 else [])
            for length, n, clients in shapes:
                key = f"{length}x{clients}"
                rows = {name: [] for name, _, _ in arms}
                for r in range(rounds):
                    ps = random_prompts(n, length, seed=1000 * length + 7 * clients + r, vocab=128000)
                    order = arms[r % len(arms):] + arms[:r % len(arms)]
                    # The opt-out arm runs on the export server too: prompts of its own, or the
                    # prefix cache would serve it the rows "on" computed in the same round.
                    ps_opt_out = random_prompts(n, length, seed=1000 * length + 7 * clients + r + 500, vocab=128000)
                    for name, srv, export in order:
                        rid = f"{key}-r{r}-{name}" if (name == "on" or fp8) else None
                        m = measure_prefill(srv.url, ps_opt_out if name == "on_opt_out" else ps, clients,
                                            rid_prefix=rid, export=export)
                        m["position_in_round"] = order.index((name, srv, export))
                        rows[name].append(m)
                        res["shapes"][key] = {"rounds": rows, "complete": False}
                        save(res)
                        print(f"{tag} {key} round {r} {name}: {m['tokens_per_s']:.0f} tok/s "
                              f"p50 {m['latency_ms_p50']} ms", flush=True)
                    for d, total in ((export_dir, consumed), (base_dir, consumed_base)):
                        got = consume(d, f"{key}-r{r}-", seen, check=None if shapes is SHAPES else 32)
                        for k in ("samples", "bytes"):
                            total[k] += got[k]
                        total["errors"] += got["errors"]
                res["shapes"][key] = summarize(rows)
                save(res)
            res["gpu_mem_mib_after"] = gpu_mem_by_server({"off": off, "on": on})
            time.sleep(11)  # one more stats line from the writer
            res["export_stats"] = last_stats(on.log_path)
            res["consumed"] = consumed
            timed = [m for s in res["shapes"].values() for m in s["rounds"]["on"]]
            res["write_GBps_during_timed_rounds"] = consumed["bytes"] / sum(m["seconds"] for m in timed) / 1e9
            if fp8:  # both arms exported the same prompts
                res["consumed_bf16"] = consumed_base
                res["bytes_fp8_over_bf16"] = consumed["bytes"] / max(1, consumed_base["bytes"])
    subprocess.run(["rm", "-rf", export_dir, base_dir])
    return res


def phase_memory(model_dir, work):
    """The export's GPU memory: each server alone on the GPU (side by side, the one started
    second sizes itself from what the first left), the same KV pool (FLAGS fix
    --max-total-tokens), the same load (one round of every shape); nvidia-smi of the server's
    processes when idle after a warm-up and after the load, so the difference is what export
    mode adds: its captured aux planes and the gathered rows of a forward."""
    res = {}
    warm = random_prompts(64, 1024, seed=7, vocab=128000)
    for arm in ("off", "on"):
        export_dir = tempfile.mkdtemp(prefix="hs-mem-", dir="/dev/shm")
        extra = ["--export-hidden-states-dir", export_dir] if arm == "on" else []
        with LocalServer(["--model-path", model_dir, *FLAGS, *extra], f"{work}/mem-{arm}.log", cpu=False) as srv:
            measure_prefill(srv.url, warm, 64, rid_prefix="mem-warm" if arm == "on" else None)
            run = res[arm] = {"startup_s": srv.startup_s, "gpu_mem_mib_idle": gpu_mem_by_server({arm: srv})[arm]}
            seen, run["exported_samples"], run["sample_errors"] = set(), 0, []
            for length, n, clients in SHAPES:
                key = f"mem-{length}x{clients}"
                ps = random_prompts(n, length, seed=1000 * length + 7 * clients, vocab=128000)
                run[key] = measure_prefill(srv.url, ps, clients, rid_prefix=key if arm == "on" else None)
                got = consume(export_dir, "mem-", seen)  # /dev/shm holds one shape's rows at a time
                run["exported_samples"] += got["samples"]
                run["sample_errors"] += got["errors"]
            run["gpu_mem_mib_after_load"] = gpu_mem_by_server({arm: srv})[arm]
        subprocess.run(["rm", "-rf", export_dir])
    res["delta_mib"] = {k: res["on"][k] - res["off"][k] for k in ("gpu_mem_mib_idle", "gpu_mem_mib_after_load")}
    return res


def summarize(rows):
    """Per arm: median tokens/s; per arm vs "off": the per-round ratios, their median and range."""
    out = {"rounds": rows, "tokens_per_s_median": {k: statistics.median(x["tokens_per_s"] for x in v)
                                                   for k, v in rows.items()}}
    for name, v in rows.items():
        if name == "off":
            continue
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(v, rows["off"])]
        out[f"ratio_{name}"] = {"per_round": ratios, "median": statistics.median(ratios),
                                "min": min(ratios), "max": max(ratios)}
        # The same without each round's start and drain (harness.bench.steady_rate)
        steady = [a["steady_tokens_per_s"] / b["steady_tokens_per_s"] for a, b in zip(v, rows["off"])
                  if a.get("steady_tokens_per_s") and b.get("steady_tokens_per_s")]
        if steady:
            out[f"steady_ratio_{name}"] = {"per_round": steady, "median": statistics.median(steady),
                                           "min": min(steady), "max": max(steady)}
    out["ratio_median"] = out["ratio_on"]["median"]
    if all("held_ms_max" in m for m in rows["on"]):
        # Where a round's extra seconds go: the longest wait of an answer for its sample, and
        # that of the round's last answer (harness.bench.measure_prefill reads held_ms).
        out["tail"] = {"extra_s_per_round": [a["seconds"] - b["seconds"] for a, b in zip(rows["on"], rows["off"])],
                       "held_ms_max_per_round": [m["held_ms_max"] for m in rows["on"]],
                       "held_ms_last_per_round": [m["held_ms_last"] for m in rows["on"]]}
    out["latency_ms_p50_median"] = {k: statistics.median(x["latency_ms_p50"] for x in v) for k, v in rows.items()}
    out["latency_ms_p99_median"] = {k: statistics.median(x["latency_ms_p99"] for x in v) for k, v in rows.items()}
    return out


def phase_baselines(model_dir, work):
    res = {}
    with LocalServer(["--model-path", model_dir, *FLAGS, "--disable-radix-cache", "--enable-return-hidden-states"],
                f"{work}/rhs.log", cpu=False) as srv:
        ps = random_prompts(16, 1024, seed=5, vocab=128000)
        res["return_hidden_states"] = measure_prefill(srv.url, ps, 16, extra={"return_hidden_states": True})
        res["return_hidden_states"]["note"] = "final layer only, JSON floats in the response"
    res["hf_transformers"] = hf_forward_writes_planes(model_dir)
    return res


def hf_forward_writes_planes(model_dir, batch=8, length=1024, batches=6):
    """HF forward (bf16, output_hidden_states) writing the same planes to /dev/shm."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = [2, 16, 29]  # the default aux ids for 32 layers, HF convention
    out_dir = tempfile.mkdtemp(prefix="hf-", dir="/dev/shm")
    x = torch.randint(10, 128000, (batch, length), device="cuda")
    with torch.no_grad():
        model.model(input_ids=x, output_hidden_states=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        written = 0
        for b in range(batches):
            o = model.model(input_ids=x, output_hidden_states=True)
            aux = torch.stack([o.hidden_states[k] for k in ids], 2).cpu()
            fin = o.last_hidden_state.cpu()
            for j in range(batch):
                p = f"{out_dir}/{b}-{j}.safetensors"
                save_file({"aux_hidden_states": aux[j].contiguous(), "final_hidden_states": fin[j].contiguous()}, p)
                written += os.path.getsize(p)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    subprocess.run(["rm", "-rf", out_dir])
    del model
    torch.cuda.empty_cache()
    tokens = batch * length * batches
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "bytes_written": written,
            "batch": batch, "length": length}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["radix-on", "radix-off", "baselines", "fp8", "memory", "long"], required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp", help="folder for the servers' logs")
    a = p.parse_args()
    model_dir = tempfile.mkdtemp(prefix="llama3-8b-geometry-")
    json.dump(LLAMA3_8B, open(f"{model_dir}/config.json", "w"))
    data = json.load(open(a.out)) if os.path.exists(a.out) else {}
    data.setdefault("benchmark", "gpu_export_on_vs_off_llama3_8b_geometry")
    data.setdefault("provenance", {})[a.phase] = provenance([sys.executable, *sys.argv])
    data["server_flags"] = FLAGS
    data["shapes"] = SHAPES
    if a.phase == "baselines":
        data["baselines"] = phase_baselines(model_dir, a.work)
    elif a.phase == "memory":
        data["memory"] = phase_memory(model_dir, a.work)
    else:
        def save(res):
            json.dump({**data, a.phase: res}, open(a.out, "w"), indent=2)

        long = a.phase == "long"
        data[a.phase] = phase_pair(model_dir, a.work, a.phase != "radix-off", a.rounds, fp8=a.phase == "fp8",
                                   save=save, shapes=LONG if long else SHAPES, opt_out=not long)
    json.dump(data, open(a.out, "w"), indent=2)
    print(json.dumps({k: v for k, v in data.items() if k != "provenance"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
