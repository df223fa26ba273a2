"""Benchmark one GRPO step: megarl's trainer vs TRL's GRPOTrainer on the same work. Prints a table.

    bash ci/setup_bench_env.sh     # once: .venv-bench with TRL (never in the package's environment)
    .venv/bin/python tools/bench_rl.py [--frameworks megarl,trl] [--presets bench-qwen2-300k,small-qwen2-20m]
        [--lengths 8,16] [--threads 2] [--warmup 2] [--steps 5] [--rounds 3] [--output runs/bench_rl.json]

Each case (preset x completion length L) runs both frameworks one after the other, ``--rounds``
times, alternating which goes first (this machine's speed drifts 15-20% within minutes, so one
pair of runs can swing the ratio that much), on:

* the same local HF model directory (``save_tiny_hf_model(preset, dir, seed)`` plus the char
  tokenizer), fp32, random init;
* the same prompts: 16 synthetic arithmetic problems per step (``make_arith_problems``), 8
  completions each = 128 completions per step, of fixed length L (TRL: ``max_completion_length=L``,
  ``min_new_tokens=L``; megarl: ``rollout.ignore_eos``), checked after the run; temperature 1.0;
* the same reward (``arithmetic.compute_score`` with partial credit, so groups differ);
* one optimizer step per generation batch (no reuse: ``num_iterations=1``), Adam lr 1e-6 constant,
  no weight decay, grad clip 1.0, no KL and no reference model, no evaluation, no checkpoint before
  the last step (megarl saves once at the end, outside the timed steps);
* forward + backward over ``--micro-batch`` completions at a time (default: all 128 at once), no
  activation recomputation (TRL's defaults, gradient checkpointing and bf16, are turned off;
  with them and 8 completions per micro-batch TRL is ~1.6x slower);
* the same threads: ``OMP_NUM_THREADS=--threads``, both process trees pinned to the same
  ``--threads`` CPUs.

TRL runs in .venv-bench (``MEGARL_BENCH_VENV`` overrides) as ``bench_rl.py --side trl``; its
step time is measured from ``on_step_begin`` to ``on_step_end`` of a TrainerCallback and its
phases from TRL's own profiling contexts (``generate``: ``transformers.generate``; ``update``:
the step minus ``_prepare_inputs``, i.e. forward + backward + optimizer). megarl runs as
``megarl train <config> [--megarl-override key=value ...]`` (the ``megarl`` next to this
Python); its times are the ``time/*`` entries of ``<output_dir>/metrics.jsonl``. The first
``--warmup`` steps are excluded; times are medians over the ``--steps`` timed steps (robust to
the bursts of other processes on a shared machine; the JSON keeps every step). Peak memory is
the largest summed PSS of the side's process tree, sampled every ``PSS_EVERY_S`` (5 s); the
report prints that sample per kind of process (``process_label``) under the table.
A round's speedup is TRL's s/step over megarl's (> 1: megarl is faster); a case reports the
median of its rounds' speedups and their range, and per framework the median over rounds of each
column.

Each case also prints its GEMM floor: the seconds the step's matrix products take alone at their
shapes (MKL or oneDNN, whichever is faster per shape) on the sides' threads (``step_gemms``: the
prompts prefilled and trained once per group, every completion token decoded and trained),
measured after each round on the sides' CPUs; the fastest measurement counts. No implementation
of the step can be faster; "x GEMM" is each side's step over it.

The machine's load average is printed with the table: another busy process makes 2-thread steps
many times slower (docs/benchmarks.md); compare numbers only from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRESETS = ("bench-qwen2-300k", "small-qwen2-20m")
FRAMEWORKS = ("megarl", "trl")
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
COMPLETIONS_PER_STEP = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
PARTIAL_CREDIT_SCALE = 10.0  # dense reward: random completions already score differently within a group
RESULT_PREFIX = "BENCH_RL_RESULT "
# Reading a process tree's PSS walks every page table: ~90 ms of CPU for megarl's 15 processes
# here. Sampled every 0.5 s it took ~9% of the two CPUs from the side being measured (TRL's one
# process costs far less to read), so the peak is sampled every 5 s.
PSS_EVERY_S = 5.0
MEGARL_METRICS = ("step", "time/step_s", "time/generate_s", "time/update_s", "response_length/mean")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def emit_result(result: dict) -> None:
    """A child side's answer to the parent: one prefixed JSON line on stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def medians(rows: list[dict]) -> dict:
    """Per key, the median over rows (one row per timed step)."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


# ------------------------------------------------------------------------ child sides


def prepare_side(args: argparse.Namespace) -> None:
    """Build each preset's model directory (weights + char tokenizer) and megarl's prompt file."""
    import torch
    import transformers

    from megarl.data.io import write_records
    from megarl.data.prepare import synthetic_arith_records
    from model_specs.presets import PRESETS as ALL_PRESETS
    from model_specs.presets import save_tiny_hf_model
    from model_specs.tokenizer import save_char_tokenizer

    unknown = [p for p in args.presets if p not in ALL_PRESETS]
    if unknown:
        raise SystemExit(f"bench_rl: unknown preset(s) {unknown}; model_specs/presets.py has {sorted(ALL_PRESETS)}")
    workdir = Path(args.workdir)
    params, configs, prompt_tokens = {}, {}, {}
    records = synthetic_arith_records(args.num_prompts, seed=args.seed, partial_credit_scale=PARTIAL_CREDIT_SCALE)
    write_records(records, workdir / "arith.parquet")
    for preset in args.presets:
        model_dir = save_tiny_hf_model(preset, workdir / "models" / preset, seed=args.seed)
        save_char_tokenizer(model_dir)
        weights = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        params[preset] = sum(p.numel() for p in weights.parameters())
        configs[preset] = weights.config.to_dict()
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        prompt_tokens[preset] = round(statistics.mean(len(tokenizer(r["prompt"])["input_ids"]) for r in records)
                                      * PROMPTS_PER_STEP)
    emit_result({"params": params, "configs": configs, "prompt_tokens": prompt_tokens, "torch": torch.__version__,
                 "transformers": transformers.__version__})


def step_gemms(hf: dict, prompt_tokens: int, length: int) -> dict[str, list[tuple[int, int, int, int]]]:
    """The matrix products of one step of this benchmark's work at their fewest, per phase, as
    ``(count, m, k, n)`` (``count`` products of an [m, k] by a [k, n] matrix) for a dense model of
    config ``hf``: generation prefills the step's ``prompt_tokens`` once and decodes the other
    ``length - 1`` tokens of all completions together; the update runs the forward and both
    backward products (input and weight gradients) over each prompt once per group and every
    completion token, with the output layer only where a completion token is predicted."""
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hidden // hf["num_attention_heads"]
    queries, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    linears = [(hidden, queries + 2 * kv), (queries, hidden), (hidden, 2 * hf["intermediate_size"]),
               (hf["intermediate_size"], hidden)]
    output_layer, rows = (hidden, hf["vocab_size"]), COMPLETIONS_PER_STEP
    generate = [(layers, prompt_tokens, k, n) for k, n in linears] + [(1, PROMPTS_PER_STEP, *output_layer)]
    generate += [(layers * (length - 1), rows, k, n) for k, n in linears] + [(length - 1, rows, *output_layer)]
    update = []
    for count, m, (k, n) in [(layers, prompt_tokens + rows * length, shape) for shape in linears] + \
            [(1, rows * length, output_layer)]:
        update += [(count, m, k, n), (count, m, n, k), (count, k, m, n)]
    return {"generate": generate, "update": update}


def gemm_seconds(gemms: list[tuple[int, int, int, int]], repeats: int = 5) -> float:
    """Seconds ``gemms`` (``step_gemms``) take as plain fp32 matrix products on this process's
    threads, each shape timed alone through MKL (``torch.mm``) and oneDNN (the two libraries
    ``parallel.cpu.linear`` chooses from), the best of ``repeats`` calls of either: a step that
    also does attention, norms, activations, sampling and the optimizer cannot take less."""
    import torch

    from parallel.cpu.linear import onednn_available, onednn_linear

    total = 0.0
    for count, m, k, n in gemms:
        a, b, b_rows = torch.randn(m, k), torch.randn(k, n), torch.randn(n, k)
        calls = [lambda: torch.mm(a, b)]
        if onednn_available():
            calls.append(lambda: onednn_linear(a, b_rows))
        best = float("inf")
        for _ in range(repeats):
            for call in calls:
                start = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - start)
        total += count * best
    return total


def trl_side(args: argparse.Namespace) -> None:
    """One TRL GRPOTrainer run; per-step times and completion lengths of the timed steps."""
    import resource

    import datasets
    import torch
    import transformers
    import trl
    from trl.extras.profiling import ProfilingContext

    from megarl.rewards.arithmetic import compute_score, make_arith_problems
    from model_specs.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    phases: dict[str, float] = {}
    lengths: list[int] = []

    def record_phase(self, duration: float) -> None:  # TRL hands its timings only to W&B/MLflow
        name = self.name.split(".", 1)[-1]
        phases[name] = phases.get(name, 0.0) + duration

    ProfilingContext._log_metrics = record_phase

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            phases.clear()
            lengths.clear()
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"step_s": time.perf_counter() - self.start,
                               "cpu_s": time.process_time() - self.cpu_start,
                               "phases": dict(phases), "lengths": list(lengths)})

    def arithmetic_reward(completions, answer, completion_ids, **_):
        lengths.extend(len(ids) for ids in completion_ids)
        return [compute_score(c, a, partial_credit_scale=PARTIAL_CREDIT_SCALE) for c, a in zip(completions, answer)]

    problems = make_arith_problems(PROMPTS_PER_STEP * total, seed=args.seed)
    dataset = datasets.Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(args.model_dir)
    config = trl.GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl-output"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=COMPLETIONS_PER_STEP // args.micro_batch,
        num_generations=SAMPLES_PER_PROMPT, max_completion_length=args.length,
        generation_kwargs={"min_new_tokens": args.length}, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, loss_type="grpo", learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, max_steps=total, logging_steps=total, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=args.seed, shuffle_dataset=False, dataloader_num_workers=0,
    )
    timer = StepTimer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
    trainer.train()

    timed = timer.steps[args.warmup:]
    if len(timed) != args.steps:
        raise RuntimeError(f"TRL ran {len(timer.steps)} steps, expected {total}")
    for step in timed:
        if len(step["lengths"]) != COMPLETIONS_PER_STEP or set(step["lengths"]) != {args.length}:
            raise RuntimeError(f"TRL completions are not {COMPLETIONS_PER_STEP} x {args.length} tokens: "
                               f"{len(step['lengths'])} completions, lengths {sorted(set(step['lengths']))}")
    rows = [{"step_s": s["step_s"],
             "cpu_s": s["cpu_s"],  # CPU seconds of all threads: less sensitive to a busy machine than wall time
             "generate_s": s["phases"]["transformers.generate"],
             "update_s": s["step_s"] - s["phases"]["_prepare_inputs"],
             "other_s": s["phases"]["_prepare_inputs"] - s["phases"]["transformers.generate"],
             "tokens_per_step": sum(s["lengths"])} for s in timed]
    emit_result({
        **medians(rows),
        "step_s_each": [s["step_s"] for s in timed],
        "phases": medians([s["phases"] for s in timed]),
        "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    })


# ------------------------------------------------------------------------ parent: running the sides


class SideFailed(RuntimeError):
    pass


def process_label(proc) -> str:
    """What a process is, for the memory breakdown: a Ray worker's or SGLang process's title
    (``ray::MegatronWorker``, ``sglang::scheduler``), a Python process's script or ``-c`` code
    (``python monitor.py``, ``python -c from megarl.rollout.sglang.engine_process ...``), else its
    executable's name (``gcs_server``)."""
    argv = proc.cmdline() or [proc.name()]
    title = argv[0]
    if title.startswith(("ray::", "sglang::")):
        return title.split()[0].split(".")[0].rstrip("_0123456789").removesuffix("_TP")
    if proc.name().startswith("python"):
        for i, arg in enumerate(argv[1:], 1):
            if arg in ("-m", "-c") and i + 1 < len(argv):
                return f"python {arg} {argv[i + 1][:48]}"
            if arg.endswith(".py"):
                return f"python {Path(arg).name}"
    return proc.name()


