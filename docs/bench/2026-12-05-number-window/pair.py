import re,sys
# parse eval qa --verbose output: per question, answers of each system
def parse(path):
    qs=[];cur=None
    for line in open(path):
        m=re.match(r'\[(\d+)/\d+\] (\S+) (.*) \| gold (.*) \| retrieved gold',line)
        if m: cur={'q':m.group(3),'gold':m.group(4),'a':{}}; qs.append(cur); continue
        m=re.match(r'  (\S+) \(f1 ([\d.]+)(, the evidence sentence)?\): (.*)',line)
        if m and cur is not None: cur['a'][m.group(1)]=(float(m.group(2)),bool(m.group(3)),m.group(4))
    return qs
qs=parse(sys.argv[1])
on=[k for k in qs[0]['a'] if 'check=on' in k][0]; off=[k for k in qs[0]['a'] if 'check=off' in k][0]
for q in [q for q in qs if len(q["a"])==2]:
    a,b=q['a'][on],q['a'][off]
    if a[2]!=b[2]:
        lead=re.match(r'"?\s*\d',b[2]) is not None
        print(f"{a[0]-b[0]:+.2f} {'start' if lead else 'window' if a[1] else 'other'} | {q['q']} | gold {q['gold']}\n   on : {a[2][:150]}\n   off: {b[2][:150]}")
