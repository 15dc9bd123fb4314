# Asks engramd the sample handbook's questions and checks each answer contains the fact
# (a loose check: read the answers; docs/bench/2026-11-29-evidence.md counts them by hand).
#   python3 ask-handbook.py ADDR KEY [qa|chat] ['{"policy": "full"}']     # the 32 questions
#   Q22=1 python3 ask-handbook.py ADDR KEY                                # the 22 of 2026-11-29-term-floor
import json, sys, urllib.request, os
addr = sys.argv[1]; key = sys.argv[2]
Q = [
 ("How many unused leave days can be carried over to the next year?", ["5", "five"]),
 ("When do carried-over leave days expire?", ["31 March", "March 31"]),
 ("How far in advance must leave be requested?", ["two weeks", "2 weeks"]),
 ("By what time must a sick employee call their manager?", ["10:00", "10 am", "10am"]),
 ("From which day of absence is a doctor's note required?", ["third", "3rd"]),
 ("How many hours is the standard working week?", ["38"]),
 ("What are the core hours?", ["10:00", "15:00"]),
 ("How many days a week may employees work from home?", ["three", "3 days"]),
 ("How often must passwords be changed?", ["180"]),
 ("What is the IT helpdesk's phone extension?", ["4357"]),
 ("How soon must a lost badge or laptop be reported?", ["one hour", "1 hour", "an hour"]),
 ("Above what amount does an expense need a receipt?", ["25"]),
 ("Which class is train travel booked in?", ["second", "2nd"]),
 ("For trips longer than how many kilometres are flights allowed?", ["600"]),
 ("How much hotel cost is reimbursed per night?", ["150"]),
 ("How often are employee laptops replaced?", ["three years", "3 years"]),
 ("What is the email address of the IT helpdesk?", ["helpdesk@northwind.example"]),
 ("How many previous passwords may a new password not repeat?", ["five", " 5", "5 "]),
 ("What authentication does every account use?", ["two-factor", "2FA", "two factor"]),
 ("Where is leave requested?", ["HR portal"]),
 ("每年未休完的年假最多可以结转多少天？", ["5", "五"]),
 ("结转的年假什么时候作废？", ["3 月 31 日", "3月31日", "三月三十一"]),
 ("标准工作周是多少小时？", ["38"]),
 ("员工每周最多可以在家办公几天？", ["三天", "3 天", "3天"]),
 ("密码多久需要更换一次？", ["180"]),
 ("IT 服务台的分机号是多少？", ["4357"]),
 ("酒店费用每晚最多报销多少？", ["150"]),
 ("行程超过多少公里可以乘坐飞机？", ["600"]),
 ("费用报销须在购买后多少天内提交？", ["30"]),
 ("核心工作时间是几点到几点？", ["10"]),
 ("员工每年有多少天带薪年假？", ["25"]),
 ("缺勤第几天起需要提交医生证明？", ["第三", "第 3"]),
]
Q22 = [
 ("How many days of paid leave does every employee get per year?", ["25"]),
 ("How many unused days can be carried over into the next year?", ["5", "five"]),
 ("When do carried-over days expire?", ["31 March", "March 31"]),
 ("How far in advance is leave requested in the HR portal?", ["two weeks", "2 weeks"]),
 ("By what time do sick employees call their manager?", ["10:00"]),
 ("From which day of absence is a doctor's note required?", ["third", "3rd"]),
 ("How many hours is the standard working week?", ["38"]),
 ("What are the core hours?", ["10:00"]),
 ("How many days a week may employees work from home?", ["three", "3 days"]),
 ("How long must a new password be?", ["12"]),
 ("How often are passwords changed?", ["180"]),
 ("Which app is used for two-factor authentication?", ["authenticator"]),
 ("Within how long is a lost badge or laptop reported?", ["one hour", "1 hour", "an hour"]),
 ("What is the IT helpdesk extension?", ["4357"]),
 ("Within how many days are expense claims submitted?", ["30"]),
 ("Above what amount is a receipt needed?", ["25"]),
 ("Which class is train travel booked in?", ["second"]),
 ("For trips of what distance are flights allowed?", ["600"]),
 ("How much are hotel costs reimbursed per night?", ["150"]),
 ("How often is a laptop replaced?", ["three years", "3 years"]),
 ("Who installs approved software?", ["helpdesk"]),
 ("May personal software be installed on company laptops?", ["no", "not"]),
]
if os.environ.get("Q22"):
    Q = Q22
ep = sys.argv[3] if len(sys.argv) > 3 else "qa"
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
ok = 0
for q, facts in Q:
    if ep == "qa":
        body = {"question": q, "collections": ["handbook"], "max_tokens": 48, **extra}
        url = f"http://{addr}/api/v1/qa"
    else:
        body = {"model": "engram", "messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0, "engram": {"collections": ["handbook"], **extra}}
        url = f"http://{addr}/v1/chat/completions"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req))
    a = r["answer"] if ep == "qa" else r["choices"][0]["message"]["content"]
    hit = any(f.lower() in a.lower() for f in facts)
    ok += hit
    print(("OK  " if hit else "MISS"), q, "->", repr(a))
print(f"{ok}/{len(Q)}")
