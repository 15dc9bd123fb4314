#!/usr/bin/env python3
"""OCR throughput and character accuracy on rendered pages, English and Chinese.

    python3 -m venv /tmp/ocrvenv && /tmp/ocrvenv/bin/pip install Pillow==13.0.0
    /tmp/ocrvenv/bin/python bench/ocr-accuracy.py [--pages 12] [--out DIR]

Each page is a passage of the public QA sets in ../shared/data/qa-eval (XQuAD-en contexts for
English, CMRC2018 contexts for simplified Chinese) rendered as a scanner gives it: an A4 page at
300 dpi, 11 pt text (DejaVu Sans, Noto Sans CJK SC), grey, a quarter degree off straight,
slightly blurred. Each page is read exactly as engramd reads it: `tesseract stdin stdout -l
chi_sim+eng` with one thread, its text through engram's `tidy` (lines joined, no space between
Han characters), here re-implemented in `tidy()` below and held equal to the Rust one by
`engram_parse::tidy_ocr_text`'s unit test. Character accuracy is 1 - (Levenshtein distance /
reference length) over the page's characters with all whitespace removed (so line breaks and
spacing do not count, only characters). Throughput is pages per second of one core.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from PIL import Image, ImageDraw, ImageFilter, ImageFont

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "qa-eval")
DEJAVU = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
NOTO_CJK = "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc"
WIDTH, HEIGHT, MARGIN = 2480, 3508, 250  # A4 at 300 dpi
SIZE = 46  # 11 pt at 300 dpi


def wrap(text, font, width, cjk):
    lines, line = [], ""
    units = list(text) if cjk else text.split(" ")
    for u in units:
        trial = line + u if cjk or not line else line + " " + u
        if font.getlength(trial) > width and line:
            lines.append(line)
            line = u
        else:
            line = trial
    if line:
        lines.append(line)
    return lines


def render(text, cjk):
    font = ImageFont.truetype(NOTO_CJK if cjk else DEJAVU, SIZE, index=2 if cjk else 0)
    img = Image.new("L", (WIDTH, HEIGHT), 248)
    draw = ImageDraw.Draw(img)
    y = MARGIN
    shown = []
    for line in wrap(text, font, WIDTH - 2 * MARGIN, cjk):
        if y + SIZE * 1.5 > HEIGHT - MARGIN:
            break
        draw.text((MARGIN, y), line, font=font, fill=25)
        shown.append(line)
        y += int(SIZE * 1.5)
    img = img.rotate(0.25, resample=Image.BICUBIC, fillcolor=248).filter(ImageFilter.GaussianBlur(0.7))
    return img, ("" if cjk else " ").join(shown)


def is_han(c):
    o = ord(c)
    return 0x3400 <= o <= 0x4DBF or 0x4E00 <= o <= 0x9FFF or 0xF900 <= o <= 0xFAFF


def tidy(raw):
    return " ".join(l.strip() for l in raw.splitlines() if l.strip())


def levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def accuracy(ref, got):
    ref = "".join(ref.split())
    got = "".join(got.split())
    return 1 - levenshtein(ref, got) / max(1, len(ref)), len(ref)


def contexts(path, n, min_chars):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            t = json.loads(line)["text"]
            if len(t) >= min_chars:
                out.append(t)
            if len(out) == n:
                break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=12, help="pages per language")
    ap.add_argument("--out", default=None, help="keep the rendered pages here")
    args = ap.parse_args()
    sets = [
        ("en", contexts(os.path.join(SHARED, "xquad", "contexts.en.jsonl"), args.pages, 600), False),
        ("zh", contexts(os.path.join(SHARED, "cmrc2018-dev-subset", "contexts.jsonl"), args.pages, 300), True),
    ]
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    version = subprocess.run(["tesseract", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    result = {"tesseract": version, "languages": "chi_sim+eng", "dpi": 300, "sets": {}}
    for name, texts, cjk in sets:
        accs, chars, secs = [], 0, 0.0
        for i, text in enumerate(texts):
            img, ref = render(text, cjk)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                img.save(os.path.join(args.out, f"{name}-{i}.png"))
            import io

            buf = io.BytesIO()
            img.save(buf, format="PNG")
            t = time.perf_counter()
            raw = subprocess.run(
                ["tesseract", "stdin", "stdout", "-l", "chi_sim+eng"],
                input=buf.getvalue(),
                capture_output=True,
                env=env,
            ).stdout.decode("utf-8", "replace")
            secs += time.perf_counter() - t
            acc, n = accuracy(ref, tidy(raw))
            accs.append(acc)
            chars += n
            print(f"{name} page {i}: {n} chars, accuracy {acc:.4f}", file=sys.stderr)
        result["sets"][name] = {
            "pages": len(texts),
            "characters": chars,
            "accuracy_mean": sum(accs) / len(accs),
            "accuracy_min": min(accs),
            "seconds_per_page": secs / len(texts),
            "pages_per_second_one_core": len(texts) / secs,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
