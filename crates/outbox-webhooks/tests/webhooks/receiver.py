"""The webhook tests' receiver: every delivery is checked with the official Standard Webhooks
verifier (PyPI's `standardwebhooks`, `Webhook(secret).verify(body, headers)`), code no one in
this repository wrote.

Usage: receiver.py CONTROL LOG. It listens on a free port of 127.0.0.1 and prints it. For each
POST to /<endpoint> it re-reads CONTROL (JSON: "secrets": {endpoint: [secret, ...]},
"behaviour": {endpoint: "ok" | "fail" | "gone" | "slow:<ms>" | "retry-after:<s>"},
"fail_records": {endpoint: [record key, ...]}), answers as told, and appends one JSON line to
LOG: the endpoint, the headers it relies on, the status it answered, and per secret whether the
signature verified, plus whether a body changed by one byte was refused.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

CONTROL, LOG = sys.argv[1], sys.argv[2]
LOCK = threading.Lock()


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
        status, extra = 200, {}
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
        reply = b'{"received": true}'
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
server.daemon_threads = True
print(server.server_address[1], flush=True)
server.serve_forever()
