"""Plot benchmark/results/storage_cpu.json: bytes per token per storage, and the speculators
training curves (loss, step-0 accuracy) on bf16 vs fp8 data, with the bf16 seed-to-seed spread.

    pip install --target /tmp/mpl matplotlib && PYTHONPATH=/tmp/mpl .venv/bin/python benchmark/plot_storage.py
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "benchmark/results/storage_cpu.json"
dst = sys.argv[2] if len(sys.argv) > 2 else src.replace(".json", ".png")
d = json.load(open(src))
fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
names = list(d["bytes"])
ax[0].bar(names, [d["bytes"][n]["bytes_per_token"] for n in names], color=["#9e9e9e", "#1565c0", "#2e7d32"])
for i, n in enumerate(names):
    ax[0].text(i, d["bytes"][n]["bytes_per_token"], f"{d['bytes'][n]['vs_bf16']:.2f}x", ha="center", va="bottom")
ax[0].set_ylabel("bytes per token (SmolLM2-135M, 3 aux + final)")
ax[0].set_title("Storage per token")
for name, run in d["training"]["runs"].items():
    style = "--" if "seed 43" in name else "-"
    ax[1].plot(run["loss"], style, label=name)
    ax[2].plot(run["step0_accuracy"], style, label=name)
ax[1].set_title("speculators 0.9.0 train loss")
ax[2].set_title("step-0 accuracy")
for a in ax[1:]:
    a.set_xlabel("optimizer step")
    a.legend(fontsize=8)
fig.tight_layout()
fig.savefig(dst, dpi=110)
print(dst)
