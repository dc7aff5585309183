"""`slotserve top`: a running server's engine at a glance, refreshed each second, like `top -H` for its threads:
each thread's CPU share and the function it is in (with what that usually means), the queues, the scheduler,
and the recent step times as a sparkline. It reads `GET /debug/engine` (torch-free, so it starts at once)."""

from __future__ import annotations

import argparse
import sys
import time

import httpx

SPARKS = "▁▂▃▄▅▆▇█"
# (thread, a frame that says where it is) -> what that usually means (docs/troubleshooting.md).
HINTS = (
    ("EngineCoreLoop", ("forward", "execute", "_run"), "in the model: compute-bound"),
    ("EngineCoreLoop", ("schedule", "allocate", "cached_prefix"), "scheduling: many sequences or few free blocks"),
    ("EngineCoreLoop", ("get", "wait"), "waiting for requests: idle"),
    ("OutputProcessor", ("process", "update", "decode"), "detokenizing"),
    ("OutputProcessor", ("get", "wait"), "waiting for outputs"),
    ("IPCLoop", ("send",), "sending results: large outputs or a slow front end"),
    ("IPCLoop", ("poll",), "waiting on its sockets"),
    ("IPCLoop", ("snapshot", "threads"), "taking this view"),
)
_STDLIB_WAITS = ("threading.py", "queue.py", "selectors.py", "socket.py")


def where(stack: list[str]) -> str:
    """The innermost frame of the thread's own code, and the library call it is waiting in, if any."""
    if not stack:
        return "?"
    own = next((f for f in reversed(stack) if f.split(":")[0] not in _STDLIB_WAITS), stack[-1])
    return own if own == stack[-1] else f"{own} > {stack[-1].rsplit(' ', 1)[-1]}"


def hint(thread: str, stack: list[str]) -> str:
    """What a thread's innermost frames usually mean, where they match a known pattern."""
    functions = [frame.rsplit(" ", 1)[-1] for frame in stack[-4:]]
    for name, markers, meaning in HINTS:
        if thread == name and any(any(m in f for m in markers) for f in functions):
            return meaning
    return ""


def sparkline(values: list[float], width: int = 48) -> str:
    values = values[-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] for v in values)


def render(snapshot: dict, url: str) -> str:
    engine = snapshot["engine"]
    if "error" in engine:
        return f"slotserve top - {url}\nengine: {engine['error']}\n"
    lines = [f"slotserve top - {url} - engine pid {engine['pid']}, front end pid {snapshot['front_end']['pid']}", ""]
    lines.append(f"{'THREAD':18} {'CPU':>5}  {'WHERE':44} HINT")
    for t in engine["threads"]:
        share = "" if t["cpu_share"] is None else f"{100 * t['cpu_share']:.0f}%"
        lines.append(f"{t['name'][:18]:18} {share:>5}  {where(t['stack'])[:44]:44} {hint(t['name'], t['stack'])}")
    q, s = engine["queues"], engine["scheduler"]
    lines += ["", f"queues: input {q['input']}, output processor {q['output_processor']}",
              f"scheduler: {s['running']} running, {s['waiting']} waiting, {s['preemptions']} preemptions; KV blocks "
              f"{s['kv_blocks'] - s['kv_blocks_free']} used, {s['kv_blocks_free']} free, {s['kv_blocks_cached']} "
              "cached"]
    steps = engine["steps"]
    if steps:
        last = steps[-1]
        lines.append(f"steps: {sparkline([x['seconds'] for x in steps])}  last {1000 * last['seconds']:.1f} ms "
                     f"(model {1000 * last['model_seconds']:.1f}, schedule {1000 * last['schedule_seconds']:.1f}, "
                     f"sample {1000 * last['sample_seconds']:.1f}), {last['sequences']} seqs, {last['tokens']} tokens")
    watchdog = engine["watchdog"]
    if watchdog["stalled_since"] is not None:
        lines.append(f"STALLED: no step for {engine['seconds_since_last_step']:.0f} s with work queued")
    return "\n".join(lines) + "\n"


def run_top(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    while True:
        try:
            response = httpx.get(f"{url}/debug/engine", headers=headers, timeout=10)
        except httpx.HTTPError as e:
            print(f"slotserve top: cannot reach {url} ({type(e).__name__})", file=sys.stderr)
            return 1
        if response.status_code != 200:
            print(f"slotserve top: {url}/debug/engine answered {response.status_code} (is the server started with "
                  "--debug-endpoints on, or --api-key needed?)", file=sys.stderr)
            return 1
        frame = render(response.json(), url)
        if args.once:
            sys.stdout.write(frame)
            return 0
        sys.stdout.write("\x1b[H\x1b[2J" + frame)  # home, clear
        sys.stdout.flush()
        time.sleep(args.interval)
