"""End to end: the serving runtime's own states train an EAGLE-3 drafter that SGLang serves; a
drafter trained on Hugging Face states of the very same tokens is the control.

Phases (each reads and writes one work folder, so GPU calls can run them apart):
  capture  the target, served quantized with export on, regenerates responses (greedy) to
           --train-prompts generated prompts and --eval-prompts held-out ones; both are captured,
           converted for SpecForge, and split into train/ and eval/.
  hf       the same token sequences through HF transformers in bf16 (SpecForge's former HF
           dumper: hidden_state = post-norm last, aux = HF hidden_states[k] at the export's ids).
  train    SpecForge 0.2.0 `specforge train`, once per state source, the same config, seed and
           data order; each evaluated on the runtime's held-out states (offline step-0 accuracy).
  export   `specforge.export.to_sglang` with the draft config `convert` wrote (untied lm_head,
           aux ids in SGLang's numbering), checked in the folder SGLang will read.
  serve    the quantized target with each draft (EAGLE3, temperature 0) on the held-out prompts,
           per draft config, and the target alone, all kept up and measured one at a time in
           rotating rounds: accept length, output tokens/s at 16 clients and at 1.

    python benchmark/e2e_eagle3.py --work /tmp/e2e --model M --phases capture hf train export serve
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harness.bench import provenance, summarize_rounds  # noqa: E402
from harness.trainers import shims_applied, specforge_cmd, specforge_steps, to_sglang_cmd  # noqa: E402
from sglang_hs.tools.convert import DRAFT_CONFIG  # noqa: E402

TASKS = [
    "Explain {} to a ten-year-old.", "Write a short poem about {}.", "List three facts about {}.",
    "What are the pros and cons of {}?", "Give me a one-paragraph summary of {}.",
    "Write a haiku about {}.", "How would you teach {} to a beginner?", "Tell a short story involving {}.",
    "What is a common misconception about {}?", "Describe {} in five sentences.",
    "Write a product description for something related to {}.", "What questions should I ask an expert on {}?",
    "Compare {} with something from everyday life.", "Write a friendly email inviting a friend to learn about {}.",
    "Give step-by-step advice for getting started with {}.", "What is the history of {} in brief?",
    "Write a limerick about {}.", "Why does {} matter?", "Create a quiz with three questions about {}.",
    "Summarize the main ideas behind {} as bullet points.",
]
SUBJECTS = [
    "photosynthesis", "the moon", "volcanoes", "honeybees", "the internet", "rainbows", "the Roman Empire",
    "gardening", "chess", "recycling", "black holes", "the water cycle", "bicycles", "coffee", "penguins",
    "electricity", "the ocean", "friendship", "music theory", "baking bread", "time zones", "earthquakes",
    "dinosaurs", "the human heart", "solar panels", "sleep", "origami", "trains", "vaccines", "maps",
    "mountains", "jazz", "the printing press", "clouds", "fractions", "magnets", "libraries", "tea",
    "deserts", "robots", "the alphabet", "olympic games", "soap", "whales", "compost", "lighthouses",
    "spiders", "saving money", "the Silk Road", "snowflakes", "video games", "bridges", "the immune system",
    "kites", "ancient Egypt", "forests", "public speaking", "cheese", "comets", "glass", "marathons",
    "the metric system", "elephants", "yoga", "airplanes", "paper", "coral reefs", "birthdays", "rivers",
    "calendars", "democracy", "cooking rice", "the seasons", "telescopes", "autumn leaves", "ants",
    "swimming", "the periodic table", "dreams", "windmills", "puzzles", "owls", "salt", "languages",
    "castles", "thunderstorms", "the stock market", "camping", "pianos", "batteries", "tides", "butterflies",
    "pottery", "the Great Wall", "wolves", "gravity", "letters and postcards", "tomatoes", "planets",
    "sunscreen",
]
# Speculative settings (steps / top-k / draft tokens); [] = SGLang 0.5.17 chooses.
SPEC_SETTINGS = {"topk1-steps3": ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                  "--speculative-num-draft-tokens", "4"],
                 "sglang-default": []}
SOURCES = ("runtime", "hf")  # whose states a drafter trains on


def prompts(n_train: int, n_eval: int, seed: int = 0):
    """Disjoint generated prompt sets: every (task, subject) pair once, shuffled."""
    pairs = [t.format(s) for t in TASKS for s in SUBJECTS]
    if n_train + n_eval > len(pairs):
        raise SystemExit(f"at most {len(pairs)} prompts: --train-prompts + --eval-prompts is too large")
    random.Random(seed).shuffle(pairs)
    return pairs[:n_train], pairs[n_train:n_train + n_eval]


def server_args(a, model, mem_fraction=None):
    gpu = a.device == "cuda"
    # Graphs for the batch sizes these runs reach (16 clients decode, prefill chunks); fewer
    # captured sizes start a server in well under a minute.
    extra = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
             "--mem-fraction-static", mem_fraction or "0.5",
             "--cuda-graph-max-bs-decode", "64", "--cuda-graph-max-bs-prefill", "1024"] if gpu else []
    quant = ["--quantization", a.quantization] if a.quantization else []
    return ["--model-path", model, "--skip-server-warmup", *extra, *quant]


def phase_capture(a, w, res):
    from sglang_hs.tools.capture import CaptureConfig, capture
    from sglang_hs.tools.convert import inspect_export, to_specforge
    from sglang_hs.tools.serve import LocalServer

    train, held_out = prompts(a.train_prompts, a.eval_prompts)
    export = os.path.join(w, "export")
    sets = {}
    for name, ps in (("train", train), ("eval", held_out)):
        path = os.path.join(w, f"{name}.jsonl")
        with open(path, "w") as f:
            for i, p in enumerate(ps):
                # capture --regenerate has the target write every assistant turn (empty here)
                msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]
                f.write(json.dumps({"id": f"{name}-{i:05d}", "messages": msgs}) + "\n")
        sets[name] = path
    args = [*server_args(a, a.model), "--export-hidden-states-dir", export]
    t0 = time.time()
    with LocalServer(args, os.path.join(w, "capture-server.log"), cpu=a.device == "cpu") as srv:
        res["capture"] = {"startup_s": srv.startup_s, "server_args": args}
        for name, path in sets.items():
            s = capture(CaptureConfig(servers=[srv.url], data=path, out=export, regenerate=True,
                                      max_new_tokens=a.max_new_tokens, concurrency=64, progress=False))
            res["capture"][name] = s.line()
    res["capture"]["seconds"] = round(time.time() - t0, 1)
    res["capture"]["export"] = inspect_export(export)
    sf = os.path.join(w, "sf")
    rep = to_specforge(export, sf)
    res["capture"]["convert"] = rep.line()
    # One export, two sets: move each sample's file under train/ or eval/ by its id.
    ids = json.load(open(os.path.join(sf, "sglang_hs_index.json")))["ids"]
    for idx, sid in enumerate(ids):
        src, = glob.glob(os.path.join(sf, "rows_*", f"data_{idx}.ckpt"))
        dst = os.path.join(sf, "runtime", sid.split("-", 1)[0], os.path.relpath(src, sf))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
    for d in glob.glob(os.path.join(sf, "rows_*")):
        os.rmdir(d)
    res["capture"]["samples"] = {k: len(glob.glob(os.path.join(sf, "runtime", k, "*", "*.ckpt"))) for k in sets}


def phase_hf(a, w, res):
    """The runtime's training tokens and masks, states from HF transformers in bf16."""
    import torch

    from sglang_hs.format import read_export_json
    from sglang_hs.tools.verify import hf_planes, load_hf

    ids = read_export_json(os.path.join(w, "export"))["aux_layer_ids"]
    model = load_hf(a.hf_model or a.model, torch.bfloat16, a.device)
    src_root, dst_root = os.path.join(w, "sf", "runtime", "train"), os.path.join(w, "sf", "hf", "train")
    cos = {f"aux[{k}]": [] for k in ids} | {"final": []}
    t0 = time.time()
    for src in sorted(glob.glob(os.path.join(src_root, "*", "*.ckpt"))):
        d = torch.load(src)
        tok = d["input_ids"].reshape(-1)
        planes = hf_planes(model, tok, ids).to(torch.bfloat16).cpu()  # [T, K+1, H]
        n = tok.numel()
        out = {"input_ids": d["input_ids"], "loss_mask": d["loss_mask"],
               "hidden_state": planes[:, -1][None].clone(), "aux_hidden_state": planes[:, :-1].reshape(1, n, -1).clone()}
        dst = os.path.join(dst_root, os.path.relpath(src, src_root))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        torch.save(out, dst)
        # How far the two runtimes' states are apart, per plane (mean cosine over tokens).
        ours = torch.cat([d["aux_hidden_state"].reshape(n, len(ids), -1), d["hidden_state"].reshape(n, 1, -1)], 1)
        c = torch.nn.functional.cosine_similarity(ours.float(), planes.float(), dim=-1)  # [T, K+1]
        for j, name in enumerate(cos):
            cos[name].append(c[:, j])
    res["hf"] = {"seconds": round(time.time() - t0, 1), "model": a.hf_model or a.model, "dtype": "bfloat16",
                 "runtime_vs_hf_mean_cosine": {k: float(torch.cat(v).mean()) for k, v in cos.items()},
                 "runtime_vs_hf_p01_cosine": {k: float(torch.cat(v).quantile(0.01)) for k, v in cos.items()}}


