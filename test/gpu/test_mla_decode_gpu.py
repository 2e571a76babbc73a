"""The MLA decode-row question, on a CUDA GPU: are a DeepSeek V3's decode rows farther from HF
fp32 than its prompt rows because of the runtime's own decode numerics, or because of a defect
of ours? Per decode row and plane, four differences:

- decode row vs HF fp32 (what `verify` judges),
- the same server's prefill export of the same final sequence vs HF fp32,
- decode row vs that prefill row (the runtime's own decode-vs-prefill difference),
- HF's own bf16 forward vs fp32,

for an MLA + MoE model (the flagship's layout) and the same MLA with dense MLPs only (no
routing to flip), with the real MLA head geometry, triton attention, decode CUDA graphs,
--num-continuous-decode-steps 4, chunked prefill 256 and the prefix cache on. A defect (a row
given to the wrong position, a stale graph buffer) shows as decode rows far from the prefill
rows of the same positions; the runtime's numerics as decode rows close to them and both
within the runtime's error. The export's hooks run under the sync check (SGLANG_HS_SYNC_CHECK).
Needs SGLANG_HS_TOKENIZER (SmolLM2's tokenizer files)."""

import json
import os
import random

import pytest
import torch

from harness import models
from harness.fixtures import prompts, record_gpu_result as record
from sglang_hs.format import decode_sample, load_sample, read_manifest
from sglang_hs.tools.serve import LocalServer
from sglang_hs.tools.verify import hf_planes, load_hf, verify_export

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, hidden_size=1024,
           intermediate_size=512, moe_intermediate_size=256, n_routed_experts=8)
LAYERS = 8
VARIANTS = {"moe": dict(MLA), "dense": dict(MLA, first_k_dense_replace=LAYERS)}
AUX = [1, 4, 7]
FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--skip-tokenizer-init",
         "--skip-server-warmup", "--mem-fraction-static", "0.3", "--chunked-prefill-size", "256",
         "--num-continuous-decode-steps", "4", "--cuda-graph-max-bs", "32"]


def rows_of(out, rid):
    e = {x["id"]: x for x in read_manifest(out)}[rid]
    t = decode_sample(load_sample(os.path.join(out, e["path"])), torch.float32)
    return t, torch.cat([t["aux_hidden_states"], t["final_hidden_states"][:, None]], 1)


def pooled(acc, name, x, ref):
    """Norm-pooled relative difference over rows (verify's measure), accumulated."""
    a = acc.setdefault(name, [0.0, 0.0])
    a[0] += float((x - ref).pow(2).sum())
    a[1] += float(ref.pow(2).sum())