def tree_pss(pid: int) -> tuple[int, dict[str, list[int]]]:
    """Summed PSS of a process and its descendants, in bytes (a shared page is split among its
    sharers), and each process's PSS grouped by ``process_label``."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, {}
    by_label: dict[str, list[int]] = {}
    for proc in procs:
        try:
            label = "the side's main process" if proc.pid == pid else process_label(proc)
            by_label.setdefault(label, []).append(proc.memory_full_info().pss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sum(sum(sizes) for sizes in by_label.values()), by_label


def stop_tree(proc: subprocess.Popen) -> None:
    """End a side that overran or was interrupted: its process and every descendant, by pid."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def run_side(name: str, cmd: list[str], log_path: Path, threads: int, timeout: float) -> dict:
    """Run one side with ``threads`` threads on ``threads`` CPUs; wall time, peak tree PSS, its result line."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    peak, peak_processes = 0, {}
    start = last_sample = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        try:
            while proc.poll() is None:
                if time.monotonic() - last_sample >= PSS_EVERY_S:
                    total, processes = tree_pss(proc.pid)
                    if total > peak:
                        peak, peak_processes = total, processes
                    last_sample = time.monotonic()
                if time.monotonic() - start > timeout:
                    raise SideFailed(f"{name} ran past --timeout {timeout:.0f} s")
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                stop_tree(proc)
    wall = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-25:])
        raise SideFailed(f"{name} exited with status {proc.returncode}; log {log_path}, last lines:\n{tail}")
    results = [line[len(RESULT_PREFIX):] for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(results[-1]) if results else {}
    return dict(result, wall_s=wall, peak_gb=peak / 2**30,
                peak_processes={label: [size / 2**30 for size in sizes] for label, sizes in peak_processes.items()})


def bench_python() -> Path:
    venv = Path(os.environ.get("MEGARL_BENCH_VENV", ROOT / ".venv-bench"))
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench_rl: no benchmark environment at {venv} (TRL's side runs there); "
                         "create it with `bash ci/setup_bench_env.sh`")
    return python


def run_trl(args, root: Path, preset: str, length: int, workdir: Path) -> dict:
    cmd = [str(bench_python()), str(Path(__file__).resolve()), "--side", "trl", "--model-dir",
           str(root / "models" / preset), "--length", str(length), "--threads", str(args.threads),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--lr", str(args.lr),
           "--micro-batch", str(args.micro_batch), "--seed", str(args.seed), "--workdir", str(workdir)]
    result = run_side("TRL", cmd, workdir / "trl.log", args.threads, args.timeout)
    if "step_s" not in result:
        raise SideFailed(f"TRL printed no result line; log {workdir / 'trl.log'}")
    return result


def megarl_config(args, model_dir: Path, data_file: Path, length: int, output_dir: Path) -> dict:
    """The run config of the megarl side: the same work as TRL's (see the module docstring)."""
    return {
        "defaults": ["algorithm/grpo", "layout/tp1", "cluster/local-cpu"],
        "model": {"path": str(model_dir), "dtype": "float32"},
        "actor": {"optim": {"lr": args.lr, "weight_decay": 0.0, "clip_grad": 1.0, "lr_schedule": "constant"},
                  "micro_batch_size": args.micro_batch, "kl_loss": {"enabled": False}},
        "ref": {"enabled": False},
        "rollout": {"n": SAMPLES_PER_PROMPT, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                    "max_new_tokens": length, "ignore_eos": True},
        "data": {"train_files": [str(data_file)], "batch_size": PROMPTS_PER_STEP, "prompt_template": "{prompt}",
                 "shuffle": False},
        "trainer": {"total_steps": args.warmup + args.steps, "save_every": 0, "resume": "none",
                    "output_dir": str(output_dir), "seed": args.seed, "loggers": ["console"], "log_every": 1},
        "cluster": {"cpu_ranks_per_node": 1},
    }


