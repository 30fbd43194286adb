"""The `lingc` command line: thin typer commands over the library (init, compile, draft-vocab, passes, diff, report,
generate, demo, serve, bench)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="lingc compiles Ling-3.0 (BailingMoeV3) checkpoints into inspectable step programs "
                       "for batch-1 decoding.\n\nStart with [bold]lingc demo[/bold], or: lingc init -> "
                       "lingc compile -> lingc diff / lingc report.")
console = Console()
err = Console(stderr=True)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}")   # paths and names are not markup
    raise typer.Exit(2)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


@app.command()
def init(preset: str = typer.Option(..., help="ling-3.0-flash, ling-3.0-tiny, test-tiny or test-tiny-qproj"),
         out: Path = typer.Option(..., "--out", "-o", help="directory to write config.json + safetensors into"),
         layers: Optional[int] = typer.Option(None, help="override num_hidden_layers"),
         mtp_layers: Optional[int] = typer.Option(None, help="override num_nextn_predict_layers (MTP)"),
         seed: int = typer.Option(0, help="same seed, same bytes"),
         device: str = typer.Option("cpu", help="where to draw the random numbers (cuda is much faster at real size)"),
         shard_mb: Optional[int] = typer.Option(None, help="shard size in MiB (default: 512, or 4 shards for small "
                                                "models; 0 = one file)")) -> None:
    """Write a deterministic random checkpoint in the published Ling-3.0 format (HF key names, sharded)."""
    from lingc.config import ConfigError
    from lingc.init import write_random_checkpoint
    from lingc.presets import preset as get_preset
    overrides = {}
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    if mtp_layers is not None:
        overrides["num_nextn_predict_layers"] = mtp_layers
    try:
        config = get_preset(preset, **overrides)
    except (KeyError, ConfigError, TypeError) as e:
        _fail(str(e).strip("'\""))
    shard = None if shard_mb is None else shard_mb * 2**20
    t0 = time.perf_counter()
    try:
        write_random_checkpoint(config, out, seed=seed, device=device, shard_bytes=shard, progress=True)
    except OSError as e:
        _fail(f"cannot write the checkpoint to {out}: {e}")
    console.print(f"wrote {preset} (seed {seed}) to [bold]{escape(str(out))}[/bold] in "
                  f"{time.perf_counter() - t0:.1f} s")


@app.command("compile")
def compile_cmd(checkpoint: Path = typer.Argument(..., help="checkpoint directory (config.json + *.safetensors)"),
                passes: str = typer.Option("", "--passes", "-p", help="comma-separated pass names, or 'all' "
                                           "(see `lingc passes`)"),
                out: Path = typer.Option(..., "--out", "-o", help="artifact directory to write"),
                programs: str = typer.Option("", help="programs to trace (default: prefill,decode,step + "
                                             "mtp_prefill,mtp_decode,nextn with MTP)"),
                dtype: str = typer.Option("bf16", help="activation / weight dtype: bf16 or fp32"),
                verify: bool = typer.Option(False, "--verify", help="check every stage against the previous "
                                            "one on CPU"),
                max_len: int = typer.Option(512, help="tokens per request, prompt + output (a multiple of 16)"),
                prefill_tokens: int = typer.Option(32, help="tokens per prefill chunk"),
                draft_tokens: int = typer.Option(6, help="verify width (NEXTN steps + 1)"),
                tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks: runs the tp pass last and writes one "
                                       "weight set per rank (must divide heads, experts, vocab; docs/tp.md)"),
                draft_vocab: Optional[Path] = typer.Option(
                    None, "--draft-vocab", help="token ids (a JSON list; or .npy, .safetensors, text): the MTP draft "
                    "proposes only these "
                    "(lm_head rows of the map; the draft_vocab pass, added if missing; lossless, proposals change; "
                    "SGLang's --speculative-token-map; `lingc draft-vocab` counts one from a corpus)")) -> None:
    """Trace the checkpoint's step programs, run the passes, and write an artifact (JSON IR + safetensors)."""
    from lingc.artifact import ArtifactError
    from lingc.checkpoint import CheckpointError
    from lingc.compile import compile_checkpoint
    from lingc.config import ConfigError
    from lingc.passes.manager import PassOrderError, VerifyError
    from lingc.trace import TraceOptions
    try:
        options = TraceOptions(max_len=max_len, prefill_tokens=prefill_tokens, draft_tokens=draft_tokens)
    except ValueError as e:
        _fail(str(e))
    hot = None
    if draft_vocab is not None:
        from lingc.token_map import TokenMapError, read_token_map
        try:
            hot = read_token_map(draft_vocab)
        except TokenMapError as e:
            _fail(f"--draft-vocab {e}")
    t0 = time.perf_counter()
    try:
        result = compile_checkpoint(checkpoint, out, _split(passes), _split(programs) or None, dtype, verify,
                                    options, progress=True, tp=tp, draft_vocab=hot)
    except (PassOrderError, ConfigError, CheckpointError, ArtifactError, ValueError, OSError) as e:
        _fail(str(e))
    except VerifyError as e:
        _fail(str(e))
    table = Table(title=f"lingc compile -> {escape(str(out))}")
    for col in ("#", "pass", "numerics", "matches", "nodes +/-/~", "weights", "ms", "verify"):
        table.add_column(col)
    for i, r in enumerate(result.records, start=1):
        v = "-" if r.verify is None else ("bit-exact" if r.verify["ok"] and r.verify["exact"] else
                                          "ok (tol %g)" % r.tolerance if r.verify["ok"] else "FAILED")
        table.add_row(str(i), r.name, "changed" if r.changes_numerics else "unchanged", str(r.matches),
                      f"+{len(r.nodes_added)}/-{len(r.nodes_removed)}/~{len(r.nodes_rewritten)}",
                      str(len(r.weights_added) + len(r.weights_changed)), f"{r.ms:.1f}", v)
    console.print(table)
    shown = escape(str(out))
    ranks = f" ({tp} TP ranks: one weight set each)" if tp > 1 else ""
    console.print(f"programs: {', '.join(result.program.graphs)}{ranks}; wrote [bold]{shown}[/bold] "
                  f"in {time.perf_counter() - t0:.1f} s. Inspect: lingc diff {shown} --pass NAME, lingc report {shown}")


