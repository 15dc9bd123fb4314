import re,sys,random
def parse(p):
    out=[];cur=None
    for l in open(p):
        m=re.match(r'\[(\d+)/\d+\] (\S+) ',l)
        if m: cur=m.group(2); continue
        m=re.match(r'  engram:grounded(?: \(f1 ([0-9.]+)\))?: (.*)',l)
        if m and cur:
            f1=float(m.group(1)) if m.group(1) else 0.0
            out.append((cur,f1,m.group(2))); cur=None
    return out
a=parse(sys.argv[1]); b=parse(sys.argv[2])
assert [x[0] for x in a]==[x[0] for x in b], (len(a),len(b))
d=[x[1]-y[1] for x,y in zip(a,b)]
ch=[(x,y) for x,y in zip(a,b) if x[2]!=y[2]]
print(len(a),'floor F1 %.4f nofloor F1 %.4f diff %.4f'%(sum(x[1] for x in a)/len(a),sum(y[1] for y in b)/len(b),sum(d)/len(d)))
random.seed(1); bs=sorted(sum(random.choice(d) for _ in d)/len(d) for _ in range(10000)); print('ci',bs[250],bs[9750])
for x,y in ch: print(x[0],'floor',x[1],x[2][:40],'| nofloor',y[1],y[2][:60])
