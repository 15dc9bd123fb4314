# answers-diff.py OLD.txt.gz NEW.err: the answers that differ between the number-window page's
# `eval qa --verbose` run (its check=on system) and this page's (one system, check on).
import re,sys,gzip
def parse(path, op):
    qs={};cur=None
    for line in op(path):
        m=re.match(r'\[(\d+)/\d+\] (\S+) (.*) \| gold (.*) \| retrieved gold',line)
        if m: cur={'q':m.group(3),'gold':m.group(4),'a':{}}; qs[m.group(2)]=cur; continue
        m=re.match(r'  (\S+) \(f1 ([\d.]+)(, the evidence sentence)?\): (.*)',line)
        if m and cur is not None: cur['a'][m.group(1)]=(float(m.group(2)),bool(m.group(3)),m.group(4))
    return qs
old=parse(sys.argv[1], lambda p: gzip.open(p,'rt'))
new=parse(sys.argv[2], open)
n=d=0; tot_old=tot_new=0
for k,q in new.items():
    if k not in old: continue
    a=[v for kk,v in old[k]['a'].items() if 'check=on' in kk]
    if not a or not q['a']: continue
    a=a[0]
    b=list(q['a'].values())[0]
    n+=1; tot_old+=a[0]; tot_new+=b[0]
    if a[2]!=b[2]:
        d+=1; print(f"{b[0]-a[0]:+.2f} | {q['q']} | gold {q['gold']}\n   before: {a[2][:160]}\n   after : {b[2][:160]}")
print(f"{n} questions, {d} answers differ; mean F1 {tot_old/n:.4f} -> {tot_new/n:.4f}")
