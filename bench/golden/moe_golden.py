"""The JSON side of make-moe-golden.sh (Python standard library only).

  moe_golden.py prompts OUT.txt
      the prompts as kquant_golden's input lines (`ID TOKEN TOKEN ...`): seeded random token
      ids of 4 lengths, the longest past one 512-token llama_decode batch
  moe_golden.py assemble OUT.json PROMPTS.txt MODELS_JSON RUN.jsonl FLASH_RUN.jsonl [RUN FLASH ...]
      writes the golden file: per model (MODELS_JSON, a list of {file, shape, type, sha256,
      size_bytes, command}) its run's top-5 logits, greedy tokens and margins, and how far
      llama.cpp's flash-attention path moves them (flash_attn_spread)
"""

import json
import random
import sys

from kquant_golden import flash_attn_spread, load_run

# Token ids are drawn from 3.. (past <unk>, <s>, </s>) below the tiny shapes' vocabulary.
VOCAB = 512
LENGTHS = {"short": 16, "medium": 40, "long": 200, "two_batches": 600}
SEED = 7


def prompts(out):
    rng = random.Random(SEED)
    with open(out, "w", encoding="utf-8") as f:
        for name, n in LENGTHS.items():
            ids = [1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)]
            f.write(name + " " + " ".join(map(str, ids)) + "\n")


def assemble(out, prompts_path, models, runs):
    entries, system_info = [], None
    prompt_ids = {}
    for line in open(prompts_path, encoding="utf-8"):
        key, *ids = line.split()
        prompt_ids[key] = [int(t) for t in ids]
    for model, (run_path, flash_path) in zip(models, runs):
        run, system_info = load_run(run_path)
        spread = flash_attn_spread(run, load_run(flash_path)[0])
        model["flash_attn_spread"] = spread
        model["prompts"] = [
            {
                "id": key,
                "prompt_token_ids": prompt_ids[key],
                "generated_token_ids": r["generated"],
                "greedy_top1_top2_margin": [round(m, 5) for m in r["margins"]],
                "top5_last_prompt_position": [
                    {"id": tok, "logit": logit} for tok, logit, _ in r["top5"]
                ],
            }
            for key, r in run.items()
        ]
        entries.append(model)
    doc = {
        "schema_version": 1,
        "description": (
            "Reference outputs of llama.cpp (commit 0c1e570, built from llama-cpp-python 0.3.36 "
            "by bench/llamacpp.sh, CPU, 2 threads, flash attention off, f16 KV cache) for the "
            "mixture-of-experts random-weight models `engram gen-model` writes (their sha256 "
            "below: the test regenerates each file and checks it is the one llama.cpp ran). "
            "Prompts are token ids (the shapes' vocabulary spells nothing); each model's "
            "flash_attn_spread says how far llama.cpp's own other attention path moves these "
            "outputs. Made by bench/golden/make-moe-golden.sh with bench/golden/kquant_golden.cpp."
        ),
        "reference_impl": {
            "llama_cpp": "commit 0c1e570 (llama-cpp-python 0.3.36 sdist), static CPU build",
            "tool": "bench/golden/kquant_golden.cpp",
            "llama_cpp_system_info": system_info,
        },
        "models": entries,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    cmd, *rest = sys.argv[1:]
    if cmd == "prompts":
        prompts(*rest)
    elif cmd == "assemble":
        out, prompts_path, models, *runs = rest
        pairs = list(zip(runs[0::2], runs[1::2]))
        assemble(out, prompts_path, json.loads(models), pairs)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
