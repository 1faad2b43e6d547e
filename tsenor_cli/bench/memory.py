"""`tsenor bench memory`: host memory of `tsenor eval --ppl` and `tsenor prune` against model depth, streamed and whole.

Random LLaMA models of one width (1024: 16 heads of 64, MLP 4096, the SmolLM2 vocabulary of 49152 with a
tied head, fp32) with 8, 16 and 32 blocks are built from a transformers config, saved as safetensors
with the SmolLM2 tokenizer files, and each is evaluated in a fresh process, once whole
(`load_model` + `perplexity`) and once streamed (`load_model(stream=True)` + `streamed_perplexity`), on
the same random token windows. Each process reports its own peak resident set (VmHWM in
/proc/self/status: pages of the safetensors files it mapped count too) and its seconds; the parent checks
that both give the same perplexity. The figure of merit is the peak at 32 blocks over the peak at 8:
1.0 means host memory does not grow with depth, (32-block weights + rest) / (8-block weights + rest) is
what holding the model costs.

The prune half does the same for `prune_model` (magnitude, 2:4 transposable, `prune_nsamples` ×
`prune_seqlen` tokens of a generated calibration text, no resume state), whole and ``stream=True``; the
parent checks that both write the same weight files (sha256), and reports seconds per block.

The prune-eval rows run the command itself, `tsenor prune --eval` with its default flags (the resume
state, streaming: the prune reads one block at a time and the evaluation after it too), and
``--no-stream`` as the whole row (the prune holds the model; the evaluation streams, as `--eval` always
does for perplexity); same prune as above, perplexity on WikiText-2 (`windows` windows of the evaluation's
default 2048 tokens, `--max-windows`), so it needs the data folder (`TSENOR_DATA_DIR`). Its peak is the
child's own VmHWM, read by the child as it exits (`PEAK_CHILD`: the command run as ``python -m tsenor_cli``
runs it, with an exit hook), its seconds the command's wall time, imports included; the parent checks that
both modes write the same weight files and the same perplexity.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tsenor_cli.bench.machine import environment
from tsenor_cli.data.sources import DatasetName
from tsenor_cli.errors import BadInputError, InputNotFoundError, UsageError
from tsenor_cli.runfiles import EVAL_FILE
from tsenor_cli.settings import CACHE_DIR_ENV, RunContext, child_environment

MODES = ("whole", "streamed")
COMMANDS = ("eval", "prune", "prune-eval")
PRUNE_EVAL_DATA: DatasetName = "wikitext2"  # the perplexity dataset of the prune-eval rows


@dataclass(frozen=True)
class MemoryConfig:
    """blocks: the depths measured; width/intermediate/heads: the LLaMA shape; seqlen × windows: the
    evaluated tokens (the prune-eval rows: `windows` windows of 2048); seed: the weights and the tokens;
    commands: some of `COMMANDS`; prune_nsamples × prune_seqlen: the prune's calibration tokens."""

    blocks: tuple[int, ...] = (8, 16, 32)
    width: int = 1024
    intermediate: int = 4096
    heads: int = 16
    seqlen: int = 256
    windows: int = 2
    seed: int = 0
    commands: tuple[str, ...] = ("eval", "prune")  # prune-eval reads WikiText-2 from the data folder
    prune_nsamples: int = 4
    prune_seqlen: int = 64

    def __post_init__(self) -> None:
        # Checked here, before any model is built (a depth of 0 used to be refused only by the prune, exit 7).
        if not self.blocks or min(self.blocks) < 1:
            raise UsageError(f"--blocks must list depths of at least 1, e.g. 8,16,32; got {list(self.blocks)}")
        if self.width % 64 or self.heads < 1 or self.width % self.heads:
            raise UsageError(f"--width must be a multiple of 64 (heads of 64), e.g. 1024; got {self.width}")
        if self.intermediate % 4:
            raise UsageError(f"the MLP width must be a multiple of 4 (the 2:4 prune); got {self.intermediate}")
        unknown = [c for c in self.commands if c not in COMMANDS]
        if unknown or not self.commands:
            got = ",".join(self.commands)
            raise UsageError(f"--commands must be a comma list of {', '.join(COMMANDS)}, e.g. eval,prune; got {got!r}")


