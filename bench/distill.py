"""On-policy distillation through ``pgs run`` beside TRL's GKDTrainer, in one call (issue 22's bench).

A Qwen3-0.6B-shaped student learns from a frozen Qwen3-4B-shaped teacher (both random inits of
the architectures, bf16, vocabulary 151,936), every step on-policy (GKD's λ = 1, arXiv
2306.13649): the student samples a completion for each of the step's prompts, the teacher
grades every sampled token with its whole next-token distribution, and the student takes one
optimizer step on the divergence (JSD(β) by default).  Each setup runs in its own child process
(an empty device each time) under its own timeout within ``--budget`` seconds; the JSON is
rewritten after each, so a call cut short keeps what it measured:

1. ``pgs``: ``pgs run specs/distill_qwen3_0.6b_from_4b.toml`` (the product path: spec -> data
   pipeline -> ``[distill]`` objective -> loop; gradient release, compiled layers, static KV
   cache with a compiled decode step, the chunked divergence that never builds the [N, V]
   logits), figures from the run's own metrics.jsonl (bench/product.py's ``run_pgs``).
2. ``trl``: TRL's ``GKDTrainer`` (``lmbda=1.0``) on the same model configs and the same chats:
   HF ``generate`` with its dynamic KV cache, full-logit JSD, fused torch AdamW, bf16 weights.
3. ``trl_gc`` (optional): the same with gradient checkpointing (TRL then generates without a
   KV cache: ``use_cache=False`` while checkpointing is on).

What is held equal: the chats (a user prompt of ``--prompt-tokens`` tokens with the chat
template, written here, and the same file for both), ``--prompts`` prompts per step (one
optimizer step each, no accumulation; ``--trl-prompts N`` gives TRL's setups N instead, where
TRL does not fit the same batch: each row says its prompts per step), ``--max-new-tokens``, sampling (temperature 1, top-p 1,
no top-k), the stop rule (the tokenizer's eos, ``<|im_end|>``, which is also pgs's end-of-turn
id; the stop token is part of the completion in both), the divergence (pgs ``kind="jsd"``,
``beta`` = TRL's ``beta``; ``forward_kl`` = TRL β = 0, ``reverse_kl`` = β = 1), the divergence's
temperature (1: TRL applies its ``temperature`` to sampling only), AdamW without weight decay or
clipping at a constant learning rate, bf16 weights without master copies (pgs: stochastic
rounding; TRL: plain bf16 AdamW), the same models by config.  What differs and cannot be
removed: pgs left-pads the prompts to a multiple of 64 for its static cache and trains each
prompt + completion as its own row (``data.packing=false``), TRL pads each batch to its longest
prompt and longest completion and computes every padded position; each system draws the prompts
in its own order (all prompts have the same length, so the work per step is the same); the
random inits differ (the same architectures, different generators).  With random weights a
completion almost never reaches the eos (1 in 151,936 per token), so both generate nearly
``--prompts`` × ``--max-new-tokens`` tokens per step; the counts are measured, not assumed.
TRL 1.16 itself points λ = 1, τ = 1 runs to its newer ``DistillationTrainer`` (a chunked loss,
vLLM generation); this bench measures ``GKDTrainer``, the trainer issue 22 names, with HF
generation.

Figures per setup over the steps after the first ``--skip`` (warm-up: compilation):
``generated`` tokens (sampled completion tokens, stop token included), ``trained`` tokens
(prompt + completion tokens through the student's training forward and backward, padding not
counted), ``gen_tok_s`` (generated tokens over the generation time), ``train_tok_s`` (trained
tokens over the rest of the step), ``e2e_tok_s`` (generated + trained tokens over the steps'
wall time), ``prompts_per_s``, ``gen_share`` (the share of the step spent generating), seconds
per step, peak allocated / reserved GiB (pgs: the run's own counters, metrics.jsonl; TRL:
``torch.cuda.max_memory_*`` over training, both with the teacher resident).  pgs's generation
time is its metrics' ``generated_tokens / gen_tokens_per_s``; TRL's is the wall time of its
``generate_on_policy_outputs`` (synchronized before and after).  pgs's step clock does not wait
for the device at the end of a step (its launches run ahead); the next step's generation does,
so the timed steps' total is the device's time, and pgs's generation time may hold the tail of
the previous step's backward (a bias against pgs's ``gen_tok_s``, for its ``train_tok_s``).

    python -m bench distill --steps 8 --budget 520
    python -m bench distill --steps 8 --budget 520 --trl-prompts 4   # TRL at the batch it fits on an H200
    python -m bench distill --steps 8 --only pgs,trl,trl_gc --prompts 32
    BUDGET=560 bash bench/device.sh "distill --steps 8 --budget 520"   # on the device (.whl with TRL's wheels)

``--profile A:B`` passes ``pgs run --profile A:B`` to the pgs setup and copies its ``ops.txt``
(and, on CUDA, ``streams.txt``) beside the JSON (``<stem>-ops.txt``); the traced steps run under
the profiler, so that call's figures are not the speed.

``--small`` runs the same path at a tiny shape on the CPU (a smoke run of this script; TRL too
when it imports).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.product import SMALL, check_profile, keep_profile, markdown_table, read_metrics, run_pgs  # noqa: E402 - the product path, measured one way everywhere

SPEC = "specs/distill_qwen3_0.6b_from_4b.toml"
#: The teacher at the smoke shape (SMALL shrinks the student; the vocabulary must stay shared).
SMALL_TEACHER = ["distill.teacher_config.hidden_size=96", "distill.teacher_config.intermediate_size=192",
                 "distill.teacher_config.num_hidden_layers=2", "distill.teacher_config.num_attention_heads=4",
                 "distill.teacher_config.num_key_value_heads=2", "distill.teacher_config.head_dim=16",
                 "distill.teacher_config.vocab_size=512", 'distill.teacher_dtype="float32"']
#: The smoke shape: product's, but the spec's constant schedule reads no warmup.
SMALL_SETS = [x for x in SMALL if not x.startswith("schedule.")] + SMALL_TEACHER
#: TRL's β for pgs's divergences (TRL: β = 0 is KL(T‖S), β = 1 is KL(S‖T), else JSD(β)).
TRL_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}
TRL_MISSING = "trl is not installed: copy /work/trlwhl/*.whl (trl, datasets, dill, multiprocess) into .whl before the call"


def make_chats(path: str, n: int, tokenizer, prompt_tokens: int, answer_tokens: int, seed: int = 0) -> list[int]:
    """``n`` chats ``{"messages": [user, assistant]}`` in JSONL: sums to work out whose prompt,
    rendered with the chat template and the assistant header, has ``prompt_tokens`` tokens
    (filled up with full stops; fewer only where the tokenizer merges them), so that the rows
    of every step have one width (a compiled layer then sees one shape); an answer of about
    ``answer_tokens`` tokens.  Returns the prompts' lengths."""
    rng = random.Random(seed)

    def prompt_length(text: str) -> int:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def pair() -> tuple[int, int]:
        return rng.randrange(100, 10000), rng.randrange(100, 10000)

    lengths = []
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(n):
            text = "Work out every sum, one per line, in the order given.\n"
            sums = []
            while True:
                a, b = pair()
                longer = text + f"{a} + {b}\n"
                if prompt_length(longer) > prompt_tokens:
                    break
                text = longer
                sums.append(a + b)
            for _ in range(32):  # full stops up to the length: one row width for every step
                if prompt_length(text + ".") > prompt_tokens:
                    break
                text += "."
            lengths.append(prompt_length(text))
            answer = []
            while len(tokenizer("\n".join(answer), add_special_tokens=False)["input_ids"]) < answer_tokens:
                answer.append(str(sums[len(answer) % len(sums)]))
            handle.write(json.dumps({"messages": [{"role": "user", "content": text},
                                                  {"role": "assistant", "content": "\n".join(answer)}]}) + "\n")
    return lengths