def run_megarl(args, root: Path, preset: str, length: int, workdir: Path) -> dict:
    cli = Path(sys.executable).parent / "megarl"
    if not cli.exists():
        raise SideFailed(f"no megarl command next to {sys.executable}; run this tool with the package's "
                         "environment (.venv/bin/python, made by ci/setup_env.sh)")
    output_dir = workdir / "megarl-output"
    config_path = workdir / "megarl.yaml"
    # JSON is YAML: the config loader reads it as is.
    config = megarl_config(args, root / "models" / preset, root / "arith.parquet", length, output_dir)
    config_path.write_text(json.dumps(config, indent=2))
    result = run_side("megarl", [str(cli), "train", str(config_path), *args.megarl_override],
                      workdir / "megarl.log", args.threads, args.timeout)
    metrics_path = output_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise SideFailed(f"megarl wrote no {metrics_path}; log {workdir / 'megarl.log'}")
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    missing = sorted({key for r in records for key in MEGARL_METRICS if key not in r})
    if missing:
        raise SideFailed(f"{metrics_path} lacks {missing} in some steps; this benchmark reads {MEGARL_METRICS}")
    records.sort(key=lambda r: r["step"])
    timed = records[args.warmup:]
    if len(timed) != args.steps:
        raise SideFailed(f"megarl logged {len(records)} steps in {metrics_path}, expected {args.warmup + args.steps}")
    lengths = sorted({r["response_length/mean"] for r in timed})
    if any(abs(x - length) > 1e-6 for x in lengths):
        raise SideFailed(f"megarl completions are not {length} tokens long: response_length/mean {lengths}")
    phases = medians([{key[len("time/"):].removesuffix("_s"): value for key, value in r.items()
                       if key.startswith("time/")} for r in timed])
    return dict(
        result,
        step_s=phases.pop("step"),
        step_s_each=[r["time/step_s"] for r in timed],
        tokens_per_step=length * COMPLETIONS_PER_STEP,
        generate_s=phases["generate"],
        update_s=phases["update"],
        other_s=statistics.median(r["time/step_s"] - r["time/generate_s"] - r["time/update_s"] for r in timed),
        phases=phases,
        reported=medians([{key: value for key, value in r.items() if key.startswith("throughput/")} for r in timed]),
    )


