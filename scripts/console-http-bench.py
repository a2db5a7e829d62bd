#!/usr/bin/env python3
"""Server time of every console page over HTTP at 1,000,000 request records (issue 18).

Starts the built `reference-gateway` (SQLite ledger in a temporary data_dir), creates an
account, an operator and three console users (builder, operator, platform) through the admin
API, stops it, seeds the ledger file with ROWS request records of the account (the same shape as
`spine-meter/examples/console_scale.rs`: 4 keys, 2 models, 90 days, 5 % upstream_failed, 0.1 %
discrepancies) and their daily roll-ups, restarts it, signs each user in and times each page
(GET, 40 times after one warm-up) from request sent to body read, on one keep-alive connection.

Usage: python3 scripts/console-http-bench.py [path/to/reference-gateway] [rows]
(default target/debug/reference-gateway, 1000000; needs SPINE_MODEL_GGUF: source ~/.cache/spine/env.sh)
"""
import http.client
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/debug/reference-gateway"
ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
ADMIN = "console-bench-admin-token-0123456789"
PASSWORD = "a long console passphrase"
DAY_MS = 86_400_000


def start(data):
    proc = subprocess.Popen([BIN, "--config", os.path.join(data, "gateway.toml")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = json.loads(proc.stdout.readline())
    return proc, ready


def stop(proc):
    proc.terminate()
    proc.wait(timeout=60)


def call(addr, method, path, body=None, headers=None, form=None):
    host, port = addr.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    h = dict(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body)
        h["content-type"] = "application/json"
    if form is not None:
        data = urllib.parse.urlencode(form)
        h["content-type"] = "application/x-www-form-urlencoded"
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    out = (r.status, r.read(), r.getheaders())
    c.close()
    return out


def admin(ready, path, body):
    s, b, _ = call(ready["admin_addr"], "POST", path, body, {"authorization": f"Bearer {ADMIN}"})
    assert s in (200, 201), (path, s, b)
    return json.loads(b)


def sign_in(ready, email):
    s, b, h = call(ready["console_addr"], "POST", "/console/signin",
                   form={"email": email, "password": PASSWORD})
    assert s == 303, (s, b)
    cookie = [v for k, v in h if k.lower() == "set-cookie"][0].split(";")[0]
    return cookie


def time_pages(ready, cookie, pages):
    host, port = ready["console_addr"].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    rows = []
    for name, path in pages:
        samples = []
        for i in range(41):
            t = time.perf_counter()
            c.request("GET", path, headers={"cookie": cookie})
            r = c.getresponse()
            body = r.read()
            dt = (time.perf_counter() - t) * 1000
            assert r.status == 200, (path, r.status, body[:300])
            if i:
                samples.append(dt)
        samples.sort()
        rows.append((name, path, statistics.median(samples), samples[int(0.95 * len(samples)) - 1]))
        print(f"| {name} | `{path}` | {rows[-1][2]:.1f} | {rows[-1][3]:.1f} |", flush=True)
    return rows


def main():
    data = tempfile.mkdtemp(prefix="console-bench-")
    with open(os.path.join(data, "gateway.toml"), "w") as f:
        f.write(f'''public_listen = "127.0.0.1:0"
tunnel_listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
console_listen = "127.0.0.1:0"
admin_token = "{ADMIN}"
data_dir = "{data}"

[[models]]
id = "smollm2"
gguf = "{os.environ["SPINE_MODEL_GGUF"]}"
input_price_micros_per_mtok = 150000
output_price_micros_per_mtok = 600000
''')
    proc, ready = start(data)
    acct = admin(ready, "/admin/v1/accounts", {})["id"]
    op = admin(ready, "/admin/v1/operators", {})["id"]
    for email, owner in [("builder@example.com", {"account_id": acct}),
                         ("operator@example.com", {"operator_id": op}),
                         ("platform@example.com", {"platform": True})]:
        admin(ready, "/admin/v1/console/users", {"email": email, "password": PASSWORD, **owner})
    stop(proc)

    now = int(time.time() * 1000)
    db = sqlite3.connect(os.path.join(data, "spine.db"))
    seed = time.time()
    db.executescript(f"""
INSERT INTO nodes (node_id, operator_id, public_key_text, created_at_ms) VALUES ('node_bench', '{op}', 'ed25519:BENCH', 0);
INSERT INTO requests (request_id, account_id, model, outcome, node_id, operator_id,
    billed_prompt_tokens, billed_completion_tokens, claimed_prompt_tokens, claimed_completion_tokens,
    usage_source, discrepancy, input_micros_per_mtok, output_micros_per_mtok, share_bps,
    cost_micros, debit_micros, operator_credit_micros, fee_micros, hold_micros, created_at_ms,
    key_hash, duration_ms, ttft_ms)
  WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {ROWS - 1})
  SELECT printf('req_%024d', i), '{acct}',
         CASE WHEN i % 3 = 0 THEN 'other-model' ELSE 'smollm2' END,
         CASE WHEN i % 20 = 0 THEN 'upstream_failed' ELSE 'completed' END,
         'node_bench', '{op}', 34 + i % 50, 10 + i % 200, 34 + i % 50, 10 + i % 200,
         'independent', CASE WHEN i % 1000 = 7 THEN 1 ELSE 0 END, 150000, 600000, 8000, 20, 20, 16, 4, 100,
         {now} - (i * {90 * DAY_MS} / {ROWS}), 'key_' || (i % 4), 900 + i % 500, 100 + i % 300
  FROM n;
INSERT INTO usage_daily (account_id, day, model, key_hash, requests, prompt_tokens, completion_tokens, debit_micros)
  SELECT account_id, created_at_ms / 86400000, model, key_hash, COUNT(*),
         SUM(billed_prompt_tokens), SUM(billed_completion_tokens), SUM(debit_micros)
  FROM requests GROUP BY account_id, created_at_ms / 86400000, model, key_hash;
INSERT INTO earnings_daily (operator_id, day, model, node_id, requests_served, completion_tokens, earned_micros)
  SELECT operator_id, created_at_ms / 86400000, model, node_id,
         SUM(CASE WHEN outcome = 'completed' THEN 1 ELSE 0 END), SUM(billed_completion_tokens),
         SUM(operator_credit_micros)
  FROM requests GROUP BY operator_id, created_at_ms / 86400000, model, node_id;
ANALYZE;
""")
    db.commit()
    db.close()
    print(f"seeded {ROWS} request records in {time.time() - seed:.1f} s", flush=True)

    proc, ready = start(data)
    try:
        print("| page | path | median ms | p95 ms |\n|---|---|---|---|")
        builder = sign_in(ready, "builder@example.com")
        day = time.strftime("%Y-%m-%d", time.gmtime((now - 30 * DAY_MS) / 1000))
        time_pages(ready, builder, [
            ("keys", "/console/keys"),
            ("balance and credit history", "/console/balance"),
            ("usage, 7 days", "/console/usage?days=7"),
            ("usage, 30 days", "/console/usage?days=30"),
            ("usage, 90 days", "/console/usage?days=90"),
            ("usage CSV, 30 days", "/console/usage.csv?days=30"),
            ("request log, first page", "/console/requests"),
            ("request log, one key", "/console/requests?key=key_2"),
            ("request log, a key with no rows", "/console/requests?key=key_unused"),
            ("request log, an outcome with no rows", "/console/requests?outcome=cut_at_bound"),
            ("request log, outcome upstream_failed", "/console/requests?outcome=upstream_failed"),
            ("request log, a model with no rows", "/console/requests?model=no-such-model"),
            ("request log, a model and a key with no rows", "/console/requests?model=smollm2&key=key_unused"),
            ("request log, one day 30 days back", f"/console/requests?day={day}"),
            ("playground", "/console/playground"),
        ])
        operator = sign_in(ready, "operator@example.com")
        time_pages(ready, operator, [
            ("nodes", "/console/nodes"),
            ("earnings", "/console/earnings"),
            ("enrollment tokens", "/console/enrollments"),
        ])
        platform = sign_in(ready, "platform@example.com")
        time_pages(ready, platform, [
            ("platform", "/console/platform"),
            ("platform nodes", "/console/platform/nodes"),
            ("platform discrepancies", "/console/platform/discrepancies"),
        ])
    finally:
        stop(proc)
        subprocess.run(["rm", "-rf", data])


main()