def distill_sets(args, chats: str) -> list[str]:
    """The ``--set`` overrides that point the spec at the bench's chats and settings (the smoke
    shape first with ``--small``; the run folder and step count are ``run_pgs``'s)."""
    sets = [f'data.sources=["{chats}"]', 'data.eval=""', "data.packing=false", f"data.max_seq_len={args.max_seq_len}",
            f"train.batch_size={args.prompts}", "train.grad_accum=1", "distill.on_policy=1.0",
            f'distill.kind="{args.kind}"', f"distill.generation.max_new_tokens={args.max_new_tokens}",
            "distill.temperature=1.0", "distill.generation.temperature=1.0", "distill.generation.top_p=1.0",
            f"checkpoint.every={args.steps}"]  # one save, after the last step (outside the timed steps)
    if args.kind == "jsd":
        sets.append(f"distill.beta={args.beta}")
    return (SMALL_SETS if args.small else []) + sets + args.set


def figures(steps: list[dict], skip: int, prompts: int) -> dict:
    """The module docstring's figures of per-step ``{"step_s", "gen_s", "generated", "trained",
    "loss_tokens"}`` records (the first ``skip`` left out)."""
    timed = steps[skip:]
    if not timed:
        return {"error": f"only {len(steps)} steps (none after the {skip} warm-up steps)"}
    wall = sum(s["step_s"] for s in timed)
    gen_s = sum(s["gen_s"] for s in timed)
    generated = sum(s["generated"] for s in timed)
    trained = sum(s["trained"] for s in timed)
    return {"steps": len(steps), "timed_steps": len(timed),
            "generated_per_step": generated / len(timed), "trained_per_step": trained / len(timed),
            "loss_tokens_per_step": sum(s["loss_tokens"] for s in timed) / len(timed),
            "gen_tok_s": generated / gen_s if gen_s > 0 else None,
            "train_tok_s": trained / (wall - gen_s) if wall > gen_s else None,
            "e2e_tok_s": (generated + trained) / wall if wall > 0 else None,
            "prompts_per_s": prompts * len(timed) / wall if wall > 0 else None,
            "gen_share": gen_s / wall if wall > 0 else None,
            "mean_step_s": wall / len(timed), "median_step_s": statistics.median(s["step_s"] for s in timed),
            "step_s": [round(s["step_s"], 3) for s in timed], "gen_s": [round(s["gen_s"], 3) for s in timed],
            "first_steps_s": [round(s["step_s"], 3) for s in steps[:skip]]}


