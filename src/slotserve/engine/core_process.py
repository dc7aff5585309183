"""The engine-core process: three named threads joined by queues.

- `IPCLoop` receives commands from the front end's socket and sends events back to it;
- `EngineCoreLoop` schedules, runs the model and samples, and never waits on anything else;
- `OutputProcessor` detokenizes, applies stop strings and packages the deltas.

A stop string found by the output processor finishes its sequence in the core exactly like an
abort, so its blocks are freed. An exception in any of the three threads ends the process: it
reports `dead` with the reason and exits with code 1, and the front end fails every in-flight
request. The process also exits when the front end that started it is gone (it polls its parent), unless it
runs as a Ray actor, whose end Ray ties to the front end's.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from slotserve import faults
from slotserve.config import EngineConfig
from slotserve.engine import diagnostics
from slotserve.engine.diagnostics import ThreadSampler, Watchdog
from slotserve.engine.engine_core import EngineCore
from slotserve.engine.executor import WorkerError
from slotserve.engine.output_processor import OutputProcessor
from slotserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    CoreCommand,
    Dead,
    Debug,
    EngineCoreOutput,
    GetDebug,
    GetStats,
    Outputs,
    Ready,
    RequestFailed,
    Shutdown,
    Stats,
    decode_command,
    encode,
)
from slotserve.faults import FaultPoint
from slotserve.model_store import resolve_model
from slotserve.tokenizer import Tokenizer

logger = logging.getLogger("slotserve")

# How often the IPC loop looks up from its sockets: for a dead thread or a dead front end.
_POLL_MS = 200


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, log_level: str,
                    watch_parent: bool = True) -> None:
    """Entry point of the spawned process (or of a Ray actor, `watch_parent` False)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s engine-core: %(message)s",
                        datefmt="%H:%M:%S")
    # Ctrl-C reaches the whole process group; the front end decides how the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid() if watch_parent else None
    ctx = zmq.Context()
    # The events socket has a context of its own, so a dying process can wait for its last event to leave
    # without waiting for the other threads' sockets.
    events_ctx = zmq.Context()
    events = events_ctx.socket(zmq.PUSH)
    events.connect(output_address)
    try:
        path = resolve_model(config.model)
        tokenizer = Tokenizer.from_dir(path)
        core = EngineCore(config, path, tokenizer.eos_token_id)
    except Exception as e:  # load failures reach the front end as a reason, not a hang
        logger.exception("engine core failed to start")
        events.send(encode(Dead(f"{type(e).__name__}: {e}")))
        events.close(linger=2000)
        events_ctx.term()
        return
    server = _CoreServer(ctx, core, OutputProcessor(tokenizer, delta=True), input_address, events, parent,
                         config.stall_timeout)
    events.send(encode(Ready(core.max_model_len, core.vocab_size, core.model_config.hidden_size, core.task,
                             str(core.disk.dir) if core.disk is not None else None)))
    clean = server.run()
    core.shutdown(kill=not clean)  # the model's other ranks, where it has any
    events_ctx.term()  # sends what is queued, up to the socket's linger
    if not clean:
        os._exit(1)  # a thread may still be inside the model: do not wait for it
    ctx.term()


@dataclass
class StopSequences:
    """Output processor -> core loop: these sequences met a stop string; they end as "stop"."""

    sequence_ids: list[str]


# What the output processor takes: a request to follow, aborts, a refused request, or a step's outputs.
ProcessorTask = AddRequest | AbortRequests | RequestFailed | list[EngineCoreOutput] | Shutdown


