import re,sys,gzip
def parse(path):
    qs={};cur=None
    for line in gzip.open(path,'rt'):
        m=re.match(r'\[(\d+)/\d+\] (\S+) (.*) \| gold (.*) \| retrieved gold',line)
        if m: cur={'q':m.group(3),'gold':m.group(4),'a':None}; qs[m.group(2)]=cur; continue
        m=re.match(r'  (\S+) \(f1 ([\d.]+)(, the evidence sentence)?\): (.*)',line)
        if m and cur is not None and cur['a'] is None: cur['a']=(float(m.group(2)),bool(m.group(3)),m.group(4))
    return qs
a=parse(sys.argv[1]); b=parse(sys.argv[2]); n=0;d=[];t0=t1=0
for k in b:
    if k not in a or a[k]['a'] is None or b[k]['a'] is None: continue
    n+=1; t0+=a[k]['a'][0]; t1+=b[k]['a'][0]
    if a[k]['a'][2]!=b[k]['a'][2]: d.append((b[k]['a'][0]-a[k]['a'][0],a[k]['q'],a[k]['gold'],a[k]['a'][2],b[k]['a'][2]))
import random
diffs=[x[0] for x in d]+[0]*(n-len(d))
random.seed(1); bs=sorted(sum(random.choice(diffs) for _ in range(n))/n for _ in range(2000))
print(f"{n} questions, {len(d)} differ, {sum(1 for x in d if x[0]>0)} better {sum(1 for x in d if x[0]<0)} worse; F1 {t0/n:.4f} -> {t1/n:.4f}; diff 95% [{bs[50]:+.4f}, {bs[1949]:+.4f}]")
for x in sorted(d): print(f"{x[0]:+.2f} | {x[1][:70]} | gold {x[2]}\n     before: {x[3][:150]}\n     after : {x[4][:150]}")