def quantiles(xs):
    xs = torch.tensor(xs)
    return {q: round(float(torch.quantile(xs, v)), 3) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))} | \
        {"max": round(float(xs.max()), 3)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_decode_rows_differ_from_hf_as_the_runtime_decode_does(variant, tmp_path):
    tok = os.environ["SGLANG_HS_TOKENIZER"]
    work = os.environ.get("SGLANG_HS_LOGS", str(tmp_path))
    path = models.tiny("deepseek_v3", os.path.join(work, f"tiny-deepseek-v3-mla-{variant}"), tok, num_layers=LAYERS,
                       **VARIANTS[variant])
    out = str(tmp_path / "export")
    args = ["--model-path", path, "--export-hidden-states-dir", out, "--export-aux-layer-ids", *map(str, AUX), *FLAGS]
    lengths = [random.Random(70 + i).randrange(20, 700) for i in range(12)]
    ps = prompts(f"mla-{variant}", lengths)
    shared = ps[0][:200]  # two prompts share a cached prefix (the prefix cache is on)
    ps += [shared + p[:50] for p in prompts(f"mla-{variant}-shared", [60, 80])]
    srv = LocalServer(args, os.path.join(work, f"mla-decode-{variant}.log"), cpu=False)
    srv.env["SGLANG_HS_SYNC_CHECK"] = "1"
    news = [32 + (37 * i) % 97 for i in range(len(ps))]
    finals = {}
    with srv:
        for i, p in enumerate(ps):
            r = srv.generate({"rid": f"dec-{i}", "input_ids": p, "sampling_params": {
                "max_new_tokens": news[i], "temperature": 0, "ignore_eos": True,
                "custom_params": {"sglang_hs": {"decode_rows": True}}}})
            assert r.status_code == 200, r.text
            finals[i] = p + r.json()["output_ids"]
        for i, seq in finals.items():  # the same sequences, prefilled: prompt-only export
            r = srv.generate({"rid": f"pre-{i}", "input_ids": seq, "sampling_params": {"max_new_tokens": 1}})
            assert r.status_code == 200, r.text
    fp32, bf16 = load_hf(path, torch.float32, "cuda"), load_hf(path, torch.bfloat16, "cuda")
    names = [f"aux[{k}]" for k in AUX] + ["final"]
    acc = {}
    per_row = {n: {k: [] for k in ("decode_vs_fp32_over_hf_bf16", "decode_vs_prefill_rel", "prompt_vs_fp32_over_hf_bf16",
                                   "decode_err", "decode_hf_bf16_err", "prompt_err", "prompt_hf_bf16_err")}
               for n in names}
    decode_rows = 0
    for i, p in enumerate(ps):
        t, d = rows_of(out, f"dec-{i}")
        _, pre = rows_of(out, f"pre-{i}")
        assert t["token_ids"].tolist() == finals[i] and d.shape[0] == len(finals[i]) - 1
        ref = hf_planes(fp32, t["token_ids"], AUX)[: d.shape[0]]
        h16 = hf_planes(bf16, t["token_ids"], AUX)[: d.shape[0]]
        gen, prompt = slice(len(p), d.shape[0]), slice(0, len(p))
        decode_rows += d.shape[0] - len(p)
        for j, n in enumerate(names):
            pooled(acc, f"{n} decode vs fp32", d[gen, j], ref[gen, j])
            pooled(acc, f"{n} prefill vs fp32", pre[gen, j], ref[gen, j])
            pooled(acc, f"{n} decode vs prefill", d[gen, j], pre[gen, j])
            pooled(acc, f"{n} hf bf16 vs fp32", h16[gen, j], ref[gen, j])
            pooled(acc, f"{n} prompt rows vs fp32", d[prompt, j], ref[prompt, j])
            pooled(acc, f"{n} prompt rows hf bf16 vs fp32", h16[prompt, j], ref[prompt, j])
            for part, at in (("decode", gen), ("prompt", prompt)):
                rn = ref[at, j].norm(dim=-1)
                e = (d[at, j] - ref[at, j]).norm(dim=-1) / rn
                e_bf = ((h16[at, j] - ref[at, j]).norm(dim=-1) / rn).clamp_min(1e-6)
                per_row[n][f"{part}_vs_fp32_over_hf_bf16"] += (e / e_bf).tolist()
                per_row[n][f"{part}_err"] += e.tolist()
                per_row[n][f"{part}_hf_bf16_err"] += e_bf.tolist()
            per_row[n]["decode_vs_prefill_rel"] += ((d[gen, j] - pre[gen, j]).norm(dim=-1)
                                                     / pre[gen, j].norm(dim=-1)).tolist()
    rel = {k: (a[0] / a[1]) ** 0.5 for k, a in acc.items()}
    table = {n: {"decode_vs_fp32": rel[f"{n} decode vs fp32"], "prefill_vs_fp32": rel[f"{n} prefill vs fp32"],
                 "decode_vs_prefill": rel[f"{n} decode vs prefill"], "hf_bf16_vs_fp32": rel[f"{n} hf bf16 vs fp32"],
                 "decode_ratio": rel[f"{n} decode vs fp32"] / rel[f"{n} hf bf16 vs fp32"],
                 "prefill_ratio": rel[f"{n} prefill vs fp32"] / rel[f"{n} hf bf16 vs fp32"],
                 "prompt_rows_ratio": rel[f"{n} prompt rows vs fp32"] / rel[f"{n} prompt rows hf bf16 vs fp32"],
                 "per_row_decode_ratio": quantiles(per_row[n]["decode_vs_fp32_over_hf_bf16"]),
                 "per_row_prompt_ratio": quantiles(per_row[n]["prompt_vs_fp32_over_hf_bf16"]),
                 # worst row's error over HF bf16's worst row error, decode rows and prompt rows
                 "worst_row_decode_ratio": max(per_row[n]["decode_err"]) / max(per_row[n]["decode_hf_bf16_err"]),
                 "worst_row_prompt_ratio": max(per_row[n]["prompt_err"]) / max(per_row[n]["prompt_hf_bf16_err"]),
                 "per_row_decode_vs_prefill": quantiles(per_row[n]["decode_vs_prefill_rel"])} for n in names}
    rep = verify_export(out, samples=None, device="cuda")
    print(variant, json.dumps(table, indent=1), "\n" + rep.table())
    graphs = sum("graph: True" in ln for ln in open(srv.log_path, errors="replace") if "Decode batch" in ln)
    record(f"mla_decode_{variant}", {"decode_rows": decode_rows, "planes": table, "verify": rep.to_dict(),
                                     "decode_batches_with_cuda_graph": graphs, "geometry": VARIANTS[variant],
                                     "server_flags": FLAGS})
    assert graphs > 0, "no decode batch ran as a CUDA graph"
    for n, row in table.items():
        # Rows at the right positions: each decode row is close to the same server's prefill
        # row of that position (a row given to another position differs by O(1)).
        assert row["per_row_decode_vs_prefill"]["max"] < 0.25, (n, row)
        # The same sequences prefilled are as exact as the runtime's prompt rows are.
        assert row["prefill_ratio"] <= 2.0, (n, row)
    assert rep.ok, rep.table()
