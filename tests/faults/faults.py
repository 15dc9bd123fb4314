#!/usr/bin/env python3
"""Fault injection against a real engramd (and the engram command line): the operator's bad
day, scripted. Standard library only. See README.md in this folder for what each scenario does
and what it checks; `run.sh` builds the binaries and calls this script.

Every scenario prints one `RESULT {...}` JSON line with its figures; the script exits non-zero
if any check failed. Scenarios that need root (tmpfs mounts) say so and are skipped where
mount is refused.
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "appliance", "parse", "tests", "fixtures")
WORDS = (
    "pump valve reservoir gauge turbine pipe meter sensor alarm shift log chlorine filter "
    "basin canal pressure flow district inspection engineer report maintenance network "
    "operator weir sluice aquifer borehole hydrant"
).split()

FAILURES = []


def check(cond, what):
    """Records a failed check (the run goes on; the exit status says it failed)."""
    if not cond:
        FAILURES.append(what)
        print(f"  CHECK FAILED: {what}", flush=True)
    return cond


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Http:
    def __init__(self, port, key):
        self.base = f"http://127.0.0.1:{port}"
        self.key = key

    def call(self, method, path, body=None, ctype="application/json", timeout=60):
        data = None
        headers = {"Authorization": f"Bearer {self.key}"}
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = ctype
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw[:1] in (b"{", b"[") else raw
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw

    def text(self, coll, name, text):
        return self.call("POST", f"/api/v1/collections/{coll}/documents/text",
                         {"name": name, "text": text})

    def multipart(self, coll, files):
        boundary = uuid.uuid4().hex
        parts = []
        for name, data in files:
            parts.append(
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"{name}\"\r\n\r\n".encode() + data + b"\r\n")
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        return self.call("POST", f"/api/v1/collections/{coll}/documents", body,
                         ctype=f"multipart/form-data; boundary={boundary}")

    def metric(self, prefix):
        st, body = self.call("GET", "/metrics")
        if st != 200:
            return None
        text = body.decode() if isinstance(body, bytes) else str(body)
        total = 0.0
        for line in text.splitlines():
            if line.startswith(prefix):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Daemon:
    """One engramd process on a data directory, started and killed at will."""

    def __init__(self, bins, data, port, log, config):
        self.bins, self.data, self.port, self.log, self.config = bins, data, port, log, config
        self.proc = None

    def start(self, wait=True, timeout=600):
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        out = open(self.log, "ab")
        t0 = time.time()
        self.proc = subprocess.Popen(
            [os.path.join(self.bins, "engramd"), "--config", self.config,
             "--data-dir", self.data, "--listen", f"127.0.0.1:{self.port}"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()
        if not wait:
            return None
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engramd exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2):
                    return time.time() - t0
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.05)
        raise RuntimeError(f"engramd did not answer /healthz in {timeout} s; see {self.log}")

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def term(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill9()


def new_key(bins, data):
    out = subprocess.run([os.path.join(bins, "engramd"), "keys", "create", "--data-dir", data,
                          "--scopes", "admin"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def write_config(path, small_reserve=True, kv_dir=None):
    """A daemon configuration; `small_reserve` keeps the disk reserve (and its ballast file) at
    16 MiB on a large disk, where the default would be 1 GiB per throwaway data directory;
    `kv_dir` puts the NVMe KV tier there."""
    kv = f"dir = \"{kv_dir}\"\n" if kv_dir else ""
    with open(path, "w") as f:
        f.write(f"[models]\nthreads = 2\n[kv]\n{kv}dram_mib = 32\nnvme_gib = 1\n"
                "[limits]\nmax_tokens = 8\nmax_upload_bytes = 4194304\ningest_concurrency = 16\n"
                "[auth]\nfailures_per_minute = 1000000\n"
                + ("[storage]\nreserve_mib = 16\n" if small_reserve else ""))


def new_daemon(args, work, name, data=None, **config):
    """A daemon (not started) on `data` (default `work/name`) with the suite's configuration
    (`work/name.toml`, `config` passed to write_config), its log in `work/name.log`, an admin
    key and a free port; returns (daemon, http)."""
    data = data or os.path.join(work, name)
    cfg = os.path.join(work, f"{name}.toml")
    write_config(cfg, **config)
    key = new_key(args.bins, data)
    port = free_port()
    return Daemon(args.bins, data, port, os.path.join(work, f"{name}.log"), cfg), Http(port, key)


def para(rng, n_words, token):
    words = [rng.choice(WORDS) for _ in range(n_words)]
    words.insert(rng.randrange(len(words) + 1), token)
    return " ".join(words).capitalize() + "."


class Corpus:
    """What the uploaders were told: every acknowledged document, by id, with the unique
    token its latest acknowledged content carries."""

    def __init__(self):
        self.lock = threading.Lock()
        self.acked = {}  # id -> (name, token)
        # name -> tokens of content sent under it in a request the kill cut off: the daemon
        # may have stored it durably without the client hearing so.
        self.maybe = {}
        self.counter = 0

    def token(self):
        with self.lock:
            self.counter += 1
            return f"zq{self.counter:05d}x{random.randrange(10**6):06d}"

    def ack(self, doc_id, name, token):
        with self.lock:
            self.acked[doc_id] = (name, token)

    def cut(self, name, token):
        with self.lock:
            self.maybe.setdefault(name, set()).add(token)


def uploader(http, coll, corpus, seed, stop, stats, pause):
    """Uploads until `stop`: new documents, the same bytes under new names, near-duplicates,
    new content under its own earlier names; multipart (1-3 files) or the text route."""
    rng = random.Random(seed)
    mine = []  # (name, text, token) this client uploaded and had acknowledged
    n = 0
    while not stop.is_set():
        time.sleep(pause)
        batch = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            n += 1
            kind = rng.random()
            name = f"c{seed}-d{n}.txt"
            if mine and kind < 0.2:
                # The same bytes under a new name.
                _, text, token = rng.choice(mine)
            elif mine and kind < 0.35:
                # New content under one of its own names.
                name, _, _ = rng.choice(mine)
                token = corpus.token()
                text = para(rng, rng.randint(30, 300), token)
            elif mine and kind < 0.5:
                # A near-duplicate: another text with one word changed and a token of its own.
                _, base, _ = rng.choice(mine)
                words = base.split()
                words[rng.randrange(len(words))] = rng.choice(WORDS)
                token = corpus.token()
                text = " ".join(words) + " " + token
            else:
                token = corpus.token()
                text = para(rng, rng.randint(30, 600), token)
            if any(b[0] == name for b in batch):
                continue
            batch.append((name, text, token))
        try:
            if len(batch) == 1 and rng.random() < 0.5:
                st, body = http.text(coll, batch[0][0], batch[0][1])
            else:
                st, body = http.multipart(coll, [(nm, t.encode()) for nm, t, _ in batch])
        except (OSError, urllib.error.URLError):
            stats["errors"] += 1  # the daemon was killed mid-request: not acknowledged
            for name, _, token in batch:
                corpus.cut(name, token)
            continue
        if st in (202, 207) and isinstance(body, dict):
            for (name, text, token), r in zip(batch, body["documents"]):
                if r["outcome"] == "failed":
                    if st == 202:
                        stats["failed_in_202"] += 1
                    continue
                corpus.ack(r["id"], name, token)
                stats["acked"] += 1
                mine = [m for m in mine if m[0] != name] + [(name, text, token)]
        elif st == 429:
            time.sleep(0.05)
        else:
            stats["other"][st] = stats["other"].get(st, 0) + 1


def wait_done(http, coll, corpus, timeout):
    """Polls until every acknowledged document is done (or failed); returns the ids still in
    the pipeline at the deadline."""
    deadline = time.time() + timeout
    left = set(corpus.acked)
    while left:
        st, body = http.call("GET", f"/api/v1/collections/{coll}/documents")
        if st == 200:
            stage = {d["id"]: d["stage"] for d in body["documents"]}
            left = {i for i in left if stage.get(i) not in ("done", "failed")}
        if not left or time.time() >= deadline:
            break
        time.sleep(1)
    return left


def verify(http, coll, corpus):
    """Every acknowledged id: present under its name, done, and found by its unique token.
    Returns (lost, not_done, not_found)."""
    lost, not_done, not_found = [], [], []
    for doc_id, (name, token) in sorted(corpus.acked.items()):
        st, d = http.call("GET", f"/api/v1/collections/{coll}/documents/{doc_id}")
        if st != 200 or d.get("name") != name:
            lost.append((doc_id, name, st))
            continue
        if d["stage"] != "done":
            not_done.append((doc_id, d["stage"], d.get("error")))
            continue
        found = False
        for t in [token] + sorted(corpus.maybe.get(name, ())):
            st, r = http.call("POST", "/api/v1/search", {"query": t, "collections": [coll],
                                                           "mode": "bm25", "top_k": 50})
            ids = {h["document"]["id"] for h in r.get("hits", [])} if st == 200 else set()
            if doc_id in ids:
                found = True
                break
        if not found:
            not_found.append((doc_id, name, token))
    return lost, not_done, not_found


def scenario_kill9(args, work):
    """N random kill -9 during concurrent uploads; every acknowledged id verified."""
    d, http = new_daemon(args, work, "kill9")
    corpus = Corpus()
    restarts = []
    stats = {"acked": 0, "errors": 0, "failed_in_202": 0, "other": {}}
    d.start()
    st, _ = http.call("POST", "/api/v1/collections", {"name": "f"})
    check(st == 201, f"create collection: {st}")
    for trial in range(args.trials):
        stop = threading.Event()
        clients = random.randint(2, 4)
        threads = [threading.Thread(target=uploader,
                                    args=(http, "f", corpus, trial * 10 + c, stop, stats,
                                          1.0 / args.rate))
                   for c in range(clients)]
        for t in threads:
            t.start()
        time.sleep(random.uniform(0.5, 4.0))
        d.kill9()
        stop.set()
        for t in threads:
            t.join()
        restarts.append(d.start())
        # Everything acknowledged so far is there right after the restart (maybe not done).
        for doc_id, (name, _) in list(corpus.acked.items()):
            st, doc = http.call("GET", f"/api/v1/collections/f/documents/{doc_id}")
            if not check(st == 200 and doc.get("name") == name,
                         f"trial {trial}: document {doc_id} ({name}) after restart: {st}"):
                break
        print(f"  trial {trial + 1}/{args.trials}: {clients} clients, "
              f"{len(corpus.acked)} acknowledged, restart {restarts[-1]:.2f} s", flush=True)
    stuck = wait_done(http, "f", corpus, args.drain_timeout)
    lost, not_done, not_found = verify(http, "f", corpus)
    d.term()
    check(not lost, f"lost: {lost[:5]}")
    check(not stuck and not not_done, f"not done: {sorted(stuck)[:5]} {not_done[:5]}")
    check(not not_found, f"not searchable: {not_found[:5]}")
    check(stats["failed_in_202"] == 0, f"{stats['failed_in_202']} failed outcomes in a 202")
    return {
        "scenario": "kill9", "trials": args.trials, "acknowledged": len(corpus.acked),
        "upload_requests_cut_by_kill": stats["errors"], "lost": len(lost),
        "stuck": len(stuck | {x[0] for x in not_done}), "not_searchable": len(not_found),
        "restart_s_p50": round(statistics.median(restarts), 3) if restarts else None,
        "restart_s_max": round(max(restarts), 3) if restarts else None,
        "other_statuses": stats["other"],
    }


def scenario_cli_kill(args, work):
    """kill -9 during `engram ingest --kv` and `engram kv precompute`; the daemon then finishes
    every document and drains the chunk KV queue."""
    data = os.path.join(work, "cli")
    src = os.path.join(work, "cli-src")
    os.makedirs(src)
    rng = random.Random(7)
    tokens = {}
    for i in range(args.cli_docs):
        tok = f"cl{i:04d}q"
        tokens[f"doc{i:03d}.txt"] = tok
        with open(os.path.join(src, f"doc{i:03d}.txt"), "w") as f:
            f.write(para(rng, rng.randint(40, 400), tok))
    engram = os.path.join(args.bins, "engram")
    env = dict(os.environ)
    kills = []
    for attempt in range(2):
        p = subprocess.Popen([engram, "ingest", src, "--collection", "cli", "--kv",
                              "--data-dir", data], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)
        time.sleep(random.uniform(3, 8))
        killed = p.poll() is None
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills.append(("ingest", killed))
    p = subprocess.Popen([engram, "kv", "precompute", "--collection", "cli", "--data-dir", data],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(random.uniform(3, 6))
    kills.append(("kv precompute", p.poll() is None))
    p.send_signal(signal.SIGKILL)
    p.wait()
    # The daemon on the same data directory: every document the catalog has gets done, and
    # the chunk KV queue drains.
    d, http = new_daemon(args, work, "cli", data)
    started = d.start()
    st, body = http.call("GET", "/api/v1/collections/cli/documents")
    docs = body.get("documents", []) if st == 200 else []
    corpus = Corpus()
    for doc in docs:
        corpus.ack(doc["id"], doc["name"], tokens[doc["name"]])
    stuck = wait_done(http, "cli", corpus, args.drain_timeout)
    lost, not_done, not_found = verify(http, "cli", corpus)
    deadline = time.time() + args.drain_timeout
    pending = None
    while time.time() < deadline:
        pending = http.metric('engram_ingest_pending{queue="chunk_kv"}')
        if pending == 0:
            break
        time.sleep(2)
    d.term()
    # The command line again: it finishes the rest of the folder.
    out = subprocess.run([engram, "ingest", src, "--collection", "cli", "--kv", "--json",
                          "--data-dir", data], capture_output=True, text=True, env=env)
    check(out.returncode == 0, f"engram ingest after the kills: {out.stderr[-500:]}")
    report = json.loads(out.stdout) if out.returncode == 0 else {}
    check(not lost and not stuck and not not_done and not not_found,
          f"cli: lost {lost[:3]} stuck {sorted(stuck)[:3]} {not_done[:3]} "
          f"not searchable {not_found[:3]}")
    check(pending == 0, f"chunk KV queue still holds {pending} chunks")
    return {"scenario": "cli_kill", "kills": kills, "documents_after_kills": len(docs),
            "files": args.cli_docs, "stuck": len(stuck | {x[0] for x in not_done}),
            "lost": len(lost),
            "chunk_kv_pending_after_drain": pending, "daemon_start_s": round(started, 3),
            "final_ingest": {o: sum(1 for x in report.get("documents", []) if x["outcome"] == o)
                             for o in ("added", "unchanged", "failed")}}


def scenario_kv_corrupt(args, work):
    """Corrupted, truncated and deleted KV blobs: caught, recomputed, counted by reason."""
    d, http = new_daemon(args, work, "kvc")
    d.start()
    http.call("POST", "/api/v1/collections", {"name": "k"})
    rng = random.Random(3)
    questions = []
    corpus = Corpus()
    for i in range(8):
        tok = corpus.token()
        st, body = http.text("k", f"k{i}.txt", para(rng, 150, tok))
        corpus.ack(body["documents"][0]["id"], f"k{i}.txt", tok)
        questions.append(f"What does the report say about {tok}?")
    wait_done(http, "k", corpus, args.drain_timeout)
    deadline = time.time() + args.drain_timeout
    while time.time() < deadline and http.metric('engram_ingest_pending{queue="chunk_kv"}'):
        time.sleep(1)
    d.term()
    blobs = []
    for root, _, files in os.walk(os.path.join(d.data, "kv")):
        blobs += [os.path.join(root, f) for f in files if f.endswith(".kv")]
    rng.shuffle(blobs)
    third = max(1, len(blobs) // 3)
    flipped, truncated, deleted = blobs[:third], blobs[third:2 * third], blobs[2 * third:]
    for p in flipped:
        with open(p, "r+b") as f:
            f.seek(os.path.getsize(p) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x5A]))
    for p in truncated:
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 3)
    for p in deleted:
        os.remove(p)
    d.start()
    answered = 0
    for q in questions:
        st, body = http.call("POST", "/api/v1/qa", {"question": q, "collections": ["k"],
                                                    "max_tokens": 4}, timeout=300)
        answered += st == 200
    rejected = http.metric("engram_kv_rejected_total")
    checksum = http.metric('engram_kv_rejected_total{reason="checksum"}')
    d.term()
    with open(os.path.join(work, "kvc.log"), errors="replace") as f:
        warned = sum("chunk KV rejected" in line and "WARN" in line for line in f)
    check(answered == len(questions), f"{answered}/{len(questions)} questions answered")
    check(len(blobs) < 3 or (rejected or 0) > 0, f"no rejection counted of {len(blobs)} blobs")
    check((rejected or 0) == 0 or warned > 0, "rejections not logged at WARN")
    return {"scenario": "kv_corrupt", "blobs": len(blobs), "flipped": len(flipped),
            "truncated": len(truncated), "deleted": len(deleted), "answered": answered,
            "rejected_total": rejected, "rejected_checksum": checksum, "warn_lines": warned}


def mount_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


def umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path, name="filler", leave=0):
    """Writes zeros until the file system has `leave` bytes free (0: until it is full)."""
    fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    chunk = b"\0" * (1 << 16)
    try:
        while True:
            room = shutil.disk_usage(path).free - leave
            if room <= 0:
                break
            os.write(fd, chunk[:min(len(chunk), room)])
    except OSError:
        pass
    finally:
        os.close(fd)


def scenario_disk_full_data(args, work):
    """The data directory on a small file system: uploads until 507 (never a 202 that did
    not store), kill -9, a restart on a completely full disk, space back, nothing lost."""
    mnt = os.path.join(work, "small-data")
    ok, why = mount_tmpfs(mnt, "24m")
    if not ok:
        print(f"  skipped: cannot mount a tmpfs here ({why}); needs root", flush=True)
        return {"scenario": "disk_full_data", "skipped": why}
    try:
        d, http = new_daemon(args, work, "dfd", os.path.join(mnt, "data"), small_reserve=False)
        d.start()
        http.call("POST", "/api/v1/collections", {"name": "s"})
        # Filled by another program while the daemon is down: the next start gives the ballast
        # back, which must leave the catalog what it needs to open (half a small disk's reserve
        # did not, and the knowledge base retried for ever). It serves read-only, and takes
        # writes again once the space is back, without a restart.
        d.term()
        fill(mnt, name="while-down")
        d.start()
        kb_open = None
        for _ in range(60):
            st, ready = http.call("GET", "/readyz")
            kb_open = ready.get("checks", {}).get("knowledge_base", {}) if isinstance(ready, dict) else {}
            if kb_open.get("ok"):
                break
            time.sleep(0.5)
        check(kb_open.get("ok"), f"a disk filled while the daemon was down: the knowledge base "
                                 f"did not open: {ready}")
        os.remove(os.path.join(mnt, "while-down"))
        writable = False
        for _ in range(60):
            st, _ = http.text("s", "after-full.txt", "written once the disk had room again")
            if st == 202:
                writable = True
                break
            time.sleep(0.5)
        check(writable, "writes did not resume after the disk filled while down had room again")
        # Another program takes most of the disk, so uploads reach its end in a bounded time
        # however fast ingestion keeps up.
        fill(mnt, leave=args.fill_free_mib << 20)
        rng = random.Random(11)
        corpus = Corpus()
        statuses = {}
        for i in range(2000):
            tok = corpus.token()
            st, body = http.text("s", f"s{i}.txt", para(rng, args.doc_words, tok))
            statuses[st] = statuses.get(st, 0) + 1
            if st == 202:
                corpus.ack(body["documents"][0]["id"], f"s{i}.txt", tok)
            else:
                check(st == 507 and body["error"]["type"] == "insufficient_storage",
                      f"upload on a filling disk: {st} {body}")
                break
        check(507 in statuses, f"no 507 before the disk filled: {statuses}")
        time.sleep(random.uniform(1, 5))
        d.kill9()
        restart = d.start()
        st, ready = http.call("GET", "/readyz")
        # Fill the disk completely, as another program would, and start again.
        d.kill9()
        fill(mnt)
        full_restart = d.start()
        time.sleep(2)
        st, ready_full = http.call("GET", "/readyz")
        storage = ready_full.get("checks", {}).get("storage", {}) if isinstance(ready_full, dict) else {}
        kb = ready_full.get("checks", {}).get("knowledge_base", {}) if isinstance(ready_full, dict) else {}
        check(st in (200, 503) and (storage.get("read_only") or not kb.get("ok")),
              f"/readyz on a full disk: {st} {ready_full}")
        check(bool(storage.get("reason") or kb.get("reason")), "/readyz gives no reason")
        st_up, _ = http.text("s", "late.txt", "late")
        check(st_up in (503, 507), f"upload on a full disk: {st_up}")
        # Space back (the filler goes, the disk grows): writes resume without a restart and
        # every acknowledged document finishes.
        os.remove(os.path.join(mnt, "filler"))
        subprocess.run(["mount", "-o", "remount,size=256m", mnt], capture_output=True)
        deadline = time.time() + 60
        resumed = None
        while time.time() < deadline:
            st_up, _ = http.text("s", "late.txt", "late document " + corpus.token())
            if st_up == 202:
                resumed = True
                break
            time.sleep(1)
        check(resumed, "writes did not resume after space came back")
        stuck = wait_done(http, "s", corpus, args.drain_timeout)
        lost, not_done, not_found = verify(http, "s", corpus)
        d.term()
        check(not lost and not stuck and not not_done and not not_found,
              f"disk full: lost {lost[:3]} stuck {sorted(stuck)[:3]} {not_done[:3]} "
              f"not searchable {not_found[:3]}")
        return {"scenario": "disk_full_data", "statuses": statuses,
                "acknowledged": len(corpus.acked), "lost": len(lost),
                "stuck": len(stuck | {x[0] for x in not_done}), "restart_s": round(restart, 3),
                "restart_on_full_disk_s": round(full_restart, 3),
                "readyz_on_full_disk": {"read_only": storage.get("read_only"),
                                        "knowledge_base_ok": kb.get("ok")}}
    finally:
        try:
            d.kill9()
        except Exception:
            pass
        umount(mnt)


def scenario_disk_full_kv(args, work):
    """The KV directory on its own small file system: the tier keeps its reserve, evicts, and
    questions are answered."""
    mnt = os.path.join(work, "small-kv")
    ok, why = mount_tmpfs(mnt, "20m")
    if not ok:
        print(f"  skipped: cannot mount a tmpfs here ({why}); needs root", flush=True)
        return {"scenario": "disk_full_kv", "skipped": why}
    try:
        d, http = new_daemon(args, work, "dfk", kv_dir=f"{mnt}/kv")
        d.start()
        http.call("POST", "/api/v1/collections", {"name": "v"})
        rng = random.Random(5)
        corpus = Corpus()
        for i in range(6):
            tok = corpus.token()
            st, body = http.text("v", f"v{i}.txt", para(rng, 800, tok))
            corpus.ack(body["documents"][0]["id"], f"v{i}.txt", tok)
        lowest = None

        def sample():
            nonlocal lowest
            free = shutil.disk_usage(mnt).free
            lowest = free if lowest is None else min(lowest, free)

        def kv(outcome):
            return http.metric(f'engram_ingested_total{{outcome="{outcome}"}}')

        # Drained: every document done, then no chunk waiting for its KV, then every chunk's
        # KV counted (stored or failed). In that order: a document enters the chunk KV queue
        # when it becomes done, so a gauge read before the listing can say 0 for a queue not
        # filled yet (one CI run on 2026-12-02 stopped there and tested nothing).
        chunks, drained = 0, False
        deadline = time.time() + args.drain_timeout
        while time.time() < deadline:
            sample()
            st, body = http.call("GET", "/api/v1/collections/v/documents")
            docs = body.get("documents", []) if st == 200 else []
            if len(docs) == len(corpus.acked) and all(x["stage"] == "done" for x in docs):
                chunks = sum(x["chunks"] for x in docs)
                if http.metric('engram_ingest_pending{queue="chunk_kv"}') == 0 and \
                        kv("kv_computed") + kv("kv_present") + kv("kv_failed") >= chunks:
                    drained = True
                    break
            time.sleep(0.5)
        answered = 0
        for doc_id, (_, tok) in corpus.acked.items():
            st, _ = http.call("POST", "/api/v1/qa", {"question": f"What about {tok}?",
                                                     "collections": ["v"], "max_tokens": 4},
                              timeout=300)
            answered += st == 200
            sample()
        computed, present, failed = kv("kv_computed"), kv("kv_present"), kv("kv_failed")
        d.term()
        total = shutil.disk_usage(mnt).total
        check(lowest is not None and lowest >= 0.04 * total,
              f"the KV file system went down to {lowest} free bytes of {total}")
        check(drained, f"chunk KV not drained in {args.drain_timeout} s: "
                       f"{computed + present + failed} of {chunks} chunks")
        # A full tier evicts to make room: no chunk is refused for want of it.
        check(failed == 0, f"{failed} chunks' KV not stored (see the daemon's log)")
        # The scenario tests the reserve only if the tier came near it: a fresh file system
        # holds no chunk's KV, so chunks are computed, and they outweigh half of it.
        check(computed > 0, f"no chunk's KV computed of {chunks}")
        check(lowest < total // 2,
              f"the KV tier never filled its file system (lowest free {lowest} of {total}): "
              "the reserve went untested")
        check(answered == len(corpus.acked), f"{answered}/{len(corpus.acked)} answered")
        return {"scenario": "disk_full_kv", "kv_fs_bytes": total, "lowest_free_bytes": lowest,
                "chunks": chunks, "chunks_kv_computed": computed, "chunks_kv_present": present,
                "chunks_kv_failed": failed, "answered": answered}
    finally:
        try:
            d.kill9()
        except Exception:
            pass
        umount(mnt)


def scenario_bad_files(args, work):
    """Malformed, binary, empty and oversized files: a clear error each, nothing else lost."""
    d, http = new_daemon(args, work, "bad")
    d.start()
    http.call("POST", "/api/v1/collections", {"name": "b"})
    good = open(os.path.join(FIXTURES, "guide.md"), "rb").read()
    pdf = open(os.path.join(FIXTURES, "english-2pages.pdf"), "rb").read()
    docx = open(os.path.join(FIXTURES, "report.docx"), "rb").read()
    rng = random.Random(9)
    bad = {
        "truncated.pdf": pdf[: len(pdf) // 2],
        "garbled.pdf": bytes(b ^ 0x33 if rng.random() < 0.01 else b for b in pdf),
        "truncated.docx": docx[: len(docx) // 3],
        "binary.txt": bytes(rng.randrange(256) for _ in range(5000)),
        "empty.md": b"",
        "scanned.pdf": open(os.path.join(FIXTURES, "scanned.pdf"), "rb").read(),
        "bomb.docx": open(os.path.join(FIXTURES, "bomb-lying-header.docx"), "rb").read(),
    }
    results = {}
    for name, blob in bad.items():
        st, body = http.multipart("b", [(name, blob), ("good-" + name + ".md", good)])
        outcome = None
        if isinstance(body, dict) and "documents" in body:
            outcome = body["documents"][0]["outcome"]
        results[name] = (st, outcome)
        check(st in (202, 207, 400, 413), f"{name}: status {st} {body}")
    st, body = http.multipart("b", [("huge.txt", b"x" * (5 << 20))])
    results["huge.txt"] = (st, None)
    check(st == 413, f"an upload over the limit: {st}")
    st, body = http.call("POST", "/api/v1/collections/b/documents/text", b"{not json",
                         ctype="application/json")
    check(st == 400, f"bad JSON: {st}")
    # Every document ends done or failed with a reason; the good copies are searchable.
    deadline = time.time() + args.drain_timeout
    docs = []
    while time.time() < deadline:
        st, body = http.call("GET", "/api/v1/collections/b/documents")
        docs = body["documents"]
        if all(x["stage"] in ("done", "failed") for x in docs):
            break
        time.sleep(1)
    for x in docs:
        if x["name"].startswith("good-"):
            check(x["stage"] == "done", f"{x['name']} is {x['stage']}")
        elif x["stage"] == "failed":
            check(bool(x.get("error")), f"{x['name']} failed without a reason")
    st, _ = http.call("GET", "/healthz")
    check(st == 200, "the daemon died")
    d.term()
    return {"scenario": "bad_files", "results": {k: list(v) for k, v in results.items()},
            "failed_with_reason": sum(1 for x in docs if x["stage"] == "failed")}


SCENARIOS = {
    "kill9": scenario_kill9,
    "cli_kill": scenario_cli_kill,
    "kv_corrupt": scenario_kv_corrupt,
    "disk_full_data": scenario_disk_full_data,
    "disk_full_kv": scenario_disk_full_kv,
    "bad_files": scenario_bad_files,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bins", default=os.path.join(ROOT, "target", "release"),
                    help="folder holding engramd and engram")
    ap.add_argument("--trials", type=int, default=50, help="kill -9 trials")
    ap.add_argument("--rate", type=float, default=8.0,
                    help="upload requests per second per client at most")
    ap.add_argument("--cli-docs", type=int, default=60)
    ap.add_argument("--doc-words", type=int, default=6000,
                    help="words per document that fills the small disk")
    ap.add_argument("--fill-free-mib", type=int, default=4,
                    help="MiB left free on disk_full_data's 24 MiB disk before the uploads fill it")
    ap.add_argument("--drain-timeout", type=int, default=900,
                    help="seconds allowed for the queue to drain after the faults")
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run these only")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    random.seed(args.seed)
    os.environ.setdefault("ENGRAM_MODELS_DIR", os.path.join(ROOT, "models"))
    work = tempfile.mkdtemp(prefix="engram-faults-")
    print(f"fault injection: binaries in {args.bins}, work folder {work}", flush=True)
    results = []
    try:
        for name in args.only or list(SCENARIOS):
            print(f"== {name}", flush=True)
            t0 = time.time()
            try:
                r = SCENARIOS[name](args, work)
            except Exception as e:  # a scenario that cannot run is a failure, not a skip
                check(False, f"{name} raised {type(e).__name__}: {e}")
                r = {"scenario": name, "error": str(e)}
            r["seconds"] = round(time.time() - t0, 1)
            print("RESULT " + json.dumps(r), flush=True)
            results.append(r)
    finally:
        if not args.keep and not FAILURES:
            shutil.rmtree(work, ignore_errors=True)
        elif FAILURES:
            print(f"work folder kept for inspection: {work}", flush=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed:", flush=True)
        for f in FAILURES:
            print(f"  - {f}", flush=True)
        sys.exit(1)
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
