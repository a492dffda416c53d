"""A worker written straight to rollwise's JSON-lines protocol that answers with garbage (tests only):
mode `bad_reward` (a reward that is not a number), `huge` (a reply line over the size limit), `by_index` (row 0:
reward 1.0 with the worker's pid as a metric, row 1: the process exits, row 2: it hangs, answering nothing)."""

import json
import os
import sys
import time

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
    elif mode == "by_index" and req["index"] == 1:
        os._exit(3)
    elif mode == "by_index" and req["index"] == 2:
        time.sleep(3600)
    elif mode == "by_index":
        out.write(json.dumps({"type": "result", "id": req["id"], "ok": True, "reward": 1.0,
                              "metrics": {"pid": os.getpid()}}) + "\n")
    elif mode == "huge":
        out.write(json.dumps({"type": "result", "id": req["id"], "ok": True, "reward": 1.0,
                              "final_text": "x" * (2 << 20)}) + "\n")
    out.flush()
