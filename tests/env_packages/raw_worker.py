"""A worker written straight to rollwise's JSON-lines protocol that answers with garbage (tests only):
mode `bad_reward` (a reward that is not a number), `huge` (a reply line over the size limit)."""

import json
import sys

mode = sys.argv[1]
out = sys.stdout
out.write(json.dumps({"type": "hello", "ok": True, "train_size": 1, "eval_size": 1}) + "\n")
out.flush()
for line in sys.stdin:
    req = json.loads(line)
    if req["type"] == "ping":
        out.write(json.dumps({"type": "pong", "id": req["id"]}) + "\n")
    elif mode == "bad_reward":
        out.write(json.dumps({"type": "result", "id": req["id"], "ok": True, "reward": "lots"}) + "\n")
    elif mode == "huge":
        out.write(json.dumps({"type": "result", "id": req["id"], "ok": True, "reward": 1.0,
                              "final_text": "x" * (2 << 20)}) + "\n")
    out.flush()