# ------------------------------------------------------------------------ parent: the report


def run_round(args, workdir: Path, case: dict, index: int) -> dict:
    """One run of each framework on the case; even rounds start with TRL, odd ones with megarl, so
    a slow spell of the machine (a pure GEMM loop here moves 15-20% within seconds) does not
    always land on the same side. Returns ``{framework: result, "speedup": TRL/megarl}``."""
    preset, length = case["preset"], case["length"]
    order = sorted(args.frameworks, key=FRAMEWORKS[::-1].index)  # trl first
    if index % 2:
        order.reverse()
    results: dict = {}
    for framework in order:
        side_dir = workdir / f"{preset}-L{length}" / f"round{index + 1}" / framework
        side_dir.mkdir(parents=True)
        log(f"{preset} ({case['params'] / 1e6:.2f}M params) L={length} round {index + 1}/{args.rounds}: {framework}")
        runner = run_trl if framework == "trl" else run_megarl
        try:
            r = runner(args, workdir, preset, length, side_dir)
        except SideFailed as error:
            log(f"{framework} failed: {error}")
            results[framework] = {"error": str(error)}
            continue
        r["completions_per_s"] = COMPLETIONS_PER_STEP / r["step_s"]
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
        results[framework] = r
        log(f"{framework}: {r['step_s']:.3f} s/step, {r['completions_per_s']:.1f} completions/s")
    if all("step_s" in results.get(f, {}) for f in FRAMEWORKS):
        results["speedup"] = results["trl"]["step_s"] / results["megarl"]["step_s"]
        log(f"round {index + 1}: speedup {results['speedup']:.2f}x")
    results["gemm_floor"] = gemm_floor(args, case)
    return results