@app.command("draft-vocab")
def draft_vocab_cmd(checkpoint: Path = typer.Argument(..., help="checkpoint directory (config.json + tokenizer.json)"),
                    corpus: list[Path] = typer.Option(..., "--corpus", "-c",
                                                      help="text file; .jsonl with a \"text\" string, \"messages\" "
                                                      "or \"conversations\" a line; .json, a list of such rows "
                                                      "(ShareGPT); repeat for more files"),
                    size: int = typer.Option(32768, "--size", "-n", help="ids in the map (the draft's lm_head rows)"),
                    out: Path = typer.Option(..., "--out", "-o", help="JSON file to write (lingc compile --draft-vocab "
                                             "reads it)")) -> None:
    """Count a corpus's tokens and write the most frequent ids as a draft_vocab token map.

    The map lets the MTP draft propose from those ids only (lingc compile --draft-vocab FILE): its lm_head
    reads --size rows instead of the whole vocabulary. Count text like the traffic you serve; the printed coverage
    (the corpus tokens whose id is in the map) bounds how often the draft can propose the next token. eos and the
    tokenizer's special tokens are always kept.
    """
    from lingc.config import ConfigError
    from lingc.token_map import TokenMapError, build_token_map, write_token_map
    try:
        token_map = build_token_map(checkpoint, corpus, size, progress=True)
        write_token_map(token_map, out)
    except (TokenMapError, ConfigError) as e:
        _fail(str(e))
    shown = escape(str(out))
    console.print(f"wrote [bold]{shown}[/bold]: {len(token_map.ids)} ids covering {token_map.coverage:.1%} of "
                  f"{token_map.corpus_tokens} corpus tokens ({token_map.distinct} distinct ids seen; "
                  f"{len(token_map.kept)} kept as eos / special"
                  + (f"; {token_map.out_of_vocab} tokens had ids past vocab_size" if token_map.out_of_vocab else "")
                  + f"). Use: lingc compile {escape(str(checkpoint))} --passes all --draft-vocab {shown} -o ART")


@app.command("passes")
def passes_cmd() -> None:
    """List every pass: name, what it does, whether it changes numerics, its ordering constraints."""
    from lingc.passes import EXPLICIT_PASSES, PASSES
    table = Table(title="lingc passes (use --passes a,b,c or all)")
    for col in ("pass", "what it does", "numerics", "runs after"):
        table.add_column(col)
    for name, cls in PASSES.items():
        numerics = (f"[yellow]changed[/yellow] (tol {cls.tolerance})" if cls.changes_numerics
                    else "[green]unchanged[/green]")
        after = ", ".join(a for a in (*cls.requires, *cls.after) if a in PASSES) or "-"
        table.add_row(name if cls.in_all else f"{name} (opt-in)", cls.summary, numerics, after)
    for name, cls in EXPLICIT_PASSES.items():        # not in `all`: each has its own flag
        numerics = (f"[yellow]changed[/yellow] (tol {cls.tolerance})" if cls.changes_numerics
                    else "[green]unchanged[/green]")
        after = getattr(cls, "runs_after", None)     # a stage that follows another explicit pass (tp's fusion)
        table.add_row(name if after else f"{name} (only via --{name} N)", cls.summary, numerics,
                      after or "every pass above")
    console.print(table)