def phase_train(a, w, res):
    """Both drafters train at once (two processes on one GPU): the same config, seed and data
    order, so only the states differ; wall time is halved, the steps are the same."""
    sf = os.path.join(w, "sf")
    res["train"] = {"draft_config": json.load(open(os.path.join(sf, DRAFT_CONFIG)))}  # written by convert
    runs = {}
    for src in SOURCES:
        out = os.path.join(w, f"train-{src}")
        shutil.rmtree(out, ignore_errors=True)
        cmd = specforge_cmd(
            "train", "--config", os.path.join(sf, "specforge.yaml"),
            f"data.hidden_states_path={os.path.join(sf, src, 'train')}",
            f"data.eval_hidden_states_path={os.path.join(sf, 'runtime', 'eval')}",
            f"training.eval_interval={a.steps}", f"training.max_steps={a.steps}", f"training.num_epochs={a.epochs}",
            f"training.seed={a.seed}", f"training.learning_rate={a.lr}", "training.log_interval=10",
            "training.fsdp_sharding=NO_SHARD",
            f"output_dir={out}", f"data.cache_dir={os.path.join(w, f'sf-cache-{src}')}",
            f"model.cache_dir={os.path.join(w, f'sf-cache-{src}')}", "data.dataloader_num_workers=2")
        log = open(os.path.join(w, f"train-{src}.log"), "w+")
        runs[src] = (cmd, log, time.time(), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    failed = []
    for src, (cmd, log, t0, proc) in runs.items():
        rc = proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        steps = specforge_steps(text)
        train = [s for s in steps if "loss" in s]
        evals = [s for s in steps if any(k.startswith("eval") for k in s)]
        res["train"][src] = {
            "returncode": rc, "seconds": round(time.time() - t0, 1), "command": cmd[3:],
            "shims": shims_applied(text), "steps_logged": len(train), "loss": [s["loss"] for s in train],
            "acc_0": [s.get("acc_0") for s in train], "eval": evals[-1] if evals else None,
            # offline step-0 accuracy on the serving runtime's held-out states
            "eval_step0_accuracy": evals[-1]["eval/per_position_acc"][0] if evals else None,
            "log_tail": text[-2500:] if rc else ""}
        if rc:
            failed.append(src)
    if failed:
        raise SystemExit(f"specforge train failed for {failed}: see {w}/train-*.log")


def phase_export(a, w, res):
    res["export"] = {}
    for src in SOURCES:
        dst = os.path.join(w, f"draft-{src}")
        shutil.rmtree(dst, ignore_errors=True)
        cmd = to_sglang_cmd("--checkpoint", os.path.join(w, f"train-{src}"),
                            "--draft-config", os.path.join(w, "sf", DRAFT_CONFIG), "--output-dir", dst)
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if r.returncode:
            raise SystemExit(f"to_sglang ({src}) failed:\n{(r.stdout + r.stderr)[-3000:]}")
        cfg = json.load(open(os.path.join(dst, "config.json")))
        want = json.load(open(os.path.join(w, "sf", DRAFT_CONFIG)))["eagle_config"]
        # The two silent failures: a tied head (SGLang drops the trained lm_head) and aux ids
        # in another numbering (every layer shifted).
        if cfg.get("tie_word_embeddings") is not False or cfg.get("eagle_config") != want:
            raise SystemExit(f"{dst}/config.json: tie_word_embeddings {cfg.get('tie_word_embeddings')!r}, "
                             f"eagle_config {cfg.get('eagle_config')!r}; expected False and {want}")
        res["export"][src] = {"dir": dst, "files": sorted(os.listdir(dst)), "eagle_config": cfg["eagle_config"]}


def serve_shims(device: str):
    """What serving a draft needs on this host, named so a result says which applied:
    G1 (no `deep_gemm`, as on the GPU host's bundle): harness/stubs/deep_gemm stands in for the
       module SGLang's EAGLE v2 worker imports but never calls for a Llama target; JIT DeepGEMM
       is off so that nothing takes the stub for the real one. Every served run gets it, the
       target alone too, so they differ only in the draft."""
    if device != "cuda" or importlib.util.find_spec("deep_gemm"):
        return [], {}
    stubs = os.path.join(REPO, "harness", "stubs")
    return ["G1"], {"PYTHONPATH": os.pathsep.join(filter(None, [stubs, os.environ.get("PYTHONPATH")])),
                    "SGLANG_ENABLE_JIT_DEEPGEMM": "0"}


def _generate_all(url, ids_list, max_new_tokens, concurrency):
    import concurrent.futures as cf

    import requests

    def one(ids):
        r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}}, timeout=1800)
        r.raise_for_status()
        return r.json()["meta_info"]

    t0 = time.time()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        metas = list(ex.map(one, ids_list))
    wall = time.time() - t0
    out_tokens = sum(m["completion_tokens"] for m in metas)
    acc = [m["spec_accept_length"] for m in metas if m.get("spec_accept_length") is not None]
    return {"requests": len(metas), "output_tokens": out_tokens, "seconds": round(wall, 2),
            "output_tokens_per_s": out_tokens / wall,
            "accept_length_mean": statistics.mean(acc) if acc else None,
            "accept_length_median": statistics.median(acc) if acc else None}


