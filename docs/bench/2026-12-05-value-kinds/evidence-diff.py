# evidence-diff.py: the questions whose evidence sentence the change moved, from the --verbose
# output of `engram eval qa --evidence` before and after (run in this folder).
import re,sys,gzip
def parse(p):
    out=[];cur=None
    for l in gzip.open(p,'rt'):
        m=re.match(r'  (terms|near:0\.8) \((true|false)\): (.*)',l)
        if m and cur is not None: cur[m.group(1)]=(m.group(2)=='true',m.group(3))
        elif l.startswith("["):
            cur={'q':l.strip()}; out.append(cur)
    return out
for s,way in [('xquad-en','near:0.8'),('xquad-en','terms'),('cmrc2018','terms'),('xquad-zh','terms')]:
    a=parse(f'evidence-{s}-400-before.err.gz'); b=parse(f'evidence-{s}-400-after.err.gz')
    assert len(a)==len(b)
    w=l=c=0
    for x,y in zip(a,b):
        if way not in x: continue
        if x[way]!=y[way]:
            c+=1
            if y[way][0] and not x[way][0]: w+=1; tag='WIN '
            elif x[way][0] and not y[way][0]: l+=1; tag='LOSS'
            else: tag='same'
            if tag!='same' or '-v' in sys.argv: print(tag,s,way,x['q'][:120],'\n   before',x[way][1][:150],'\n   after ',y[way][1][:150])
    print(f'== {s} {way}: changed {c}, won {w}, lost {l}')
