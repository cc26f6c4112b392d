"""DPO through the product path beside TRL's DPOTrainer, in one call (issue 21's bench).

For one shipped SFT recipe (``--spec``: the 0.6B packed spec or the 4B 12 GiB recipe) this runs,
one after the other, in child processes (so that each starts with an empty device):

1. ``pgs run SPEC`` with a ``[preference]`` section (DPO, β 0.1, the reference precomputed and
   cached before step 1) on synthetic pairs written here, every other setting the recipe's:
   figures from the run's own metrics.jsonl (bench/product.py's ``run_pgs``).
2. ``pgs run SPEC`` as shipped (SFT on its chats), the same number of steps: the tokens/s that
   DPO is held to per trained token.
3. TRL's DPOTrainer (``--trl-variants``: ``trl`` plain, ``trl_gc`` with gradient
   checkpointing, ``trl_liger`` with Liger's model kernels too) on the same model config and
   the same pairs, ``precompute_ref_log_probs=True`` (the reference is not kept in memory),
   fused torch AdamW, bf16, the same pairs per step.  TRL pads each batch to its longest arm
   (its padding-free DPO is disabled in TRL 1.x), pgs packs the two arms of each pair as
   isolated documents of one row.

Pairs: a user prompt of ``--prompt-tokens`` tokens (sums to work out) and two answers of
``--answer-tokens`` tokens each (the right sums, and the same lines with wrong ones), so that
one pair (both arms with their prompt) fills half of a 4096-token row: pgs's rows of the recipe
hold two pairs, and TRL's ``max_length`` (prompt + one answer) is 1024.

pairs/s for pgs is the step's tokens/s over the mean tokens per pair of the data (every row
holds whole pairs); for TRL the pairs per step over the step period.  Peak memory: the run's
own max allocated / reserved (pgs metrics.jsonl; TRL ``torch.cuda.max_memory_*`` over
training, after the reference pass).  Reference pass time is reported separately for both.

    python -m bench preference --spec specs/qwen3_0.6b_packed.toml --steps 30
    python -m bench preference --spec specs/qwen3_4b_12gib.toml --steps 20 --trl-variants trl_gc

``--small`` runs the same path at a tiny shape on the CPU (TRL skipped unless installed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.product import SMALL, markdown_table, run_pgs  # noqa: E402 - the product path, measured one way everywhere

SMALL_PAIRS = ["data.max_seq_len=1024"]


def _line(rng: random.Random, right: bool) -> tuple[str, str]:
    a, b = rng.randrange(100, 10000), rng.randrange(100, 10000)
    total = a + b if right else a + b + rng.choice([-1, 1]) * rng.randrange(10, 1000)
    return f"{a} + {b}", f"{a} + {b} = {total}"


def make_pairs(path: str, n: int, tokenizer, prompt_tokens: int, answer_tokens: int, seed: int = 0) -> None:
    """``n`` pairs ``{"prompt": [user], "chosen": [assistant], "rejected": [assistant]}`` in JSONL:
    a prompt of about ``prompt_tokens`` tokens and answers of about ``answer_tokens`` each."""
    rng = random.Random(seed)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(n):
            task = "Work out every sum, one per line, in the order given.\n"
            while count(task) < prompt_tokens:
                task += "Remember: " + " and ".join(_line(rng, True)[0] for _ in range(4)) + " are for later.\n"
            chosen, rejected = [], []
            while count("\n".join(chosen)) < answer_tokens:
                question, good = _line(rng, True)
                a, b = (int(x) for x in question.split(" + "))
                chosen.append(good)
                rejected.append(f"{question} = {a + b + rng.choice([-1, 1]) * rng.randrange(10, 1000)}")
            record = {"prompt": [{"role": "user", "content": task}],
                      "chosen": [{"role": "assistant", "content": "\n".join(chosen)}],
                      "rejected": [{"role": "assistant", "content": "\n".join(rejected)}]}
            handle.write(json.dumps(record) + "\n")


def pair_stats(spec_path: str, sets: list[str], pairs_path: str, tokenizer) -> dict:
    """Tokens per pair (both arms, prompt included) and trained tokens per pair, as pgs reads them."""
    from pgs.runtime.data.preference import read_pairs
    from pgs.runtime.spec.load import load_spec

    pairs = read_pairs([pairs_path], tokenizer, load_spec(spec_path, sets).data)
    tokens = [len(p) for p in pairs]
    trained = [p.chosen.num_trained + p.rejected.num_trained for p in pairs]
    return {"pairs": len(pairs), "tokens_per_pair": sum(tokens) / len(tokens), "max_pair_tokens": max(tokens),
            "trained_per_pair": sum(trained) / len(trained),
            "longest_arm": max(max(len(p.chosen), len(p.rejected)) for p in pairs)}


def dpo_sets(pairs_path: str) -> list[str]:
    return [f'data.sources=["{pairs_path}"]', 'data.eval=""', "preference.kind=\"dpo\"", "preference.beta=0.1",
            "preference.reference=\"cached\"", 'checkpoint.best_metric=""']


def trl_child(args) -> dict:
    """TRL's DPOTrainer on the spec's model config and the pairs (run in a child process)."""
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    spec = load_spec(args.spec, (SMALL if args.small else []))
    table = {k: v for k, v in dict(spec.model.config).items() if k != "model_type"}
    config = AutoConfig.for_model(spec.model.config["model_type"], **table)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    tokenizer = load_tokenizer(spec.model.tokenizer)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = datasets.load_dataset("json", data_files=args.pairs, split="train")
    variant = args.trl_child
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        config = DPOConfig(
            output_dir=tmp, per_device_train_batch_size=args.pairs_per_step, max_steps=args.steps,
            learning_rate=1e-6, lr_scheduler_type="constant", beta=0.1, loss_type=["sigmoid"],
            bf16=device.type == "cuda", gradient_checkpointing=variant in ("trl_gc", "trl_liger"),
            use_liger_kernel=variant == "trl_liger", precompute_ref_log_probs=True,
            precompute_ref_batch_size=args.pairs_per_step, max_length=args.trl_max_length,
            optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch", logging_steps=1,
            report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=0)
        started = time.perf_counter()
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                             callbacks=[Clock()])
        reference_s = time.perf_counter() - started
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.train()
    periods = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    timed = periods[args.skip:]
    out = {"setup": f"TRL DPOTrainer ({variant})", "reference_s": reference_s, "steps": len(periods),
           "pairs_per_s": args.pairs_per_step * len(timed) / sum(timed) if timed else None,
           "median_step_s": sorted(timed)[len(timed) // 2] if timed else None,
           "step_s": [round(t, 3) for t in timed],
           "last_loss": next((r["loss"] for r in reversed(trainer.state.log_history) if "loss" in r), None)}
    if device.type == "cuda":
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def run_trl(args, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trl.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--trl-child", variant, "--trl-out", path,
               "--spec", args.spec, "--pairs", args.pairs, "--pairs-per-step", str(args.pairs_per_step),
               "--steps", str(args.steps), "--skip", str(args.skip), "--trl-max-length", str(args.trl_max_length)]
        cmd += ["--small"] if args.small else []
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.trl_timeout)
        except subprocess.TimeoutExpired:
            return {"setup": f"TRL DPOTrainer ({variant})", "error": f"timed out after {args.trl_timeout} s"}
        if proc.returncode != 0 or not os.path.exists(path):
            return {"setup": f"TRL DPOTrainer ({variant})", "error": (proc.stderr or proc.stdout)[-3000:]}
        return json.load(open(path))


#: The table's columns: (header, result key, format).
COLUMNS = [("pairs/s", "pairs_per_s", ",.2f"), ("tok/s", "mean_tok_s", ",.0f"), ("median step s", "median_step_s", ".3f"),
           ("max alloc GiB", "max_allocated_gib", ".3f"), ("max reserved GiB", "max_reserved_gib", ".3f"),
           ("reference s", "reference_s", ".1f")]


def table(rows: list[dict]) -> str:
    return markdown_table(rows, COLUMNS)


def ratios(results: list[dict]) -> dict:
    """pgs DPO against pgs SFT (tokens/s) and against each TRL variant (pairs/s, reserved memory)."""
    dpo = next((r for r in results if r["setup"].startswith("pgs run + [preference]")), {})
    sft = next((r for r in results if r["setup"].startswith("pgs run (SFT")), {})
    out = {}
    if dpo.get("mean_tok_s") and sft.get("mean_tok_s"):
        out["dpo_over_sft_tok_s"] = dpo["mean_tok_s"] / sft["mean_tok_s"]
    for r in results:
        if r["setup"].startswith("TRL") and r.get("pairs_per_s") and dpo.get("pairs_per_s"):
            out[f"pgs_over_{r['setup']}_pairs_s"] = dpo["pairs_per_s"] / r["pairs_per_s"]
            if r.get("max_reserved_gib") and dpo.get("max_reserved_gib"):
                out[f"pgs_over_{r['setup']}_reserved"] = dpo["max_reserved_gib"] / r["max_reserved_gib"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="specs/qwen3_0.6b_packed.toml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the means (warm-up)")
    p.add_argument("--prompt-tokens", type=int, default=480)
    p.add_argument("--answer-tokens", type=int, default=480)
    p.add_argument("--only", default="pgs,sft,trl", help="comma list of pgs, sft, trl")
    p.add_argument("--trl-variants", default="trl,trl_gc")
    p.add_argument("--trl-timeout", type=int, default=300)
    p.add_argument("--small", action="store_true")
    p.add_argument("--set", action="append", default=[], help="more spec overrides for the pgs runs")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    # the TRL child's own arguments
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trl-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pairs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pairs-per-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--trl-max-length", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_child:
        result = trl_child(args)
        with open(args.trl_out, "w") as handle:
            json.dump(result, handle)
        return 0

    from pgs.runtime.model.loading import load_tokenizer
    from pgs.runtime.spec.load import load_spec

    workdir = args.workdir or tempfile.mkdtemp(prefix="pgs-bench-pref-")
    os.makedirs(workdir, exist_ok=True)
    base_sets = (SMALL + SMALL_PAIRS if args.small else []) + args.set
    spec = load_spec(args.spec, base_sets)
    tokenizer = load_tokenizer(spec.model.tokenizer)
    if args.small:
        args.prompt_tokens, args.answer_tokens = min(args.prompt_tokens, 120), min(args.answer_tokens, 120)
    capacity = spec.data.max_seq_len
    rows = spec.train.batch_size * spec.train.grad_accum
    # one pair (two arms, each with the prompt) in half a row: two pairs a row, as TRL's 1024 per arm
    pairs_per_row = max(1, capacity // (2 * (args.prompt_tokens + args.answer_tokens + 40)))
    args.pairs_per_step = rows * pairs_per_row
    args.pairs = os.path.join(workdir, "pairs.jsonl")
    sets = base_sets + dpo_sets(args.pairs)
    fit = capacity // pairs_per_row  # a pair's share of a row: its two arms must fit in it
    prompt, answer = args.prompt_tokens, args.answer_tokens
    for _ in range(4):  # the chat template's tokens come on top of the text's: shrink until pairs fit
        make_pairs(args.pairs, args.pairs_per_step * (args.steps + 2), tokenizer, prompt, answer)
        stats = pair_stats(args.spec, sets, args.pairs, tokenizer)
        if stats["max_pair_tokens"] <= fit:
            break
        scale = 0.98 * fit / stats["max_pair_tokens"]
        prompt, answer = int(prompt * scale), int(answer * scale)
    else:
        raise SystemExit(f"pairs of {stats['max_pair_tokens']} tokens do not fit {pairs_per_row} to a row of {capacity}")
    args.trl_max_length = fit // 2
    results: list[dict] = []
    only = set(args.only.split(","))
    pgs_args = argparse.Namespace(steps=args.steps, skip=args.skip, small=False, set=sets, profile=None,
                                  nvidia_smi=False)

    def save():  # after every setup: a call cut short keeps what it measured
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"spec": args.spec, "steps": args.steps, "skip": args.skip,
                           "pairs_per_step": args.pairs_per_step, "pair_stats": stats,
                           "trl_max_length": args.trl_max_length, "results": results, "ratios": ratios(results)},
                          handle, indent=1)

    if "pgs" in only:
        r = run_pgs(args.spec, pgs_args, os.path.join(workdir, "dpo"))
        r["setup"] = "pgs run + [preference] dpo (cached reference)"
        if r.get("mean_tok_s"):
            r["pairs_per_s"] = r["mean_tok_s"] / stats["tokens_per_pair"]
        r["reference_s"] = r.get("launch_to_step1_s")
        results.append(r)
        save()
    if "sft" in only:
        sft_args = argparse.Namespace(**{**vars(pgs_args), "set": base_sets})
        r = run_pgs(args.spec, sft_args, os.path.join(workdir, "sft"))
        r["setup"] = "pgs run (SFT, the recipe as shipped)"
        results.append(r)
        save()
    if "trl" in only:
        for variant in args.trl_variants.split(","):
            results.append(run_trl(args, variant))
            save()
    print(table(results))
    print(json.dumps(ratios(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