def phase_serve(a, w, res):
    """Every server (the target alone, each drafter per speculative setting) is started and kept
    up; then they are measured one at a time, in an order that rotates each round, so each ratio
    to the target alone comes from the same rounds."""
    import contextlib

    import requests
    from transformers import AutoTokenizer

    from sglang_hs.tools.masks import prompt_ids
    from sglang_hs.tools.serve import LocalServer

    tok = AutoTokenizer.from_pretrained(a.model)
    _, held_out = prompts(a.train_prompts, a.eval_prompts)
    held_out = held_out[:a.serve_prompts]
    ids_list = [prompt_ids(tok, [{"role": "user", "content": p}]) for p in held_out]
    runs = [("target-only", None, [])] + [(f"{src}/{name}", src, flags) for name, flags in SPEC_SETTINGS.items()
                                           for src in SOURCES]
    runs = [r for r in runs if not a.serve_runs or r[0] in a.serve_runs]
    # --mem-fraction-static is a fraction of the memory free when a server starts, so servers
    # started one after another fit with this share each, however many there are.
    share = f"{0.8 / len(runs):.3f}" if a.device == "cuda" else None
    shims, env = serve_shims(a.device)
    servers = {}
    for label, src, flags in runs:
        # The servers not being measured sleep instead of polling for work.
        args = [*server_args(a, a.model, mem_fraction=share), "--sleep-on-idle"]
        if src:
            args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                     os.path.join(w, f"draft-{src}"), *flags]
        servers[label] = LocalServer(args, os.path.join(w, f"serve-{label.replace('/', '-')}.log"),
                                     cpu=a.device == "cpu", timeout_s=900)
        servers[label].env.update(env)
    res["serve"] = {"prompts": len(ids_list), "max_new_tokens": a.max_new_tokens, "rounds": a.rounds,
                    "concurrency": [16, 1], "single_stream_prompts": a.single_stream_prompts,
                    "memory_fraction_each": share, "shims": shims, "runs": {}}
    with contextlib.ExitStack() as stack:
        # One after another: SGLang sizes its memory pool from what is free while it loads, so
        # servers starting at once misjudge each other's allocations (seen on the H200).
        for label in list(servers):
            try:
                stack.enter_context(servers[label])
            except Exception as e:  # one server that does not start costs its runs, not the others'
                res["serve"]["runs"][label] = {"error": str(e)[-3000:]}
                print(f"{label}: did not start: {str(e)[-1500:]}", flush=True)
                del servers[label]
        per = {label: {"c16": [], "c1": []} for label in servers}
        for label, srv in servers.items():
            res["serve"]["runs"][label] = run = {"startup_s": srv.startup_s}
            try:
                _generate_all(srv.url, ids_list[:4], 16, 4)  # warm-up
                info = requests.get(srv.url + "/get_server_info", timeout=30).json()
            except Exception as e:
                run["error"] = f"warm-up: {e}; log:\n{srv.log_tail()}"
                continue
            run["speculative"] = {k: info.get(k) for k in ("speculative_algorithm", "speculative_num_steps",
                                                           "speculative_eagle_topk", "speculative_num_draft_tokens")}
        labels = list(servers)
        for r in range(a.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                if "error" in res["serve"]["runs"][label]:
                    continue
                url = servers[label].url
                try:
                    c16 = _generate_all(url, ids_list, a.max_new_tokens, 16)
                    c1 = _generate_all(url, ids_list[:a.single_stream_prompts], a.max_new_tokens, 1)
                except Exception as e:  # a server that fails mid-run is reported; the others go on
                    res["serve"]["runs"][label]["error"] = f"round {r}: {e}; log:\n{servers[label].log_tail()}"
                    continue
                per[label]["c16"].append(c16)
                per[label]["c1"].append(c1)
                print(label, r, json.dumps({"c16": c16, "c1": c1}), flush=True)
            for c in ("c16", "c1"):
                for label, summary in summarize_rounds({k: m[c] for k, m in per.items()}, "target-only").items():
                    res["serve"]["runs"][label][c] = summary
            save(a, res)  # a call cut short keeps the rounds it finished


def save(a, res):
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


PHASES = {"capture": phase_capture, "hf": phase_hf, "train": phase_train, "export": phase_export,
          "serve": phase_serve}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="folder for every artifact (states, drafts, logs)")
    p.add_argument("--model", required=True, help="the target checkpoint (HF layout)")
    p.add_argument("--hf-model", help="the checkpoint HF transformers reads (default: --model)")
    p.add_argument("--phases", nargs="+", choices=list(PHASES), default=list(PHASES))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quantization", default="fp8", help="the target's SGLang --quantization ('' for none)")
    p.add_argument("--train-prompts", type=int, default=1600)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--serve-prompts", type=int, default=128)
    p.add_argument("--serve-runs", nargs="*", help="labels to serve (default: target-only and every "
                   "SOURCE/SETTING, e.g. runtime/topk1-steps3)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="serve: measuring rounds per server")
    p.add_argument("--single-stream-prompts", type=int, default=8, help="serve: prompts sent one at a time per round")
    p.add_argument("--steps", type=int, default=3200, help="optimizer steps (batch 1)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", required=True, help="results JSON (updated after every phase)")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    res = json.load(open(a.out)) if os.path.exists(a.out) else {}
    res.setdefault("provenance", {})[" ".join(a.phases)] = provenance([sys.executable, *sys.argv])
    res["settings"] = {k: v for k, v in vars(a).items() if k not in ("phases", "out")}
    for ph in a.phases:
        PHASES[ph](a, a.work, res)
        save(a, res)
        print(f"phase {ph} done", flush=True)


if __name__ == "__main__":
    main()
