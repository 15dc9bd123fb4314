#!/bin/bash
bin=${BIN:-target/release/engram}
while IFS=$'\t' read -r q want; do
  out=$($bin ask --collection handbook --data-dir /tmp/hbd --max-tokens 48 $ARGS --json "$q" 2>/dev/null)
  ans=$(echo "$out" | python3 -c 'import sys,json; print(json.load(sys.stdin)["answer"].replace("\n"," "))' 2>/dev/null)
  if echo "$ans" | grep -qiF -- "$want"; then s=ok; else s=BAD; fi
  printf '%s\t%s\t%s\n' "$s" "$q" "$ans"
done < ${1:-/tmp/hbq.tsv}