@app.command()
def diff(artifact: Path = typer.Argument(..., help="artifact directory"),
         pass_name: str = typer.Option(..., "--pass", help="the pass whose change to show"),
         program: Optional[str] = typer.Option(None, "--program", help="only this step program (decode, prefill, ...)"),
         context: int = typer.Option(3, help="lines of context"),
         color: bool = typer.Option(True, help="colour the diff")) -> None:
    """Show the unified diff of the program before/after one pass, and the op counts it changed."""
    from lingc.artifact import ArtifactError, read_manifest
    from lingc.diff import pass_diff
    try:
        d = pass_diff(read_manifest(artifact), pass_name, program, context)
    except (ArtifactError, KeyError) as e:
        _fail(str(e).strip("'\""))
    if color and sys.stdout.isatty():
        console.print(Syntax(d.diff, "diff", word_wrap=False))
    else:
        sys.stdout.write(d.diff)
    table = Table(title=f"op counts around {pass_name}")
    for col in ("program", "op", "before", "after"):
        table.add_column(col)
    for g, ops in d.op_counts.items():
        for op, (b, a) in ops.items():
            table.add_row(g, op, str(b), str(a))
    console.print(table if table.row_count else f"op counts unchanged by {pass_name}")
    r = d.record
    console.print(f"{pass_name}: {r['matches']} match(es); "
                  f"numerics {'changed' if r['changes_numerics'] else 'unchanged'}")


@app.command()
def report(artifact: Path = typer.Argument(..., help="artifact directory"),
           out: Path = typer.Option(Path("report.html"), "--out", "-o", help="HTML file to write")) -> None:
    """Write one self-contained HTML page: every pass, its record, its diff, its PDL chains."""
    from lingc.artifact import ArtifactError, read_manifest
    from lingc.report import write_report
    try:
        art = read_manifest(artifact)
    except ArtifactError as e:
        _fail(str(e))
    try:
        path = write_report(art, out)
    except OSError as e:
        _fail(f"cannot write the report to {out}: {e}")
    console.print(f"wrote [bold]{escape(str(path))}[/bold]")