def pgs_steps(records: list[dict]) -> list[dict]:
    """metrics.jsonl's step records in ``figures``'s terms (generation time from the metrics)."""
    out = []
    for r in records:
        if "loss" not in r or "tokens" not in r:
            continue
        gen, rate = r.get("generated_tokens", 0), r.get("gen_tokens_per_s", 0.0)
        out.append({"step_s": r["step_seconds"], "gen_s": gen / rate if rate else 0.0, "generated": gen,
                    "trained": r["tokens"], "loss_tokens": r.get("valid_tokens", 0)})
    return out


def run_pgs_setup(args, chats: str, workdir: str, timeout: float) -> dict:
    pgs_args = argparse.Namespace(steps=args.steps, skip=args.skip, small=False, set=distill_sets(args, chats),
                                  profile=args.profile, nvidia_smi=not args.small, timeout=timeout)
    r = run_pgs(args.spec, pgs_args, os.path.join(workdir, "pgs"))
    out = {"setup": "pgs run + [distill]", "prompts": args.prompts, "command": r.get("command"),
           "returncode": r.get("returncode"),
           "launch_to_step1_s": r.get("launch_to_step1_s"), "timed_out": r.get("timed_out")}
    run_dir = os.path.join(workdir, "pgs", "run")
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        out["error"] = r.get("error") or "the run wrote no metrics.jsonl"
        return out
    records = read_metrics(run_dir)  # the steps it logged count, also when it was killed by its timeout
    out.update(figures(pgs_steps(records), args.skip, args.prompts))
    if r.get("returncode") != 0 and not r.get("timed_out"):  # it failed after logging steps: say so beside them
        out["error"] = r.get("error") or f"exit {r.get('returncode')}"
    peaks = [r for r in records if "mem_gib" in r]
    if peaks:
        out["max_allocated_gib"] = max(p["mem_gib"] for p in peaks)
        out["max_reserved_gib"] = max(p["reserved_gib"] for p in peaks)
    for key in ("nvidia_smi_max_gib", "last_loss", "stderr_tail"):
        if r.get(key) is not None:
            out[key] = r[key]
    if args.profile:  # the trace's summaries beside the JSON (or in the workdir)
        stem = os.path.splitext(args.out)[0] if args.out else os.path.join(workdir, "distill")
        keep_profile(out, run_dir, stem, args.profile)
    return out