def _tokenizer_dir(ctx: RunContext) -> Path:
    from tsenor_cli.models.embedded import materialize

    return materialize("smollm2-135m", ctx.cache_dir)


def child_context(ctx: RunContext) -> RunContext:
    """The context of a measured evaluation or prune (`measure`, `measure_prune`): the run's cache folder
    (the embedded tokenizer), no data folder and no hub (the model is local, the tokens the bench's own)."""
    return RunContext(data_dir=None, offline=True, cache_dir=ctx.cache_dir)


def build_model(folder: Path, cfg: MemoryConfig, blocks: int, ctx: RunContext) -> int:
    """Save a random LLaMA of `blocks` blocks (fp32, seeded) with the SmolLM2 tokenizer (materialized in
    `ctx`'s cache) to `folder`; returns its weight bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _tokenizer_dir(ctx)
    config = AutoConfig.for_model(
        "llama",
        hidden_size=cfg.width,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=blocks,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        vocab_size=49152,
        max_position_embeddings=max(2048, cfg.seqlen),
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # norms
            else:
                param.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer / name, folder / name)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    return weights


def _peak_rss() -> int:
    """This process's peak resident set in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise BadInputError("/proc/self/status has no VmHWM; the memory benchmark needs Linux")


def measure(folder: Path, mode: str, cfg: MemoryConfig, ctx: RunContext) -> dict[str, Any]:
    """Evaluate the model in `folder` (`mode`: whole or streamed) on cfg's windows in this process:
    {"ppl", "seconds", "peak_rss"}. Run it in a fresh process (`run_child`): the peak is the process's.
    ctx: the run's context (`child_context`)."""
    from tsenor_cli.evaluation.perplexity import Windows, perplexity
    from tsenor_cli.evaluation.streamed import streamed_perplexity
    from tsenor_cli.models.loading import load_model

    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(3, 49000, (1, cfg.seqlen * cfg.windows), generator=gen)
    cpu = torch.device("cpu")
    started = time.perf_counter()
    if mode == "whole":
        loaded = load_model(str(folder), ctx)
        result = perplexity(loaded.model, ids, Windows(cfg.seqlen), device=cpu)
    else:
        loaded = load_model(str(folder), ctx, stream=True)
        result = streamed_perplexity(loaded, ids, Windows(cfg.seqlen), device=cpu)
    return {"ppl": result.ppl, "seconds": time.perf_counter() - started, "peak_rss": _peak_rss()}


def calibration_text(path: Path, cfg: MemoryConfig) -> Path:
    """A calibration text file long enough for cfg's prune (seeded words): the benchmark needs no data folder."""
    gen = torch.Generator().manual_seed(cfg.seed)
    words = torch.randint(0, 5000, (cfg.prune_nsamples * cfg.prune_seqlen * 8,), generator=gen)
    path.write_text(" ".join(f"w{int(w)}" for w in words) + "\n", encoding="utf-8")
    return path


def measure_prune(folder: Path, mode: str, cfg: MemoryConfig, ctx: RunContext) -> dict[str, Any]:
    """Prune the model in `folder` (`mode`: whole or streamed) in this process into a folder beside it:
    {"sha256" of the weight files (model.safetensors, or the shards and their index), "seconds", "peak_rss"}.
    ctx: the run's context (`child_context`)."""
    from tsenor_cli.pruning.run.api import prune_model
    from tsenor_cli.pruning.settings.recipe import build_config

    output = folder.parent / f"{folder.name}-pruned-{mode}"
    recipe = {
        "model": str(folder),
        "nm": "2:4",
        "method": "magnitude",
        "calib_data": str(calibration_text(folder.parent / "calib.txt", cfg)),
        "nsamples": cfg.prune_nsamples,
        "seqlen": cfg.prune_seqlen,
        "output": str(output),
        "stream": mode == "streamed",
    }
    prune_cfg = build_config(recipe, force=False, resume=False, command="bench memory")
    started = time.perf_counter()
    prune_model(prune_cfg, ctx)
    seconds = time.perf_counter() - started
    peak = _peak_rss()
    digest = _weights_sha256(output)
    shutil.rmtree(output)
    return {"sha256": digest, "seconds": seconds, "peak_rss": peak}