@app.command()
def generate(artifact: Path = typer.Argument(..., help="artifact directory (lingc compile ... --passes all)"),
             prompt_ids: str = typer.Option("", help="prompt as comma-separated token ids, e.g. 11,22,33"),
             prompt: str = typer.Option("", help="prompt text (needs tokenizer.json in the checkpoint)"),
             max_new_tokens: int = typer.Option(64, help="tokens to generate"),
             spec: str = typer.Option("nextn", help="nextn (MTP draft, NEXTN 5/6) or none "
                                      "(plain decode, the baseline)"),
             temperature: float = typer.Option(0.0, help="0 = greedy"),
             top_p: float = typer.Option(1.0, help="nucleus sampling mass (1 = off)"),
             top_k: int = typer.Option(0, help="keep the k most likely tokens (0 = off)"),
             seed: int = typer.Option(0, help="sampling seed (same seed, same tokens)"),
             ignore_eos: bool = typer.Option(False, "--ignore-eos", help="decode exactly --max-new-tokens "
                                             "(benchmarks)"),
             simulate_accept_len: float = typer.Option(0.0, help="benchmark knob: force this mean accept length "
                                                       "(off by default)"),
             device: str = typer.Option("cpu", help="cpu or cuda"),
             backend: str = typer.Option("auto", help="kernels: triton (Triton kernels where lingc has them), "
                                         "reference (torch reference ops) or auto (triton on cuda, reference on cpu)"),
             cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                                              help="on cuda: capture every program graph once and replay it"),
             pdl: bool = typer.Option(True, "--pdl/--no-pdl", help="on cuda with triton: programmatic dependent "
                                      "launch on the chains the pdl pass annotated"),
             greedy_graphs: bool = typer.Option(True, "--greedy-graphs/--no-greedy-graphs",
                                                help="run the specialised copies of the step graphs that fit the "
                                                "request where the artifact has them: specialize_greedy's at "
                                                "temperature 0 (argmax, no sampling distributions), "
                                                "specialize_sampling's with top-k off; --no-greedy-graphs: always "
                                                "the general graphs"),
             as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of text")) -> None:
    """Generate from an artifact: greedy or sampled, NEXTN speculative decoding by default."""
    import json

    from lingc.artifact import ArtifactError
    from lingc.runtime.engine import EngineError, Request, SamplingParams
    from lingc.runtime.tp import open_any_session
    session = None
    try:
        on_cuda = device.startswith("cuda")
        # a TP artifact (compile --tp N) starts its N ranks here and stops them below
        session = open_any_session(artifact, spec=spec, device=device, simulate_accept_len=simulate_accept_len,
                                   backend=backend, cuda_graphs=cuda_graphs and on_cuda, pdl=pdl and on_cuda,
                                   greedy_graphs=greedy_graphs)
        ids = session.encode(prompt_ids, prompt)
        req = Request(ids, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed), ignore_eos)
        result = session.engine.generate(req)
    except (ArtifactError, EngineError, ValueError, OSError) as e:
        _fail(str(e))
    finally:
        if session is not None and hasattr(session, "close"):
            session.close()
    summary = session.summary(ids, result)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    console.print(f"prompt ({len(ids)} tokens): {ids[:16]}{' ...' if len(ids) > 16 else ''}")
    console.print(f"output ({len(result.tokens)} tokens, finish: {result.finish_reason}): {result.tokens}")
    if summary.get("text") is not None:
        console.print(f"text: {escape(summary['text'])}")
    sim = f" [yellow](simulated accept length {simulate_accept_len})[/yellow]" if simulate_accept_len else ""
    console.print(f"spec {spec}: {result.steps} decode steps, mean accept length {result.mean_accept_len:.2f}{sim}; "
                  f"TTFT {result.ttft_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.1f} ms, "
                  f"{summary['tok_per_s']:.1f} tok/s")
    size = summary.get("draft_vocab")
    hot = f" (the draft proposes from {size} hot ids: draft_vocab)" if size else ""
    console.print(f"step graphs: {' -> '.join(result.graphs)}{hot}")


@app.command()
def demo(workdir: Path = typer.Option(Path(".lingc-demo"), help="where to put the checkpoint and artifact"),
         new_tokens: int = typer.Option(48, help="tokens to generate")) -> None:
    """The built-in default: a tiny random Ling-3 checkpoint, compiled with all passes (--verify), then
    generated from with NEXTN speculative decoding and checked against plain decoding."""
    from lingc.artifact import load_artifact
    from lingc.compile import compile_checkpoint
    from lingc.init import write_random_checkpoint
    from lingc.passes import PASSES
    from lingc.presets import preset
    from lingc.runtime.engine import Engine, Request
    ck, art_dir = workdir / "ck", workdir / "art"
    console.rule("1. lingc init --preset test-tiny")
    write_random_checkpoint(preset("test-tiny"), ck, seed=0)
    console.print(f"random test-tiny checkpoint (HF names, sharded) in {escape(str(ck))}")
    console.rule(f"2. lingc compile --passes all --verify  ({', '.join(PASSES)})")
    result = compile_checkpoint(ck, art_dir, ["all"], dtype="fp32", verify=True)
    for r in result.records:
        console.print(f"  {r.summary()}; verify {'bit-exact' if not r.changes_numerics else 'within tolerance'}")
    console.print(f"  programs: {', '.join(result.program.graphs)}")
    opt_in = [name for name, cls in PASSES.items() if not cls.in_all]
    console.print(f"  opt-in passes, not in all: {', '.join(opt_in)} (`lingc passes`; draft_vocab with "
                  "`lingc compile --draft-vocab FILE`; `lingc draft-vocab` counts a map from a corpus)")
    console.rule("3. lingc generate (greedy): NEXTN 5/6 vs plain decode")
    program = load_artifact(art_dir).program
    prompt = [11, 22, 33, 44, 55]
    runs = {}
    for spec, greedy_graphs in (("nextn", True), ("none", True), ("nextn", False)):
        r = Engine(program, spec=spec, greedy_graphs=greedy_graphs).generate(Request(prompt, new_tokens,
                                                                                     ignore_eos=True))
        runs[spec, greedy_graphs] = r
        console.print(f"  --spec {spec:5s}{'' if greedy_graphs else ' --no-greedy-graphs'}: {r.steps} steps, "
                      f"accept length {r.mean_accept_len:.2f}, {len(r.tokens)} tokens {r.tokens[:12]} ...; "
                      f"graphs {' -> '.join(r.graphs)}")
    same = runs["nextn", True].tokens == runs["none", True].tokens
    console.print("[green]NEXTN output is byte-identical to plain decoding[/green]" if same else
                  "[red]NEXTN and plain decoding differ[/red]")
    same = runs["nextn", True].tokens == runs["nextn", False].tokens
    console.print("[green]the greedy copies (specialize_greedy) give the general graphs' tokens[/green]" if same else
                  "[red]the greedy copies and the general graphs differ[/red]")
    console.print("(random MTP weights rarely guess the target, so the accept length is near 1; "
                  "`--temperature 0.8` or `--simulate-accept-len 3.2` show longer chains)")
    console.print(f"inspect: lingc diff {escape(str(art_dir))} --pass partition --program verify ; "
                  f"lingc report {escape(str(art_dir))} -o report.html")