def trl_child(args) -> dict:
    """TRL's GKDTrainer on the spec's two model configs and the bench's chats (a child process)."""
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(args.spec, distill_sets(args, args.chats))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    tokenizer = load_tokenizer(spec.model.tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def build(table: dict, dtype: str, seed: int):
        table = dict(table)
        config = AutoConfig.for_model(table.pop("model_type"), **table)
        # the stop rule pgs uses (the eos, which is the template's end of turn here) and its pad
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model

    started = time.perf_counter()
    student = build(spec.model.config, spec.model.dtype, spec.model.init_seed)
    teacher = build(spec.distill.teacher_config, spec.distill.teacher_dtype, spec.distill.teacher_init_seed)
    teacher.requires_grad_(False)
    init_s = time.perf_counter() - started
    data = datasets.load_dataset("json", data_files=args.chats, split="train")
    variant = args.trl_child
    marks: list[float] = []
    gens: list[dict] = []
    original = GKDTrainer.generate_on_policy_outputs

    def timed_generation(model, inputs, generation_config):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids, mask, labels = original(model, inputs, generation_config)
        if cuda:
            torch.cuda.synchronize()
        width = inputs["prompts"].shape[1]
        gens.append({"gen_s": time.perf_counter() - t0, "generated": int(mask[:, width:].sum()),
                     "trained": int(mask.sum()), "loss_tokens": int((labels[:, 1:] != -100).sum()),
                     "positions": int(mask.numel())})
        return ids, mask, labels

    GKDTrainer.generate_on_policy_outputs = staticmethod(timed_generation)

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        config = GKDConfig(
            output_dir=tmp, per_device_train_batch_size=args.prompts, gradient_accumulation_steps=1,
            max_steps=args.steps, learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=0.0, lmbda=1.0, beta=TRL_BETA.get(args.kind, args.beta), temperature=1.0,
            max_new_tokens=args.max_new_tokens, max_length=args.max_seq_len, bf16=cuda,
            gradient_checkpointing=variant == "trl_gc", optim="adamw_torch_fused" if cuda else "adamw_torch",
            logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=0)
        trainer = GKDTrainer(model=student, teacher_model=teacher, args=config, train_dataset=data,
                             processing_class=tokenizer, callbacks=[Clock()])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.train()
    periods = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    steps = [{"step_s": p, **g} for p, g in zip(periods, gens)]
    out = {"setup": f"TRL GKDTrainer ({variant})", "init_s": init_s, **figures(steps, args.skip, args.prompts),
           "padded_positions_per_step": sum(g["positions"] for g in gens[args.skip:]) / max(len(gens) - args.skip, 1),
           "last_loss": next((r["loss"] for r in reversed(trainer.state.log_history) if "loss" in r), None)}
    if cuda:
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def run_trl(args, variant: str, chats: str, timeout: float) -> dict:
    prompts = args.trl_prompts or args.prompts
    out = _run_trl(args, variant, chats, timeout, prompts)
    return {"setup": out.pop("setup"), "prompts": prompts, **out}


def _run_trl(args, variant: str, chats: str, timeout: float, prompts: int) -> dict:
    setup = f"TRL GKDTrainer ({variant})"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trl.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--trl-child", variant, "--trl-out", path, "--chats", chats,
               "--spec", args.spec, "--steps", str(args.steps), "--skip", str(args.skip),
               "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens),
               "--max-seq-len", str(args.max_seq_len), "--kind", args.kind, "--beta", str(args.beta)]
        cmd += (["--small"] if args.small else []) + [x for s in args.set for x in ("--set", s)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"setup": setup, "error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not os.path.exists(path):
            return {"setup": setup, "error": (proc.stderr or proc.stdout)[-3000:]}
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)


def ratios(results: list[dict]) -> dict:
    """pgs over each TRL setup: end-to-end tokens/s, prompts/s, generation tokens/s, reserved memory."""
    pgs = next((r for r in results if r["setup"].startswith("pgs")), {})
    out = {}
    for r in results:
        if not r["setup"].startswith("TRL") or r.get("error") or pgs.get("error"):
            continue
        for key in ("e2e_tok_s", "prompts_per_s", "gen_tok_s", "train_tok_s"):
            if r.get(key) and pgs.get(key):
                out[f"pgs_over_{r['setup']}_{key}"] = pgs[key] / r[key]
        if r.get("max_reserved_gib") and pgs.get("max_reserved_gib"):
            out[f"pgs_over_{r['setup']}_reserved"] = pgs["max_reserved_gib"] / r["max_reserved_gib"]
    return out


