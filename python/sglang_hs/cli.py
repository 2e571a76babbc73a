"""`sglang-hs`: a thin command line over the library."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-cpu"]:  # every other argument belongs to the SGLang launcher
        from sglang_hs.cpu import serve_cpu

        return serve_cpu(argv[1:])
    p = argparse.ArgumentParser(prog="sglang-hs", description="Hidden-state export for EAGLE-3 training on SGLang.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve-cpu", help="run `python -m sglang.launch_server ARGS...` on a machine without a GPU")
    v = sub.add_parser("verify", help="recompute samples with HF transformers and compare")
    v.add_argument("dir")
    v.add_argument("--model", help="HF checkpoint (default: the model_path in export.json)")
    v.add_argument("--samples", type=int, default=8, help="how many samples (0 = all)")
    v.add_argument("--device", default="cpu")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    d = sub.add_parser("demo", help="SmolLM2-135M on CPU: serve, export, verify, report")
    d.add_argument("--work-dir", default=".cache")
    a = p.parse_args(argv)
    if a.cmd == "verify":
        from sglang_hs.verify import verify_export

        rep = verify_export(a.dir, a.model, a.samples or None, a.device)
        if a.json:
            import json

            print(json.dumps(rep.to_dict(), indent=2))
        else:
            print(f"{rep.samples} samples, {rep.tokens} tokens")
            print(rep.table())
            for e in rep.format_errors:
                print("format error:", e)
            print("OK" if rep.ok else "FAILED")
        sys.exit(0 if rep.ok else 1)
    if a.cmd == "demo":
        from sglang_hs.demo import run_demo

        sys.exit(0 if run_demo(a.work_dir) else 1)


if __name__ == "__main__":
    main()
