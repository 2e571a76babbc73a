"""The main job on the embedded default: SmolLM2-135M-Instruct on CPU, end to end."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from importlib import resources
from typing import List

from sglang_hs.tools import models
from sglang_hs.format import human_bytes, load_sample, read_manifest, validate_export
from sglang_hs.tools.masks import prompt_ids
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import verify_export


def demo_conversations() -> List[dict]:
    text = resources.files("sglang_hs").joinpath("data/demo_prompts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_demo(work_dir: str = ".cache", concurrency: int = 8) -> bool:
    from transformers import AutoTokenizer

    model = models.smollm2(os.path.join(work_dir, "models", "smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(model)
    convs = demo_conversations()
    ids = [prompt_ids(tok, c["messages"]) for c in convs]
    out = os.path.join(work_dir, "demo-export", time.strftime("%Y%m%d-%H%M%S"))
    log = os.path.join(work_dir, "demo-server.log")
    print(f"[demo] model {model}\n[demo] exporting {len(ids)} conversations to {out} (server log: {log})")
    args = ["--model-path", model, "--export-hidden-states-dir", out, "--skip-server-warmup"]
    with LocalServer(args, log) as srv:
        print(f"[demo] server up in {srv.startup_s:.0f} s")

        def send(i):
            r = srv.generate({"rid": f"demo-{i:04d}", "input_ids": ids[i], "sampling_params": {"max_new_tokens": 1}})
            r.raise_for_status()
            return r.json()["meta_info"]["hidden_states_export"]

        # The first forward of a fresh CPU server pays one-time setup; keep it out of the timing.
        srv.generate({"input_ids": ids[0], "sampling_params": {
            "max_new_tokens": 1, "custom_params": {"sglang_hs": {"export": False}}}}).raise_for_status()
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as ex:
            metas = list(ex.map(send, range(len(ids))))
        wall = time.perf_counter() - t0
    tokens = sum(m["num_tokens"] for m in metas)
    rep = validate_export(out, expected_tokens={f"demo-{i:04d}": x for i, x in enumerate(ids)})
    ver = verify_export(out, samples=None)
    first = read_manifest(out)[0]
    t = load_sample(os.path.join(out, first["path"]))
    print(f"[demo] sample {first['id']}: " + ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                                                         for k, v in t.items()))
    print("[demo] verify against Hugging Face transformers (fp32 reference):")
    print(ver.table())
    print(f"[demo] samples {rep.samples}  tokens {tokens}  bytes {human_bytes(rep.bytes)}  "
          f"prefill+export {tokens / wall:.0f} tokens/s  worst error ratio vs HF bf16 {ver.worst_ratio:.2f}  "
          f"min cosine {min(p.min_cos for p in ver.planes):.5f}")
    ok = rep.ok and ver.ok
    print("[demo] OK" if ok else "[demo] FAILED: " + "; ".join(rep.errors + ver.format_errors))
    return ok