class _CoreServer:
    def __init__(self, ctx: zmq.Context, core: EngineCore, processor: OutputProcessor, input_address: str,
                 events: zmq.Socket, parent_pid: int | None, stall_timeout: float) -> None:
        self.ctx, self.core, self.processor = ctx, core, processor
        self.input_address, self.events, self.parent_pid = input_address, events, parent_pid
        self.to_core: queue.Queue[CoreCommand | StopSequences] = queue.Queue()
        self.to_processor: queue.Queue[ProcessorTask] = queue.Queue()
        self.outbox = "inproc://slotserve-outbox"
        self.fatal: str | None = None  # why a thread died; set once
        self._fatal_lock = threading.Lock()
        self.threads = ThreadSampler()  # each thread's CPU share, sampled by the IPC loop once a second
        self.watchdog = Watchdog(stall_timeout)
        self._next_sample = 0.0
        core.on_thread_death = self._die

    def run(self) -> bool:
        """Serves until shutdown (True), or until a thread dies or the front end is gone (False)."""
        outbox_reader = self.ctx.socket(zmq.PULL)
        outbox_reader.bind(self.outbox)  # bound before the other threads connect to it
        threads = [self._thread("EngineCoreLoop", self._core_loop), self._thread("OutputProcessor", self._output_loop)]
        for t in threads:
            t.start()
        threading.current_thread().name = "IPCLoop"
        try:
            clean = self._ipc_loop(outbox_reader)
        except Exception as e:
            self._die("IPCLoop", e)
            clean = False
        if self.fatal is not None:
            self.events.send(encode(Dead(self.fatal)))
            clean = False
        self.events.close(linger=2000)
        if clean:
            for t in threads:
                t.join(timeout=5)
        return clean

    def _thread(self, name: str, body: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                body()
            except Exception as e:
                self._die(name, e)

        return threading.Thread(target=guarded, name=name, daemon=True)

    def _die(self, thread: str, e: BaseException) -> None:
        """Any thread's exception ends the engine: the IPC loop sees `fatal`, reports it and exits."""
        logger.error("%s died: %s\n%s", thread, e, "".join(traceback.format_exception(e)))
        with self._fatal_lock:
            if self.fatal is None:
                self.fatal = f"{thread} died: {type(e).__name__}: {e}"
        self.to_core.put(Shutdown())
        self.to_processor.put(Shutdown())

    # ---- IPCLoop: socket in, socket out --------------------------------------------------------

    def _ipc_loop(self, outbox_reader: zmq.Socket) -> bool:
        """True after a clean shutdown, False when it stopped because something else ended."""
        commands = self.ctx.socket(zmq.PULL)
        commands.connect(self.input_address)
        poller = zmq.Poller()
        poller.register(commands, zmq.POLLIN)
        poller.register(outbox_reader, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(timeout=_POLL_MS))
                if self.fatal is not None:
                    return False
                if time.monotonic() >= self._next_sample:
                    self._next_sample = time.monotonic() + 1.0
                    self._sample()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("the front end (pid %d) is gone; the engine core exits", self.parent_pid)
                    return False
                if (failure := self.core.worker_failure()) is not None:
                    self._die("the model's worker ranks", WorkerError(failure))
                    return False
                if outbox_reader in ready:
                    while True:  # forward everything the other threads produced
                        try:
                            data = outbox_reader.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if data == b"":  # the shutdown marker
                            return True
                        self.events.send(data)
                if commands in ready:
                    while True:
                        try:
                            command = decode_command(commands.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        faults.check(FaultPoint.IPC)
                        self._route(command)
        finally:
            commands.close(linger=0)
            outbox_reader.close(linger=0)

    def _sample(self) -> None:
        """Once a second: the threads' CPU shares, and the watchdog's look at the core loop."""
        self.threads.sample()
        busy = self.core.has_unfinished_requests() or not self.to_core.empty()
        if self.watchdog.check(busy, time.monotonic() - self.core.step_log.last_end):
            logger.error("EngineCoreLoop has had work for %.0f s without finishing a step (--stall-timeout): it may "
                         "be stuck\n%s", self.watchdog.limit_s, diagnostics.report(self.snapshot()))

    def snapshot(self) -> dict:
        """What /debug/engine shows of this process; taken by the IPC loop, so it answers while the core is stuck."""
        core, kv = self.core, self.core.kv
        return {
            "pid": os.getpid(),
            "threads": diagnostics.threads(self.threads),
            "queues": {"input": self.to_core.qsize(), "output_processor": self.to_processor.qsize()},
            "scheduler": {"running": len(core.scheduler.running), "waiting": len(core.scheduler.waiting),
                          "preemptions": core.scheduler.num_preemptions, "kv_blocks": kv.pool.num_blocks,
                          "kv_blocks_free": kv.pool.num_free, "kv_blocks_cached": kv.pool.num_cached},
            "prefix_cache": {"queried_tokens": kv.stats.queried_tokens, "hit_tokens": kv.stats.hit_tokens,
                             "memory_hit_tokens": kv.stats.hit_tokens - kv.stats.disk_hit_tokens,
                             "disk_hit_tokens": kv.stats.disk_hit_tokens,
                             "tiers": ["memory"] + (["disk"] if kv.disk is not None else []),
                             "disk": kv.disk.snapshot() if kv.disk is not None else None,
                             "saves_in_flight": len(core.saves.pending)},
            "speculative": None if core.config.speculative_config is None else {
                "method": core.config.speculative_config.method.value,
                "num_speculative_tokens": core.config.speculative_config.num_speculative_tokens,
                "proposed": core.speculation.proposed, "accepted": core.speculation.accepted,
                "acceptance_rate": round(core.speculation.acceptance_rate, 4),
                "mean_accepted_length": round(core.speculation.mean_accepted_length, 3)},
            "steps": core.step_log.recent(),
            "step_histograms": core.step_log.histograms(),
            "seconds_since_last_step": round(time.monotonic() - core.step_log.last_end, 3),
            "watchdog": {"stall_timeout": self.watchdog.limit_s, "stalled_since": self.watchdog.stalled_since,
                         "stalls": self.watchdog.reports},
        }

    def _route(self, command: CoreCommand) -> None:
        if isinstance(command, GetDebug):  # answered here, not by the core loop, which may be the one stuck
            self.events.send(encode(Debug(command.token, self.snapshot())))
            return
        if isinstance(command, AddRequest | AbortRequests):
            # The output processor learns of a request before the core can produce anything for it.
            self.to_processor.put(command)
        self.to_core.put(command)

    # ---- EngineCoreLoop: schedule, run, sample --------------------------------------------------

    def _core_loop(self) -> None:
        outbox = self.ctx.socket(zmq.PUSH)
        outbox.connect(self.outbox)
        try:
            while True:
                # Drain every pending command in bulk, so a flood of aborts costs one pass, not one
                # step each; block only when there is nothing to run.
                block = not self.core.has_unfinished_requests()
                commands = [self.to_core.get()] if block else []
                if block:
                    self.core.step_log.woke()  # idle time is not a stall
                while True:
                    try:
                        commands.append(self.to_core.get_nowait())
                    except queue.Empty:
                        break
                if any(isinstance(c, Shutdown) for c in commands):
                    break
                for command in commands:
                    self._apply(command, outbox)
                if self.core.has_unfinished_requests():
                    faults.check(FaultPoint.CORE_STEP)
                    if faults.fires(FaultPoint.CORE_STALL):  # a test's: a step that hangs for a while
                        time.sleep(faults.STALL_SECONDS)
                    outputs = self.core.step()
                    if outputs:
                        self.to_processor.put(outputs)
            self.to_processor.put(Shutdown())  # after the outputs before it: a clean stop
        finally:
            outbox.close(linger=1000)

    def _apply(self, command: CoreCommand | StopSequences, outbox: zmq.Socket) -> None:
        if isinstance(command, AddRequest):
            added = []
            try:
                for seq in command.request.sequences:
                    self.core.add_request(seq)
                    added.append(seq.request_id)
            except ValueError as e:  # all of the request's sequences or none; the processor forgets it
                self.core.abort_requests(added)
                self.to_processor.put(RequestFailed(command.request.request_id, str(e)))
        elif isinstance(command, AbortRequests):
            self.core.abort_requests(command.sequence_ids, reason="abort")
        elif isinstance(command, StopSequences):
            self.core.abort_requests(command.sequence_ids, reason="stop")
        elif isinstance(command, GetStats):
            outbox.send(encode(Stats(command.token, self.core.stats())))

    # ---- OutputProcessor: text, stop strings, deltas ----------------------------------------------

    def _output_loop(self) -> None:
        outbox = self.ctx.socket(zmq.PUSH)
        outbox.connect(self.outbox)
        try:
            while True:
                task = self.to_processor.get()
                if isinstance(task, Shutdown):
                    if self.fatal is None:
                        outbox.send(b"")
                    break
                if isinstance(task, AddRequest):
                    self.processor.add_request(task.request)
                elif isinstance(task, AbortRequests):
                    for request_id in task.request_ids:
                        self.processor.abort_request(request_id)
                elif isinstance(task, RequestFailed):
                    self.processor.abort_request(task.request_id)
                    outbox.send(encode(task))
                else:
                    faults.check(FaultPoint.OUTPUT)
                    processed = self.processor.process(task)
                    if processed.stopped:
                        self.to_core.put(StopSequences(processed.stopped))
                    if processed.request_outputs or processed.embeddings:
                        outbox.send(encode(Outputs(processed.request_outputs, processed.embeddings)))
        finally:
            outbox.close(linger=1000)
