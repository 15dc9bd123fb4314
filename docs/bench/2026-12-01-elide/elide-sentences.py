import json,re,sys
src,dst=sys.argv[1],sys.argv[2]
d=json.load(open(src))
S=8
def units(t): return [m.lower() for m in re.findall(r'[^\W_]+',t)]
def shingles(u): return [tuple(u[i:i+S]) for i in range(len(u)-S+1)]
out=[];removed=total=0
for q in d:
    seen=set(); kept=[]
    for c in q['ctxs']:
        t=(c['title']+"\n"+c['text']) if c.get('title') else c['text']
        sh=set(shingles(units(t)))
        r=sum(1 for s in sh if s in seen)
        if sh and r>=0.5*len(sh): continue
        # sentence-level elision against better-ranked kept passages
        sents=re.split(r'(?<=[.!?])\s+',t)
        keep=[]
        for s in sents:
            ss=set(shingles(units(s)))
            total+=len(s)
            if kept and ss and sum(1 for x in ss if x in seen)>=0.5*len(ss):
                removed+=len(s); continue
            keep.append(s)
        seen|=sh
        kept.append({'title':'','text':' '.join(keep)})
    out.append({'question':q['question'],'answers':q['answers'],'ctxs':kept})
json.dump(out,open(dst,'w'))
print('removed share',removed/total, 'passages',sum(len(q['ctxs']) for q in out)/len(out))