def gemm_floor(args, case: dict) -> dict[str, float]:
    """The case's GEMM floor per phase (``step_gemms`` timed by ``gemm_seconds``), measured here on
    the sides' ``--threads`` CPUs right after a round. A bound is the fastest it was ever
    measured, so the report takes each phase's minimum over the rounds: one slow spell of the
    machine (15-20% within minutes here) would otherwise raise it."""
    import torch

    cpus, affinity, threads = sorted(os.sched_getaffinity(0))[:args.threads], os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    try:
        return {phase: gemm_seconds(gemms) for phase, gemms in
                step_gemms(case["config"], case["prompt_tokens"], case["length"]).items()}
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def summarize_case(case: dict, frameworks: list[str]) -> None:
    """``case["results"]``: per framework, the median over its successful rounds of every table
    column (peak memory: the largest); ``case["speedup"]``: the median of the rounds' ratios,
    with ``speedups`` (each round's) beside it."""
    case["results"] = {}
    for framework in frameworks:
        ok = [rnd[framework] for rnd in case["rounds"] if "step_s" in rnd.get(framework, {})]
        if not ok:
            case["results"][framework] = {"error": case["rounds"][-1][framework]["error"]}
            continue
        columns = ("step_s", "completions_per_s", "tokens_per_s", "generate_s", "update_s", "other_s")
        peak_round = max(ok, key=lambda r: r["peak_gb"])
        case["results"][framework] = dict({key: statistics.median(r[key] for r in ok) for key in columns},
                                          peak_gb=peak_round["peak_gb"], peak_processes=peak_round["peak_processes"],
                                          rounds=len(ok))
    floor = {phase: min(rnd["gemm_floor"][phase] for rnd in case["rounds"]) for phase in ("generate", "update")}
    case["gemm_floor"] = dict(floor, step=floor["generate"] + floor["update"])
    speedups = [rnd["speedup"] for rnd in case["rounds"] if "speedup" in rnd]
    if speedups:
        case["speedups"] = speedups
        case["speedup"] = statistics.median(speedups)