def _weights_sha256(output: Path) -> str:
    """One sha256 of a checkpoint's weight files: deeper models are written in shards
    (model-0000k-of-0000n.safetensors + index), hashed all, in order, with their names."""
    import hashlib

    from tsenor_cli.data.sources import sha256_file

    digest = hashlib.sha256()
    for path in sorted(output.glob("model*.safetensors*")):
        digest.update(path.name.encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def prune_eval_command(
    folder: Path, output: Path, mode: str, cfg: MemoryConfig, ctx: RunContext | None = None
) -> list[str]:
    """`tsenor prune --eval` of the model in `folder` into `output` with the default flags but the bench's
    prune (magnitude 2:4 on its calibration text) and evaluation (WikiText-2, `windows` windows);
    `--no-stream` for the whole mode; the run context's data folder and offline policy as flags."""
    calib = calibration_text(folder.parent / "calib.txt", cfg)
    # No -q either: the command as a user types it (its progress lines go to a file, not a terminal).
    command = [sys.executable, "-m", "tsenor_cli", "prune", str(folder), "--nm", "2:4"]
    command += ["--method", "magnitude", "--calib-data", str(calib), "--nsamples", str(cfg.prune_nsamples)]
    command += ["--seqlen", str(cfg.prune_seqlen), "--output", str(output), "--eval", "--ppl", PRUNE_EVAL_DATA]
    command += ["--max-windows", str(cfg.windows), *(["--no-stream"] if mode == "whole" else [])]
    if ctx is not None and ctx.data_dir is not None:
        command += ["--data-dir", str(ctx.data_dir)]
    if ctx is not None and ctx.offline:
        command += ["--offline"]
    return command


# `python -c PEAK_CHILD PEAK_FILE ARGS...` runs `python -m tsenor_cli ARGS...` and writes its VmHWM to
# PEAK_FILE at exit. The child's ru_maxrss (os.wait4) is no measure of the command: Linux keeps in it the
# largest resident set of every memory map the process had, and a child that subprocess starts had the
# bench's own until its exec (vfork). After building the 32-block model (2.8 GiB resident) the bench got
# 2.83 GiB for the streamed child, whose own VmHWM, sampled from /proc meanwhile, was 1.52 GiB.
PEAK_CHILD = (
    "import atexit, runpy, sys; from tsenor_cli.bench.memory import write_peak_rss; "
    "atexit.register(write_peak_rss, sys.argv.pop(1)); runpy.run_module('tsenor_cli', run_name='__main__')"
)


def write_peak_rss(path: str) -> None:
    """Write this process's peak resident set (`_peak_rss`, bytes) to `path` (the prune-eval child's exit hook)."""
    Path(path).write_text(str(_peak_rss()))


def measure_prune_eval(folder: Path, mode: str, cfg: MemoryConfig, ctx: RunContext) -> dict[str, Any]:
    """Run `prune_eval_command` as a child process: {"ppl" (eval.json's), "sha256" of the weight files,
    "seconds" (the command's wall time), "peak_rss" (the child's own VmHWM, `PEAK_CHILD`)}."""
    output = folder.parent / f"{folder.name}-pruned-eval-{mode}"
    peak = folder.parent / f"{folder.name}-peak-{mode}"
    command = prune_eval_command(folder, output, mode, cfg, ctx)
    assert command[1:3] == ["-m", "tsenor_cli"]  # the command PEAK_CHILD runs
    env = child_environment({CACHE_DIR_ENV: str(ctx.cache_dir)})
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        argv = [command[0], "-c", PEAK_CHILD, str(peak), *command[3:]]
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, check=False)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            err.seek(0)
            last = err.read().decode(errors="replace").strip().splitlines()[-1:]
            raise BadInputError(f"the {mode} prune --eval of {folder} failed (exit {done.returncode}): {last}")
    evaluation = json.loads((output / EVAL_FILE).read_text())
    result = {
        "ppl": float(evaluation["perplexity"][PRUNE_EVAL_DATA]["ppl"]),
        "sha256": _weights_sha256(output),
        "seconds": seconds,
        "peak_rss": int(peak.read_text()),
    }
    peak.unlink()
    shutil.rmtree(output)
    return result


