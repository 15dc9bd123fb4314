#!/bin/bash
# ask-handbook.sh BIN QUESTIONS.tsv [engram ask options]: asks each question (a tab, then the fact
# its answer must hold) of the sample handbook, ingested with
#   engram ingest docs/samples/handbook --collection handbook --kv --data-dir /tmp/hbd
# and prints ok or BAD, the question and the answer. Run from the repository's root.
bin=$1; qs=$2; shift 2
while IFS=$'\t' read -r q want; do
  out=$($bin ask --collection handbook --data-dir /tmp/hbd --max-tokens 48 "$@" --json "$q" 2>/dev/null)
  ans=$(echo "$out" | python3 -c 'import sys,json; d=json.load(sys.stdin); print(d["answer"].replace("\n"," "))' 2>/dev/null)
  if echo "$ans" | grep -qiF -- "$want"; then s=ok; else s=BAD; fi
  printf '%s\t%s\t%s\n' "$s" "$q" "$ans"
done < "$qs"