COLUMNS = [("prompts/step", "prompts", "d"), ("e2e tok/s", "e2e_tok_s", ",.0f"), ("gen tok/s", "gen_tok_s", ",.0f"), ("train tok/s", "train_tok_s", ",.0f"),
           ("prompts/s", "prompts_per_s", ".2f"), ("gen share", "gen_share", ".2f"), ("s/step", "mean_step_s", ".2f"),
           ("generated/step", "generated_per_step", ",.0f"), ("trained/step", "trained_per_step", ",.0f"),
           ("max alloc GiB", "max_allocated_gib", ".2f"), ("max reserved GiB", "max_reserved_gib", ".2f")]


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default=SPEC)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the figures")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (one optimizer step)")
    p.add_argument("--prompt-tokens", type=int, default=500, help="templated prompt length")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=0, help="default: prompt + completion, rounded up to 256")
    p.add_argument("--kind", default="jsd", choices=("jsd", "forward_kl", "reverse_kl"))
    p.add_argument("--beta", type=float, default=0.5, help="JSD's β (kind jsd)")
    p.add_argument("--only", default="pgs,trl", help="comma list of pgs, trl, trl_gc (run in this order)")
    p.add_argument("--trl-prompts", type=int, default=0, metavar="N",
                   help="prompts per step for the TRL setups (default: --prompts; TRL 1.16 at 16 prompts of "
                        "~500 tokens does not fit an H200: 4 does)")
    p.add_argument("--budget", type=float, default=520, help="seconds for all setups together")
    p.add_argument("--timeout", type=float, default=300, help="seconds for one setup at most")
    p.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a smoke run of this script)")
    p.add_argument("--set", action="append", default=[], help="more spec overrides (both systems read the spec)")
    p.add_argument("--profile", default="", metavar="A:B",
                   help="pgs run --profile A:B; its ops.txt and streams.txt go beside the JSON (the traced steps are "
                        "not the speed)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    # the TRL child's own arguments
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trl-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--chats", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    started = time.time()
    if args.small:
        args.steps, args.skip = min(args.steps, 3), min(args.skip, 1)
        args.prompts, args.prompt_tokens, args.max_new_tokens = min(args.prompts, 4), min(args.prompt_tokens, 96), \
            min(args.max_new_tokens, 12)
        args.trl_prompts = min(args.trl_prompts, args.prompts)
    if args.trl_prompts < 0:
        p.error(f"--trl-prompts: {args.trl_prompts} is not a number of prompts (0: as --prompts)")
    check_profile(p, args.profile, args.steps)
    if not args.max_seq_len:
        args.max_seq_len = -(-(args.prompt_tokens + args.max_new_tokens + 8) // 256) * 256
    if args.trl_child:
        result = trl_child(args)
        with open(args.trl_out, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
        return 0

    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    workdir = args.workdir or tempfile.mkdtemp(prefix="pgs-bench-distill-")
    os.makedirs(workdir, exist_ok=True)
    from pgs.errors import SpecError

    try:
        spec = load_spec(args.spec, distill_sets(args, "pgs:bench/chats.jsonl"))
    except SpecError as err:  # the spec or a --set: one line, as pgs run would say it
        print(f"[distill] {args.spec}: {err}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(spec.model.tokenizer)
    chats = os.path.join(workdir, "chats.jsonl")
    lengths = make_chats(chats, args.prompts * (args.steps + 2), tokenizer, args.prompt_tokens,
                         min(args.max_new_tokens, args.max_seq_len - args.prompt_tokens - 16))
    results: list[dict] = []
    versions = {name: _version(name) for name in ("torch", "transformers", "trl")}

    def save():  # after every setup: a call cut short keeps what it measured
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as handle:
                json.dump({"spec": args.spec, "versions": versions, "steps": args.steps, "skip": args.skip, "prompts_per_step": args.prompts,
                           "prompt_tokens": [min(lengths), max(lengths)], "max_new_tokens": args.max_new_tokens,
                           "kind": args.kind, "beta": args.beta if args.kind == "jsd" else None,
                           "results": results, "ratios": ratios(results)}, handle, indent=1)

    save()  # the settings, before anything is measured
    for setup in args.only.split(","):
        left = args.budget - (time.time() - started)
        if left < 30:
            results.append({"setup": setup, "error": f"skipped: {left:.0f} s of the budget left"})
            save()
            continue
        timeout = min(args.timeout, left - 5)
        if setup == "pgs":
            results.append(run_pgs_setup(args, chats, workdir, timeout))
        elif setup in ("trl", "trl_gc"):
            if importlib.util.find_spec("trl") is None:
                print(f"[distill] {TRL_MISSING}", file=sys.stderr, flush=True)
                results.append({"setup": f"TRL GKDTrainer ({setup})", "error": TRL_MISSING})
            else:
                results.append(run_trl(args, setup, chats, timeout))
        else:
            results.append({"setup": setup, "error": f"unknown setup {setup!r} (pgs, trl, trl_gc)"})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("stderr_tail", "step_s", "gen_s")}),
              flush=True)
        save()
    print(markdown_table(results, COLUMNS))
    print(json.dumps(ratios(results), indent=1))
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
