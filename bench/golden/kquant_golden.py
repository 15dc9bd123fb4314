"""The JSON side of make-kquant-golden.sh (Python standard library only).

  kquant_golden.py prompts Q4_1_GOLDEN OUT.txt
      the Q4_1 golden file's prompts as kquant_golden's input lines: `ID TOKEN TOKEN ...`
  kquant_golden.py check Q4_1_GOLDEN RUN.jsonl
      holds a run of kquant_golden on the Q4_1 model to the Q4_1 golden file: same greedy
      tokens, top-5 ids and first end-of-generation step, logits within 1e-4, margins within
      1e-4 (the file rounds them to 5 decimals), so the tool's settings are the file's
  kquant_golden.py assemble Q4_1_GOLDEN RUN.jsonl FLASH_RUN.jsonl MODEL_JSON OUT.json
      writes the new golden file: the Q4_1 file's prompts (messages, rendering, token ids) with
      this run's outputs, in the same schema; MODEL_JSON is the "model" object (file, sha256,
      size, the command that made it); FLASH_RUN, the same run with flash attention on, gives
      "flash_attn_spread": how far llama.cpp's own other attention path moves these outputs
"""

import json
import sys


def load_run(path):
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    info = rows.pop()
    return {r["id"]: r for r in rows}, info["system_info"]


def text(hex_bytes):
    return bytes.fromhex(hex_bytes).decode("utf-8", errors="replace")


def prompts(golden, out):
    with open(out, "w", encoding="utf-8") as f:
        for p in golden["prompts"]:
            f.write(p["id"] + " " + " ".join(map(str, p["prompt_token_ids"])) + "\n")


def check(golden, run_path):
    run, _ = load_run(run_path)
    failures = []
    for p in golden["prompts"]:
        r = run[p["id"]]
        if r["generated"] != p["generated_token_ids"]:
            failures.append(f"{p['id']}: greedy tokens differ")
        if r["first_eog_index"] != p["first_eog_index"]:
            failures.append(f"{p['id']}: first end-of-generation step differs")
        for g, (tok, logit, _) in zip(p["top5_last_prompt_position"], r["top5"]):
            if g["id"] != tok or abs(g["logit"] - logit) > 1e-4:
                failures.append(f"{p['id']}: top-5 {tok} {logit} against {g['id']} {g['logit']}")
        worst = max(abs(a - b) for a, b in zip(p["greedy_top1_top2_margin"], r["margins"]))
        if worst > 1e-4:
            failures.append(f"{p['id']}: margins differ by up to {worst}")
    if failures:
        sys.exit("kquant_golden.py: the tool does not reproduce the Q4_1 golden file:\n"
                 + "\n".join(failures))
    print(f"the tool reproduces the Q4_1 golden file ({len(golden['prompts'])} prompts)")


def flash_attn_spread(run, flash):
    """How far flash attention moves llama.cpp's top-5 logits, and its greedy flips' margins."""
    worst, flips = 0.0, []
    for key, r in run.items():
        f = flash[key]
        theirs = {tok: logit for tok, logit, _ in f["top5"]}
        for tok, logit, _ in r["top5"]:
            if tok in theirs:
                worst = max(worst, abs(theirs[tok] - logit))
        step = next((i for i, (a, b) in enumerate(zip(r["generated"], f["generated"])) if a != b),
                    None)
        if step is not None:
            flips.append(r["margins"][step])
    return {
        "worst_top5_logit_change": round(worst, 3),
        "greedy_flips": len(flips),
        "largest_margin_at_a_flip": round(max(flips, default=0.0), 3),
    }


def assemble(golden, run_path, flash_path, model, out):
    run, system_info = load_run(run_path)
    spread = flash_attn_spread(run, load_run(flash_path)[0])
    new_prompts = []
    for p in golden["prompts"]:
        r = run[p["id"]]
        eog = r["first_eog_index"]
        margins = [round(m, 5) for m in r["margins"]]
        q = {k: p[k] for k in ("id", "lang", "kind", "messages", "prompt_text",
                               "n_prompt_tokens", "prompt_token_ids")}
        q.update({
            "generated_token_ids": r["generated"],
            "first_eog_index": eog,
            "generated_text_until_eog": text(r["text_until_eog_hex"]),
            "generated_text_all32": text(r["text_all_hex"]),
            "greedy_top1_top2_margin": margins,
            "min_margin_before_eog": min(margins[:eog] if eog else margins),
            "top5_last_prompt_position": [
                {"id": tok, "logit": logit, "piece": text(piece)}
                for tok, logit, piece in r["top5"]
            ],
        })
        new_prompts.append(q)
    doc = {
        "schema_version": golden["schema_version"],
        "description": (
            "Reference outputs of llama.cpp (commit 0c1e570, built from llama-cpp-python 0.3.36 "
            "by bench/llamacpp.sh, CPU, 2 threads, flash attention off) for "
            f"{model['file']}: SmolLM2-135M-Instruct Q4_1 requantized by `engram requantize "
            "--mix kmix` (ffn_down Q4_K/Q5_K/Q6_K by layer, the other matrices Q5_0/Q5_1, "
            "token_embd Q8_0, norms F32). Same prompts and schema as "
            "../shared/golden/smollm2-135m-q4_1.llamacpp.json; made by "
            "bench/golden/make-kquant-golden.sh with bench/golden/kquant_golden.cpp, which "
            "reproduces that Q4_1 file's tokens and logits (to 1e-4) before it writes this one. "
            "llama.cpp's own flash-attention path moves these top-5 logits by up to "
            f"{spread['worst_top5_logit_change']} and flips greedy tokens only at steps with "
            f"margins up to {spread['largest_margin_at_a_flip']} (flash_attn_spread)."
        ),
        "model": model,
        "reference_impl": {
            "llama_cpp": "commit 0c1e570 (llama-cpp-python 0.3.36 sdist), static CPU build",
            "tool": "bench/golden/kquant_golden.cpp",
            "llama_cpp_system_info": system_info,
        },
        "settings": golden["settings"],
        "flash_attn_spread": spread,
        "chat_template_source": golden["chat_template_source"],
        "prompts": new_prompts,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    cmd, golden_path, *rest = sys.argv[1:]
    golden = json.load(open(golden_path, encoding="utf-8"))
    if cmd == "prompts":
        prompts(golden, *rest)
    elif cmd == "check":
        check(golden, *rest)
    elif cmd == "assemble":
        run_path, flash_path, model_json, out = rest
        assemble(golden, run_path, flash_path, json.loads(model_json), out)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
