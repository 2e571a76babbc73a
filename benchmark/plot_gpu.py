"""Plot benchmark/results/gpu_export_h200.json as a PNG a person can read at a glance.

    .venv/bin/pip install matplotlib && .venv/bin/python benchmark/plot_gpu.py
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "benchmark/results/gpu_export_h200.json"
dst = sys.argv[2] if len(sys.argv) > 2 else src.replace(".json", ".png")
d = json.load(open(src))
labels, values, colors, spans = [], [], [], []
ARM = {"off": ("export off", "#9e9e9e"), "on": ("export ON", "#1565c0"),
       "on_opt_out": ("export server,\nrequests opt out", "#64b5f6")}
for phase, name in (("radix-on", "prefix cache on"), ("radix-off", "prefix cache off")):
    for shape, s in d.get(phase, {}).get("shapes", {}).items():
        if "tokens_per_s_median" not in s:  # a shape cut short by the run's time limit
            continue
        for arm, tps in s["tokens_per_s_median"].items():
            ratio = s.get("ratio_vs_off", {}).get(arm, {}).get("median", s["ratio_median"] if arm == "on" else None)
            steady = s.get(f"steady_ratio_{arm}", {}).get("median")
            text, color = ARM[arm]
            labels.append(f"{shape}\n{name}\n{text}" + (f"\n({ratio:.3f}x)" if ratio else "")
                          + (f"\nsteady {steady:.3f}x" if steady else ""))
            values.append(tps)
            colors.append(color)
            # the spread of the rounds (an opt-out round served from the prefix cache is left out)
            runs = [m["tokens_per_s"] for m in s["rounds"][arm] if m["tokens_per_s"] < 1.5 * s["tokens_per_s_median"]["off"]]
            spans.append((tps - min(runs), max(runs) - tps))
b = d.get("baselines", {})
if "return_hidden_states" in b:
    labels.append("1024 tok\nupstream\nreturn_hidden_states")
    values.append(b["return_hidden_states"]["tokens_per_s"])
    colors.append("#c62828")
    spans.append((0, 0))
if "hf_transformers" in b:
    labels.append("1024 tok\nHF transformers\nforward + write")
    values.append(b["hf_transformers"]["tokens_per_s"])
    colors.append("#ef6c00")
    spans.append((0, 0))
fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(values)), 5))
bars = ax.bar(range(len(values)), values, color=colors, yerr=list(zip(*spans)), capsize=3)
for bar, v in zip(bars, values):
    ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(values)), labels, fontsize=7)
ax.set_ylabel("prompt tokens / s")
gpu = d.get("provenance", {}).get("radix-on", {}).get("hardware", {}).get("gpu", "GPU")
ax.set_title(f"sglang-hs hidden-state export, SGLang 0.5.17, Llama-3-8B geometry\n"
             f"{gpu}, shape = prompt tokens x clients, medians of alternating rounds (bars: min-max of the rounds)\n"
             f"CUDA graphs on, export to /dev/shm; (x): a round's tokens/s vs export off"
             + ("; steady: the same between 10% and 90% of answers" if "steady" in "".join(labels) else "")
             + (f"\nGPU memory, each server alone: export on adds {mem['delta_mib']['gpu_mem_mib_after_load']} MiB"
                if (mem := d.get("memory")) else ""), fontsize=9)
fig.tight_layout()
fig.savefig(dst, dpi=120)
print(dst)