def run_child(folder: Path, mode: str, cfg: MemoryConfig, ctx: RunContext, command: str = "eval") -> dict[str, Any]:
    """`measure` (eval) or `measure_prune` (prune) in a fresh Python process, given `ctx`'s cache folder
    (`child_context`), or the `tsenor prune --eval` process itself (prune-eval, `measure_prune_eval`,
    given `ctx`'s data folder and cache folder); its result."""
    if command == "prune-eval":
        return measure_prune_eval(folder, mode, cfg, ctx)
    module = "tsenor_cli.bench.memory"
    command_line = [
        sys.executable, "-m", module, command, str(folder), mode, json.dumps(asdict(cfg)), str(ctx.cache_dir)
    ]  # fmt: skip
    done = subprocess.run(command_line, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BadInputError(f"the {mode} {command} of {folder} failed: {done.stderr.strip().splitlines()[-1:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def check_prune_eval_data(ctx: RunContext) -> None:
    """InputNotFoundError, before any model is built, when the prune-eval rows' WikiText-2 has no source
    in `ctx` (the hub off and no data folder)."""
    from tsenor_cli.data.sources import data_folder

    try:
        data_folder(ctx, PRUNE_EVAL_DATA)
    except InputNotFoundError as exc:
        raise InputNotFoundError(
            f"{str(exc).split(';')[0]}; the prune-eval rows evaluate it: set TSENOR_DATA_DIR to the offline data "
            "folder, or drop prune-eval from --commands"
        ) from exc


def run_memory_bench(cfg: MemoryConfig, ctx: RunContext, *, say: Any = print) -> dict[str, Any]:
    """Every depth × mode of `cfg` (module docstring) → the result written to JSON and markdown. ctx: the
    run's context (its cache folder for the tokenizer, its data folder for the prune-eval rows), read by
    the command from its flags and the environment, never here."""
    rows: list[dict[str, Any]] = []
    if "prune-eval" in cfg.commands:
        check_prune_eval_data(ctx)
    with tempfile.TemporaryDirectory(prefix="tsenor-bench-memory-") as tmp:
        for blocks in cfg.blocks:
            folder = Path(tmp) / f"llama-{blocks}"
            weights = build_model(folder, cfg, blocks, ctx)
            for command in cfg.commands:
                results = {mode: run_child(folder, mode, cfg, ctx, command) for mode in MODES}
                _check_agree(results, command, blocks)
                for mode, result in results.items():
                    rows.append({"command": command, "blocks": blocks, "mode": mode, "weights": weights, **result})
                    say(
                        f"{command} {blocks} blocks {mode}: peak RSS {result['peak_rss'] / 2**30:.2f} GiB, "
                        f"{result['seconds']:.1f} s"
                    )
            shutil.rmtree(folder)
    ratios = {}
    for command in cfg.commands:
        for mode in MODES:
            peaks = {
                row["blocks"]: row["peak_rss"] for row in rows if row["mode"] == mode and row["command"] == command
            }
            ratios[f"{command} {mode}"] = peaks[max(cfg.blocks)] / peaks[min(cfg.blocks)]
    return {
        "config": asdict(cfg),
        "rows": rows,
        "peak_ratio_deepest_over_shallowest": ratios,
        "machine": environment("cpu"),
    }


def _check_agree(results: dict[str, dict[str, Any]], command: str, blocks: int) -> None:
    """BadInputError unless the streamed and whole runs agree: the same ppl (1e-5 relative), the same file."""
    whole, streamed = results["whole"], results["streamed"]
    if "ppl" in whole and abs(streamed["ppl"] - whole["ppl"]) > 1e-5 * whole["ppl"]:
        raise BadInputError(f"{blocks} blocks: streamed ppl {streamed['ppl']} differs from whole {whole['ppl']}")
    if "sha256" in whole and streamed["sha256"] != whole["sha256"]:
        raise BadInputError(f"{blocks} blocks: the streamed {command} wrote other weight files than the whole one")


def read_result(path: Path) -> dict[str, Any]:
    """An earlier run's --output JSON, for --merge (BadInputError naming the file when it is not one)."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(result, dict) and {"config", "rows", "peak_ratio_deepest_over_shallowest"} <= result.keys():
            return result
        problem = "it holds no config, rows and peak ratios"
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"it is not JSON ({exc})"
    raise BadInputError(f"--merge cannot read {path}: {problem}; pass the --output JSON of an earlier bench memory")


def merge_results(base: dict[str, Any], new: dict[str, Any], where: str) -> dict[str, Any]:
    """`base` (read from `where`) with the commands `new` measured replaced or added (`bench memory
    --merge`): one page of rows measured at different times, so a long bench on a shared machine need
    not be rerun whole for one new command. Each command keeps its own `sections` entry: the config,
    machine, date and command line it was measured with, which `to_markdown` prints with its table."""

    def sections(result: dict[str, Any]) -> dict[str, Any]:
        found = dict(result.get("sections", {}))
        for command in result["config"]["commands"]:
            if command in found:
                continue
            if "date" not in result or "command" not in result:
                raise BadInputError(
                    f"{where} records no date and command line of its {command} rows, so a merged page could not "
                    "say when they were measured; rerun every command without --merge"
                )
            note = {"date": result["date"], "command": result["command"]}
            found[command] = {"config": result["config"], "machine": result.get("machine", {}), **note}
        return found

    measured = set(new["config"]["commands"])
    kept = [c for c in base["config"]["commands"] if c not in measured]
    merged_sections = {c: v for c, v in sections(base).items() if c in kept} | sections(new)
    ratios = base["peak_ratio_deepest_over_shallowest"] | new["peak_ratio_deepest_over_shallowest"]
    return {
        "config": {**base["config"], "commands": [*kept, *new["config"]["commands"]]},
        "rows": [row for row in base["rows"] if row["command"] in kept] + new["rows"],
        "peak_ratio_deepest_over_shallowest": {k: v for k, v in ratios.items() if k.split()[0] in merged_sections},
        "machine": new.get("machine", {}),
        "date": new["date"],
        "command": new["command"],
        "sections": merged_sections,
    }


def to_markdown(result: dict[str, Any], command: str, date: str, machine: str) -> str:
    """The measurement page: the command, the machine, a table per measured command and the depth ratios
    (a merged result, `merge_results`: each section with its own date, command line and settings)."""
    cfg = result["config"]
    commands = cfg.get("commands", ["eval"])
    names = [f"`tsenor {_invocation(c)}`" for c in commands]
    title = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    sections = result.get("sections", {})
    when = "Each section says when and with which command it was measured" if sections else f"Measured {date}"
    lines = [
        f"# Host memory of {title}: streamed against whole",
        "",
        f"{when} on {machine}{'' if sections else f' with `{command}`'}. Random LLaMA models of width "
        f"{cfg['width']} (MLP {cfg['intermediate']}, {cfg['heads']} heads, vocabulary 49152 with a tied head, "
        "fp32), each run in a fresh process (`tsenor_cli/bench/memory.py`); peak RSS is the process's VmHWM.",
        "",
    ]
    if not sections:
        lines += [*_versions(result.get("machine", {})), ""]
    ratios = result["peak_ratio_deepest_over_shallowest"]
    for name in commands:
        section = sections.get(name, {})
        part = section.get("config", cfg)
        lines += [f"## `tsenor {_invocation(name)}`", ""]
        if section:
            lines += [f"Measured {section['date']} with `{section['command']}`.", *_versions(section["machine"]), ""]
        lines += [
            _what(name, part),
            "",
            "| blocks | weights (GiB) | mode | peak RSS (GiB) | seconds | s / block |",
            "|---:|---:|---|---:|---:|---:|",
        ]
        lines += [
            f"| {row['blocks']} | {row['weights'] / 2**30:.2f} | {row['mode']} | "
            f"{row['peak_rss'] / 2**30:.2f} | {row['seconds']:.1f} | {row['seconds'] / row['blocks']:.2f} |"
            for row in result["rows"]
            if row.get("command", "eval") == name
        ]
        deepest, shallowest = max(part["blocks"]), min(part["blocks"])
        lines += [
            "",
            f"Peak RSS at {deepest} blocks over {shallowest} blocks: whole {ratios[f'{name} whole']:.2f}x, "
            f"streamed {ratios[f'{name} streamed']:.2f}x (target: at most 1.3x)."
            + (
                " Streamed misses the target: its host memory still grows with depth."
                if ratios[f"{name} streamed"] > 1.3
                else ""
            ),
            "",
        ]
    lines += [
        "Whole, the peak grows by about the weights added (the model is held, plus what loading maps). "
        "Streamed, it is the parts outside the blocks (here the tied 49152-row embedding), one block, the "
        "activations (eval: the windows' hidden states and one window's logits; prune: the calibration "
        "samples' hidden states, the statistics and one matrix's solver work), plus the Python runtime: the "
        "same at any depth. Seconds include the load and the write (not Python's imports), so fixed costs weigh "
        "on the shallow models; the machine is shared, so compare the two modes within a depth, not across runs.",
        "",
    ]
    return "\n".join(lines)


def _versions(env: dict[str, Any]) -> list[str]:
    """The library versions and the load average a measurement started with (none for an old result)."""
    if "transformers" not in env:
        return []
    return [
        f"tsenor {env['tsenor']}, torch {env['torch']}, transformers {env['transformers']}, Python "
        f"{env['python']}; load average {env['load_average']:.1f} at the start."
    ]


def _what(command: str, cfg: dict[str, Any]) -> str:
    """What a section measured, from the settings it was measured with."""
    calibration = f"{cfg.get('prune_nsamples')} × {cfg.get('prune_seqlen')} calibration tokens"
    if command == "eval":
        return (
            f"`--ppl` on {cfg['windows']} window(s) of {cfg['seqlen']} tokens; both modes give the same "
            "perplexity (checked to 1e-5 relative)."
        )
    if command == "prune":
        return (
            f"magnitude 2:4 transposable on {calibration}, `--no-resume-state`; both modes write the same "
            "weight files (sha256 checked)."
        )
    return (
        "The command `tsenor prune --eval` with its default flags (resume state, streaming) as the streamed "
        "row and `--no-stream` as the whole row (its evaluation streams either way): magnitude 2:4 "
        f"transposable on {calibration}, then perplexity on WikiText-2, {cfg['windows']} window(s) of 2048 "
        "tokens (`--max-windows`). Peak RSS is the child's own VmHWM, written by the child as it exits (not "
        "wait4's ru_maxrss, which holds the bench's own resident set from before the child's exec), seconds "
        "the command's wall time with Python's imports; both modes write the same weight files and the same "
        "perplexity (checked)."
    )


def _invocation(command: str) -> str:
    """How the page names a measured command: "prune-eval" is `tsenor prune --eval`."""
    return "prune --eval" if command == "prune-eval" else command


def main(argv: list[str]) -> None:
    """The child process of `run_child`: COMMAND FOLDER MODE CONFIG_JSON CACHE_DIR → one JSON line on stdout."""
    command, folder, mode, raw, cache = argv
    settings = json.loads(raw)
    cfg = MemoryConfig(**{**settings, "blocks": tuple(settings["blocks"]), "commands": tuple(settings["commands"])})
    run = measure_prune if command == "prune" else measure
    ctx = RunContext(data_dir=None, offline=True, cache_dir=Path(cache))
    print(json.dumps(run(Path(folder), mode, cfg, ctx)))


if __name__ == "__main__":
    main(sys.argv[1:])
