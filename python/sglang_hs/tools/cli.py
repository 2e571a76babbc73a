"""`sglang-hs`: a thin command line over the library."""

from __future__ import annotations

import argparse
import os
import sys


CAPTURE_EPILOG = """\
servers that do not answer:
  at start       a server that cannot be reached fails the run at once, naming the URL (a wrong
                 port or host); give --server-wait to wait that long for one still starting
  mid-run        a server that stops answering (killed, restarting) is waited for, polling
                 /health, --server-wait seconds (default 600), then the run stops; the progress
                 line says which server, why and until when
  Ctrl-C/SIGTERM answered requests are journaled, waits end at once (those samples stay unsent;
                 a rerun sends them); a second signal exits at once

exit status: 0 all done; 1 some samples failed (OUT/capture_failed.jsonl) or the run could not
start; 75 a server stayed away; 130 Ctrl-C; 143 SIGTERM. Rerun the same command to resume.
"""


DIRS_HELP = "an export directory; several (or a file listing them, one per line) are read as one dataset"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-cpu"]:  # every other argument belongs to the SGLang launcher
        from sglang_hs.tools.serve import serve_cpu

        return serve_cpu(argv[1:])
    p = argparse.ArgumentParser(prog="sglang-hs", description="Hidden-state export for EAGLE-3 training on SGLang.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve-cpu", help="run `python -m sglang.launch_server ARGS...` on a machine without a GPU")
    v = sub.add_parser("verify", help="recompute samples with HF transformers and compare")
    v.add_argument("dir", nargs="+", metavar="DIR", help=DIRS_HELP)
    v.add_argument("--model", help="HF checkpoint (default: the model_path in export.json)")
    v.add_argument("--samples", type=int, default=8, help="how many samples (0 = all)")
    v.add_argument("--device", default="cpu")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    d = sub.add_parser("demo", help="SmolLM2-135M on CPU: serve, export, verify, report")
    d.add_argument("--work-dir", default=".cache")
    c = sub.add_parser("capture", help="send a chat dataset through exporting servers (resumable)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CAPTURE_EPILOG)
    c.add_argument("--server", action="append", required=True, help="server URL (repeat for several)")
    c.add_argument("--data", required=True, help="JSONL file or a datasets.save_to_disk folder")
    c.add_argument("--out", required=True, help="where the capture journal lives (use the export dir)")
    c.add_argument("--tokenizer", help="default: the server's model path")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="load a tokenizer that the checkpoint ships as code (Kimi-K2.5)")
    c.add_argument("--concurrency", type=int, default=32)
    c.add_argument("--max-length", type=int, help="keep the first N tokens of longer samples")
    c.add_argument("--last-turn-only", action="store_true", help="loss mask on the last assistant turn only")
    c.add_argument("--mask-reasoning", action="store_true", help="loss mask 0 on <think>...</think> spans")
    c.add_argument("--regenerate", action="store_true", help="let the target model write the assistant turns first")
    c.add_argument("--regenerate-passes", type=int, choices=[1, 2], default=1,
                   help="for --regenerate: 1 (default) exports the last answer's rows as it is decoded; 2 "
                        "generates it, then exports the whole conversation in a second request")
    c.add_argument("--max-new-tokens", type=int, default=1024, help="for --regenerate")
    c.add_argument("--temperature", type=float, default=0.0, help="for --regenerate")
    c.add_argument("--retries", type=int, default=5)
    c.add_argument("--id-prefix", default="")
    c.add_argument("--limit", type=int, help="only the first N records")
    c.add_argument("--server-wait", type=float, metavar="SECONDS",
                   help="how long a server that does not answer is waited for (default 600 for one that stopped "
                        "answering mid-run; one that does not answer at start fails the run at once unless this "
                        "is given)")
    c.add_argument("--allow-new-servers", action="store_true",
                   help="resume with a --server list other than the first run's (samples in flight when the "
                        "last run stopped may be exported twice)")
    c.add_argument("--via-router", action="store_true",
                   help="--server is an sglang-router started with --policy manual --disable-retries "
                        "--disable-circuit-breaker --disable-health-check: each sample's id is its routing key, and "
                        "after a failure every worker the router lists is waited for until it answers /health "
                        "(docs/scale-out.md)")
    c.add_argument("--no-progress", action="store_true")
    i = sub.add_parser("inspect", help="summary of an export directory")
    i.add_argument("dir", nargs="+", metavar="DIR", help=DIRS_HELP)
    i.add_argument("--json", action="store_true")
    i.add_argument("--against", metavar="URL", help="a serving SGLang server: warn where it computes with other "
                                                    "numerics than the export was captured with")
    r = sub.add_parser("repair", help="reconcile an export directory after a crash (dry run unless --apply)")
    r.add_argument("dir", nargs="+", metavar="DIR", help="export directories (or files listing them), each "
                                                       "repaired on its own")
    r.add_argument("--apply", action="store_true", help="change the directory (no server may be writing to it)")
    from sglang_hs.tools.masks import MASK_RULES

    k = sub.add_parser("convert", help="write a trainer's layout")
    k.add_argument("dir", nargs="+", metavar="DIR", help=DIRS_HELP)
    k.add_argument("--to", choices=["specforge", "speculators"], required=True)
    k.add_argument("dest")
    k.add_argument("--model", help="the target checkpoint: its tokenizer (loss-mask rules), final norm weight "
                                   "(speculators), lm_head (SpecForge); default: model_path in export.json")
    k.add_argument("--loss-mask", choices=list(MASK_RULES),
                   help="loss-mask convention (default: the trainer's own: specforge turns+separator, "
                        "speculators last-turn+separator); captured keeps the masks as exported")
    k.add_argument("--trust-remote-code", action="store_true", help="the tokenizer is remote code (Kimi-K2.5)")
    k.add_argument("--follow", action="store_true",
                   help="train while capturing (speculators): DEST is an index from `sglang-hs index`; write each "
                        "sample into it as the capture makes it durable, until every row has its states")
    k.add_argument("--idle-exit", type=float, metavar="SECONDS", help="with --follow: stop after SECONDS without "
                   "a new sample (default: wait for every row, or Ctrl-C)")
    x = sub.add_parser("index", help="what a trainer's online mode reads besides the states (rows only; the server "
                                     "streams each row's states)")
    x.add_argument("--to", choices=["speculators", "specforge"], required=True)
    x.add_argument("--data", required=True, help="records (JSONL), as for capture")
    x.add_argument("--model", required=True, help="the target checkpoint (its tokenizer and chat template)")
    x.add_argument("dest")
    x.add_argument("--loss-mask", choices=list(MASK_RULES), help="default: the trainer's own rule")
    x.add_argument("--max-length", type=int, help="keep the first N tokens of each sample (as capture --max-length)")
    x.add_argument("--aux-layer-ids", type=int, nargs="+", metavar="K",
                   help="the server's --export-aux-layer-ids when given (HF numbering): speculators' "
                        "--target-layer-ids, SpecForge's draft config")
    x.add_argument("--server", action="append", help="specforge: the capture server URL (repeat for several)")
    x.add_argument("--mooncake-master", help="specforge: the mooncake_master HOST:PORT the servers use")
    x.add_argument("--draft-vocab-size", type=int, default=32000, help="specforge: the draft's vocabulary")
    x.add_argument("--trust-remote-code", action="store_true")
    # Options may come anywhere, also between several DIRs and DEST (`convert D1 D2 --to X DEST`),
    # which plain parse_args splits wrongly; intermixed parsing is refused on subparsers, so the
    # command's own parser reads its arguments.
    cmd = sub.choices.get(argv[0]) if argv else None
    a = cmd.parse_intermixed_args(argv[1:], argparse.Namespace(cmd=argv[0])) if cmd else p.parse_args(argv)
    if a.cmd == "verify":
        from sglang_hs.tools.verify import verify_export

        rep = verify_export(a.dir, a.model, a.samples or None, a.device)
        if a.json:
            import json

            print(json.dumps(rep.to_dict(), indent=2))
        else:
            print("\n".join([*rep.notes, f"{rep.samples} samples, {rep.tokens} tokens"]))
            print(rep.table())
            for e in rep.format_errors:
                print("format error:", e)
            print("OK" if rep.ok else "FAILED")
        sys.exit(0 if rep.ok else 1)
    if a.cmd == "capture":
        from sglang_hs.tools.capture import CaptureConfig, ServerUnreachable, capture

        cfg = CaptureConfig(servers=a.server, data=a.data, out=a.out, tokenizer=a.tokenizer,
                            trust_remote_code=a.trust_remote_code,
                            concurrency=a.concurrency, max_length=a.max_length, last_turn_only=a.last_turn_only,
                            mask_reasoning=a.mask_reasoning, regenerate=a.regenerate,
                            regenerate_passes=a.regenerate_passes,
                            max_new_tokens=a.max_new_tokens, temperature=a.temperature, retries=a.retries,
                            id_prefix=a.id_prefix, limit=a.limit, progress=not a.no_progress,
                            server_wait_s=600.0 if a.server_wait is None else a.server_wait,
                            wait_at_start=a.server_wait is not None, allow_new_servers=a.allow_new_servers,
                            via_router=a.via_router)
        try:
            summ = capture(cfg)
        except (ValueError, ServerUnreachable) as e:  # SampleIdError, ServersChangedError, a bad --via-router
            sys.exit(f"sglang-hs capture: {e}")
        print(f"[capture] {summ.line()}")
        sys.exit(summ.exit_code())
    if a.cmd == "inspect":
        import json

        from sglang_hs.tools.convert import inspect_export
        from sglang_hs.format import human_bytes

        try:
            r = inspect_export(a.dir)
        except ValueError as e:
            sys.exit(f"sglang-hs inspect: {e}")
        if a.against:
            import requests

            from sglang_hs.format import read_export_json
            from sglang_hs.tools.convert import compare_with_server

            served = requests.get(a.against.rstrip("/") + "/get_server_info", timeout=30).json()
            r["against"] = {"url": a.against, "differences": compare_with_server(read_export_json(r["dirs"][0]) or {}, served)}
        if a.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"{r['dir']}: {r['samples']} samples, {r['tokens']} tokens, {human_bytes(r['bytes'])} "
                  f"({r['bytes_per_token']:.0f} B/token), aux layers {r['aux_layer_ids']} + final, "
                  f"computed in {r['dtype']}, stored as {r['export_dtype']}, final rows: {r['final_rows']}, "
                  f"hidden {r['hidden_size']}")
            for sid, ds in list(r["in_several_dirs"].items())[:20]:
                print(f"  sample {sid!r} is listed in {len(ds)} directories ({', '.join(ds)}); read from {ds[0]}")
            for k_, v in r["length_histogram"].items():
                print(f"  {k_:>12} tokens: {v}")
            if r["failed_ids"]:
                print(f"  failed in capture: {len(r['failed_ids'])}: {', '.join(r['failed_ids'][:20])}")
            print("  server: " + ", ".join(f"{k_} {v}" for k_, v in r["server"].items() if v is not None))
            c = r["capture"]
            for way in c["ways"]:
                print("  captured: " + ", ".join(f"{k_} {v}" for k_, v in way.items()))
            print(f"  truncated {c['truncated']}, regenerated {c['regenerated']}, "
                  f"without capture provenance {c['without_provenance']}")
            if a.against:
                for d in r["against"]["differences"] or ["none"]:
                    print(f"  against {a.against}: {d}" if d != "none" else f"  against {a.against}: same numerics")
                print("  (NCCL variables of the serving processes are not visible through /get_server_info: "
                      "compare them with export.json's numerics.env yourself)")
            if c["other_chat_template_than_server"]:
                print(f"  WARNING: {c['other_chat_template_than_server']} samples were tokenised with another chat "
                      "template than the server's tokenizer has")
        return
    if a.cmd == "repair":
        from sglang_hs.format import repair_export
        from sglang_hs.tools.dirs import expand

        try:
            dirs = expand(a.dir)
        except ValueError as e:
            sys.exit(f"sglang-hs repair: {e}")
        for d in dirs:
            print("\n".join([f"{d}:"] * (len(dirs) > 1) + repair_export(d, apply=a.apply).lines()))
        return
    if a.cmd == "convert":
        from sglang_hs.tools import convert

        if a.follow:
            _follow(a)
            return
        fn = convert.to_specforge if a.to == "specforge" else convert.to_speculators
        try:
            rep = fn(a.dir, a.dest, convert.ConvertOptions(a.model, a.loss_mask, a.trust_remote_code))
        except ValueError as e:
            sys.exit(f"sglang-hs convert: {e}")
        print(rep.line())
        return
    if a.cmd == "index":
        from sglang_hs.tools import online

        try:
            if a.to == "speculators":
                rep = online.speculators_index(a.data, a.model, a.dest, a.loss_mask, a.max_length,
                                               a.trust_remote_code, a.aux_layer_ids)
            else:
                if not a.server or not a.mooncake_master:
                    sys.exit("sglang-hs index --to specforge: give --server URL and --mooncake-master HOST:PORT "
                             "(SpecForge's roles reach the servers and the store through them)")
                rep = online.specforge_index(a.data, a.model, a.dest, online.SpecForgeOnline(
                    a.server, a.mooncake_master, os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")),
                    a.loss_mask, a.max_length, a.trust_remote_code, a.aux_layer_ids, a.draft_vocab_size)
        except ValueError as e:
            sys.exit(f"sglang-hs index: {e}")
        print("\n".join(rep.lines()))
        return
    if a.cmd == "demo":
        from sglang_hs.tools.demo import run_demo

        sys.exit(0 if run_demo(a.work_dir) else 1)


def _follow(a) -> None:
    import signal
    import threading

    from sglang_hs.tools.online import follow_speculators

    if a.to != "speculators":
        sys.exit("sglang-hs convert --follow: only --to speculators (SpecForge's offline reader lists its files once "
                 "at start; stream to it with --export-sink specforge instead)")
    if len(a.dir) != 1:
        sys.exit("sglang-hs convert --follow: give one export directory; for several, run one --follow per directory "
                 "into the same DEST (each writes the rows of its own samples)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        rep = follow_speculators(a.dir[0], a.dest, a.model, idle_exit_s=a.idle_exit, stop=stop,
                                 progress=lambda r: print(r.line(), flush=True))
    except ValueError as e:
        sys.exit(f"sglang-hs convert --follow: {e}")
    print(rep.line())
    sys.exit(0 if rep.complete and not rep.mismatched else 1)


if __name__ == "__main__":
    main()