def table(cases: list[dict]) -> str:
    head = (f"{'case':<24} {'framework':<9} {'s/step':>8} {'compl/s':>8} {'tok/s':>8} {'gen s':>7} "
            f"{'update s':>8} {'other s':>7} {'x GEMM':>6} {'peak GB':>7} {'speedup (range)':>18}")
    lines = [head, "-" * len(head)]
    for case in cases:
        label = f"{case['preset']} L={case['length']}"
        for framework, r in case["results"].items():
            if "error" in r:
                lines.append(f"{label:<24} {framework:<9} failed: {r['error'].splitlines()[0]}")
            else:
                speedup = ""
                if framework == "megarl" and "speedup" in case:
                    low, high = min(case["speedups"]), max(case["speedups"])
                    speedup = f"{case['speedup']:.2f}x" + (f" ({low:.2f}-{high:.2f})" if len(case["speedups"]) > 1 else "")
                lines.append(
                    f"{label:<24} {framework:<9} {r['step_s']:>8.3f} {r['completions_per_s']:>8.1f} "
                    f"{r['tokens_per_s']:>8.0f} {r['generate_s']:>7.3f} {r['update_s']:>8.3f} {r['other_s']:>7.3f} "
                    f"{r['step_s'] / case['gemm_floor']['step']:>6.2f} {r['peak_gb']:>7.2f} {speedup:>18}")
            label = ""
        floor = case["gemm_floor"]
        lines.append(f"{'':<24} {'GEMM floor':<9} {floor['step']:>8.3f} {'':>8} {'':>8} {floor['generate']:>7.3f} "
                     f"{floor['update']:>8.3f}")
    return "\n".join(lines)