@app.command()
def serve(artifact: Path = typer.Argument(..., help="artifact directory (lingc compile ... --passes all)"),
          tp: Optional[int] = typer.Option(None, "--tp", min=1, help="tensor-parallel ranks (default: the "
                                           "artifact's; N > 1 starts N ranks through lingc.runtime.tp)"),
          host: str = typer.Option("127.0.0.1", help="address to bind: loopback by default; "
                                   "0.0.0.0 exposes the server"),
          port: int = typer.Option(30000, min=1, max=65535, help="TCP port"),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LINGC_API_KEY",
                                                help="require 'Authorization: Bearer KEY' on every route but /health"),
          device: str = typer.Option("cpu", help="cpu or cuda"),
          spec: str = typer.Option("nextn", help="nextn (MTP draft, NEXTN 5/6) or none (plain decode)"),
          max_queue: int = typer.Option(64, min=0, help="requests that may wait behind the running one; more get 503"),
          max_body_bytes: int = typer.Option(1 << 20, min=1, help="request bodies larger than this get 413"),
          served_model_name: Optional[str] = typer.Option(None, help="the model id clients send (default: the "
                                                          "artifact directory's name)"),
          log_level: str = typer.Option("info", help="uvicorn log level (warning, info, debug)")) -> None:
    """Serve an artifact over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions, SGLang-style
    /generate, /health, /get_server_info, /metrics. One request decodes at a time (docs/server.md)."""
    try:
        from lingc.runtime.server import ServerConfig, ServerStopped, serve as run_server
    except ImportError as e:
        _fail(f"lingc serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'")
    import importlib

    import torch

    from lingc.artifact import ArtifactError
    from lingc.runtime.engine import EngineError
    from lingc.runtime.session import open_session
    if device.startswith("cuda") and not torch.cuda.is_available():
        _fail(f"--device {device} but torch sees no CUDA device")
    try:
        tp_runtime = importlib.import_module("lingc.runtime.tp")
    except ImportError as e:
        if e.name != "lingc.runtime.tp":
            _fail(f"cannot import lingc.runtime.tp: {e}")
        tp_runtime = None
    if tp is not None and tp > 1 and tp_runtime is None:
        _fail("tensor parallelism is not available in this build (lingc.runtime.tp is missing); serve without --tp")
    try:
        if tp is not None and tp > 1:
            session = tp_runtime.open_tp_session(artifact, tp=tp, device=device, spec=spec)
        elif tp is None and tp_runtime is not None:              # a TP artifact starts its ranks here
            session = tp_runtime.open_any_session(artifact, spec=spec, device=device)
        else:
            session = open_session(artifact, spec=spec, device=device)
    except (ArtifactError, EngineError, ValueError, OSError) as e:
        _fail(str(e))
    ranks = getattr(session, "tp", tp or 1)
    name = served_model_name or artifact.resolve().name
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning:[/yellow] serving on {escape(host)} without --api-key: anyone who can reach "
                  "this port can use the model")
    console.print(f"serving [bold]{escape(name)}[/bold] ({escape(str(artifact))}, "
                  f"spec {spec}, {device}, tp {ranks}) on "
                  f"http://{escape(host)}:{port}  (max queue {max_queue}{', API key required' if api_key else ''})")
    try:
        run_server(session, ServerConfig(name, api_key, max_queue, max_body_bytes, tp=ranks, device=device),
                   host=host, port=port, log_level=log_level)
    except ServerStopped as e:
        _fail(str(e))
    finally:
        if hasattr(session, "close"):                            # a TP session stops its ranks
            session.close()


from lingc.bench_cli import bench as _bench  # noqa: E402  (light: no httpx until it runs)

app.command("bench", help=_bench.__doc__)(_bench)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
