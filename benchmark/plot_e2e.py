"""Plot benchmark/results/e2e_eagle3_h200.json: both drafters' training loss, their offline
step-0 accuracy on the serving runtime's held-out states, and served acceptance length and
output tokens/s next to the target alone.

    pip install --target /tmp/mpl matplotlib && PYTHONPATH=/tmp/mpl python3 benchmark/plot_e2e.py
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "benchmark/results/e2e_eagle3_h200.json"
dst = sys.argv[2] if len(sys.argv) > 2 else src.replace(".json", ".png")
d = json.load(open(src))
SOURCES = {"runtime": "runtime states (SGLang, fp8)", "hf": "HF transformers states (bf16)"}
COLORS = {"runtime": "#1565c0", "hf": "#ef6c00", "target-only": "#9e9e9e"}
fig, ax = plt.subplots(1, 4, figsize=(21, 4.8))
for src_name, label in SOURCES.items():
    t = d["train"][src_name]
    ax[0].plot([10 * (i + 1) for i in range(len(t["loss"]))], t["loss"], color=COLORS[src_name], label=label, lw=0.8)
ax[0].set_title(f"SpecForge 0.2.0 train loss ({d['settings']['steps']} steps, batch 1, seed {d['settings']['seed']})")
ax[0].set_xlabel("optimizer step")
ax[0].legend(fontsize=8, title="(the two curves lie on top of each other)", title_fontsize=7)

acc = [d["train"][s]["eval_step0_accuracy"] for s in SOURCES]
ax[1].bar(list(SOURCES), acc, color=[COLORS[s] for s in SOURCES])
for i, x in enumerate(acc):
    ax[1].text(i, x, f"{x:.4f}", ha="center", va="bottom")
ax[1].set_title("step-0 accuracy, runtime's held-out states")
ax[1].set_xlabel("drafter trained on")

runs = d["serve"]["runs"]
# Acceptance at 16 clients: every held-out prompt, every round (bars: min and max over rounds).
spec = [k for k in runs if k != "target-only" and "c16" in runs[k]]
acc = [runs[k]["c16"]["accept_length_mean"] for k in spec]
ax[2].bar(range(len(spec)), [a["median"] for a in acc], color=[COLORS[k.split("/")[0]] for k in spec],
          yerr=[[a["median"] - a["min"] for a in acc], [a["max"] - a["median"] for a in acc]], capsize=4)
for i, a in enumerate(acc):
    ax[2].text(i, a["max"], f"{a['median']:.3f}", ha="center", va="bottom", fontsize=8)
ax[2].set_xticks(range(len(spec)), spec, fontsize=7, rotation=15)
ax[2].set_title(f"served acceptance length, 16 clients ({d['serve']['prompts']} prompts)")

labels = [k for k in runs if "c16" in runs[k]]
for j, c in enumerate(("c16", "c1")):
    tps = [runs[k][c]["output_tokens_per_s"] for k in labels]
    ax[3].bar([i + 0.4 * j for i in range(len(labels))], [t["median"] for t in tps], width=0.4,
              yerr=[[t["median"] - t["min"] for t in tps], [t["max"] - t["median"] for t in tps]], capsize=3,
              color=[COLORS[k.split("/")[0]] for k in labels], alpha=1.0 if c == "c16" else 0.55,
              label=f"{c[1:]} client(s)")
ax[3].set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7, rotation=15)
ax[3].set_yscale("log")
ax[3].set_title(f"output tokens/s, median of {d['serve']['rounds']} rounds (bars: min, max)")
ax[3].legend(fontsize=8)
fig.suptitle("SmolLM2-135M-Instruct served with --quantization fp8 on one H200: EAGLE-3 drafters trained on "
             "the serving runtime's states vs Hugging Face's", fontsize=10)
fig.tight_layout()
fig.savefig(dst, dpi=110)
print(dst)
