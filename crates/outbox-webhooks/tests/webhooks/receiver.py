"""The webhook tests' receiver: every delivery is checked with the official Standard Webhooks
verifier (PyPI's `standardwebhooks`, `Webhook(secret).verify(body, headers)`), code no one in
this repository wrote.

Usage: receiver.py CONTROL LOG [PORT]. It listens on PORT of 127.0.0.1 (a free one when absent)
and prints it. For each POST to /<endpoint> it re-reads CONTROL (JSON: "secrets": {endpoint:
[secret, ...]}, "behaviour": {endpoint: "ok" | "fail" | "gone" | "slow:<ms>" |
"retry-after:<s>" | "throttle:<s>" | "chaos:<seed>"},
"fail_records": {endpoint: [record key, ...]}), answers as told, and appends one JSON line to
LOG: the endpoint, the headers it relies on, the status it answered, and per secret whether the
signature verified, plus whether a body changed by one byte was refused.

"throttle:<s>" answers 429 with `Retry-After` (the whole seconds left, rounded up) for <s>
seconds from the endpoint's first request, then 200.

"chaos:<seed>" answers at random: 70% 200, 15% 500, 10% 429 with `Retry-After: 1`, and 5% a
503 held 4 s (past the sender's timeout in the chaos test, so the sender sees no answer).
"""

import json
import math
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

CONTROL, LOG = sys.argv[1], sys.argv[2]
PORT = int(sys.argv[3]) if len(sys.argv) > 3 else 0
LOCK = threading.Lock()
CHAOS = {}
THROTTLED_SINCE = {}


def chaos(seed):
    """The next chaos answer: (status, headers, seconds to hold it)."""
    with LOCK:
        rng = CHAOS.setdefault(seed, random.Random(seed))
        roll = rng.random()
    if roll < 0.70:
        return 200, {}, 0
    if roll < 0.85:
        return 500, {}, 0
    if roll < 0.95:
        return 429, {"Retry-After": "1"}, 0
    return 503, {}, 4


def verified(secret, body, headers):
    try:
        Webhook(secret).verify(body, headers)
        return True
    except WebhookVerificationError:
        return False


class Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        with open(CONTROL) as f:
            control = json.load(f)
        endpoint = self.path.strip("/")
        headers = {k.lower(): v for k, v in self.headers.items()}
        secrets = control.get("secrets", {}).get(endpoint, [])
        verifies = [verified(s, body, headers) for s in secrets]
        tampered = body[:-1] + (b" " if body[-1:] != b" " else b"x")
        tamper_refused = not any(verified(s, tampered, headers) for s in secrets)
        behaviour = control.get("behaviour", {}).get(endpoint, "ok")
        status, extra, hold = 200, {}, 0
        if headers.get("outbox-record") in control.get("fail_records", {}).get(endpoint, []):
            status = 500
        elif behaviour == "fail":
            status = 500
        elif behaviour == "gone":
            status = 410
        elif behaviour.startswith("slow:"):
            time.sleep(int(behaviour[5:]) / 1000)
        elif behaviour.startswith("retry-after:"):
            status, extra = 429, {"Retry-After": behaviour[12:]}
        elif behaviour.startswith("throttle:"):
            with LOCK:
                since = THROTTLED_SINCE.setdefault(endpoint, time.time())
            left = since + float(behaviour[9:]) - time.time()
            if left > 0:
                status, extra = 429, {"Retry-After": str(math.ceil(left))}
        elif behaviour.startswith("chaos:"):
            status, extra, hold = chaos(behaviour[6:])
        entry = {
            "endpoint": endpoint,
            "id": headers.get("webhook-id"),
            "timestamp": headers.get("webhook-timestamp"),
            "signatures": len(headers.get("webhook-signature", "").split(" ")),
            "record": headers.get("outbox-record"),
            "sequence": headers.get("outbox-sequence"),
            "attempt": headers.get("outbox-attempt"),
            "status": status,
            "verifies": verifies,
            "tamper_refused": tamper_refused,
            "body": json.loads(body),
            "at": time.time(),
        }
        with LOCK, open(LOG, "a") as f:
            f.write(json.dumps(entry) + "\n")
        time.sleep(hold)
        reply = b'{"received": true}'
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog is 5: a burst of new connections (several workers'
    # deliveries side by side) overflowed it, and the senders' connects waited out a SYN retry.
    request_queue_size = 256

    def handle_error(self, request, client_address):
        pass  # a sender that gave up (a held answer) closed its end: not the receiver's fault


server = Server(("127.0.0.1", PORT), Receiver)
print(server.server_address[1], flush=True)
server.serve_forever()