def memory_table(cases: list[dict]) -> str:
    """Each side's PSS at its peak sample, per kind of process (count, GB), largest first."""
    lines = []
    for case in cases:
        for framework, r in case["results"].items():
            if "peak_processes" not in r:
                continue
            lines.append(f"{case['preset']} L={case['length']} {framework}: peak {r['peak_gb']:.2f} GB =")
            ranked = sorted(r["peak_processes"].items(), key=lambda item: -sum(item[1]))
            for label, sizes in ranked:
                each = f" ({len(sizes)} x {sum(sizes) / len(sizes):.3f})" if len(sizes) > 1 else ""
                lines.append(f"  {sum(sizes):7.3f} GB  {label}{each}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma list of megarl, trl")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma list of model_specs presets")
    parser.add_argument("--lengths", default="8,16", help="comma list of fixed completion lengths")
    parser.add_argument("--threads", type=int, default=2, help="threads (and CPUs) of each side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each framework per case, alternating which goes first; the "
                             "speedup is the median of the rounds' ratios")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--micro-batch", type=int, default=COMPLETIONS_PER_STEP,
                        help=f"completions per forward/backward pass, both sides (divides {COMPLETIONS_PER_STEP})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per side and case")
    parser.add_argument("--megarl-override", action="append", default=[], metavar="KEY=VALUE",
                        help="extra `megarl train` override (repeatable)")
    parser.add_argument("--output", default="runs/bench_rl.json", help="JSON report")
    parser.add_argument("--workdir", default=None, help="parent of the temporary directory (models, logs)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep models, configs and logs")
    # Internal: the child sides.
    parser.add_argument("--side", choices=("prepare", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    args.frameworks = [f for f in args.frameworks.split(",") if f]
    args.presets = [p for p in args.presets.split(",") if p]
    problems = [f"--frameworks: unknown {f!r}; choose from {', '.join(FRAMEWORKS)}"
                for f in args.frameworks if f not in FRAMEWORKS]
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        problems.append(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.micro_batch < 1 or COMPLETIONS_PER_STEP % args.micro_batch:
        problems.append(f"--micro-batch must divide {COMPLETIONS_PER_STEP}, got {args.micro_batch}")
    if args.threads > len(os.sched_getaffinity(0)) or args.threads < 1:
        problems.append(f"--threads {args.threads}: this process may use {len(os.sched_getaffinity(0))} CPUs")
    if args.warmup < 0 or args.steps < 1 or args.rounds < 1:
        problems.append(f"need --warmup >= 0, --steps >= 1 and --rounds >= 1, got {args.warmup}, {args.steps}, "
                        f"{args.rounds}")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.side == "prepare":
        prepare_side(args)
        return 0
    if args.side == "trl":
        trl_side(args)
        return 0

    if "trl" in args.frameworks:
        bench_python()
    load_start = os.getloadavg()
    log(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {os.cpu_count()} CPUs; "
        f"{args.threads} threads per side")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench_rl_", dir=args.workdir))
    cases: list[dict] = []
    succeeded = False
    try:
        log(f"building models {', '.join(args.presets)} and prompts in {workdir}")
        num_prompts = PROMPTS_PER_STEP * (args.warmup + args.steps)
        try:
            prepared = run_side("prepare", [sys.executable, str(Path(__file__).resolve()), "--side", "prepare",
                                            "--presets", ",".join(args.presets), "--workdir", str(workdir),
                                            "--seed", str(args.seed), "--num-prompts", str(num_prompts)],
                                workdir / "prepare.log", args.threads, args.timeout)
        except SideFailed as error:
            raise SystemExit(f"bench_rl: building the models and prompts failed: {error}") from None
        for preset in args.presets:
            for length in args.lengths:
                case = {"preset": preset, "params": prepared["params"][preset], "length": length, "rounds": [],
                        "config": prepared["configs"][preset], "prompt_tokens": prepared["prompt_tokens"][preset]}
                for index in range(args.rounds):
                    case["rounds"].append(run_round(args, workdir, case, index))
                summarize_case(case, args.frameworks)
                cases.append(case)
        succeeded = not any("error" in r for c in cases for rnd in c["rounds"] for r in rnd.values()
                            if isinstance(r, dict))
    finally:
        if args.keep_workdir or not succeeded:  # a failed side's log stays readable
            log(f"kept {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)

    load_end = os.getloadavg()
    report = {
        "threads": args.threads, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
        "micro_batch": args.micro_batch,
        "completions_per_step": COMPLETIONS_PER_STEP, "cpus": os.cpu_count(),
        "loadavg_start": load_start, "loadavg_end": load_end,
        "main_env": {"torch": prepared["torch"], "transformers": prepared["transformers"]}, "cases": cases,
    }
    print()
    print(table(cases))
    print(f"speedup = TRL s/step / megarl s/step, the median over {args.rounds} round(s) (range: each round's); "
          f"columns: medians over rounds of per-step medians; x GEMM = s/step over the GEMM floor (the "
          f"step's matrix products alone at their shapes, MKL or oneDNN, the fastest of the rounds: a "
          f"physical bound); peak = process-tree PSS. "
          f"Load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end ({os.cpu_count()} CPUs).")
    print()
    print("Memory at each side's peak (PSS: a page shared by k processes counts 1/k in each):")
    print(memory_table(cases))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {output}")
    return 0 if succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
