"""The engine-core process: three named threads joined by queues.

- `IPCLoop` receives commands from the front end's socket and sends events back to it;
- `EngineCoreLoop` schedules, runs the model and samples, and never waits on anything else;
- `OutputProcessor` detokenizes, applies stop strings and packages the deltas.

A stop string found by the output processor finishes its sequence in the core exactly like an
abort, so its blocks are freed. If the core loop raises, the process reports `dead` with the reason
and exits; the front end fails every in-flight request.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback

import zmq

from slotserve.config import EngineConfig
from slotserve.engine.engine_core import EngineCore
from slotserve.engine.output_processor import OutputProcessor
from slotserve.engine.serialization import CoreCommand, CoreEvent, decode_command, encode
from slotserve.model_store import resolve_model
from slotserve.tokenizer import Tokenizer

logger = logging.getLogger("slotserve")

# Test hook: the forward pass raises on its Nth call, to exercise the engine-death path.
FAIL_AT_ENV = "SLOTSERVE_TEST_FAIL_FORWARD_AT"


class InjectedFailure(RuntimeError):
    pass


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, log_level: str) -> None:
    """Entry point of the spawned process."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s engine-core: %(message)s",
                        datefmt="%H:%M:%S")
    ctx = zmq.Context()
    events = ctx.socket(zmq.PUSH)
    events.connect(output_address)
    try:
        path = resolve_model(config.model)
        tokenizer = Tokenizer.from_dir(path)
        core = EngineCore(config, path, tokenizer.eos_token_id)
    except Exception as e:  # load failures reach the front end as a reason, not a hang
        logger.exception("engine core failed to start")
        events.send(encode(CoreEvent("dead", message=f"{type(e).__name__}: {e}")))
        events.close(linger=2000)
        return
    _install_fail_hook(core)
    server = _CoreServer(ctx, core, OutputProcessor(tokenizer, delta=True), input_address, events)
    events.send(encode(CoreEvent("ready", max_model_len=core.max_model_len, vocab_size=core.vocab_size,
                                 hidden_size=core.model_config.hidden_size, task=core.task)))
    server.run()
    ctx.term()


def _install_fail_hook(core: EngineCore) -> None:
    fail_at = int(os.environ.get(FAIL_AT_ENV, "0"))
    if fail_at <= 0:
        return
    execute, calls = core.runner.execute, [0]

    def failing_execute(seqs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise InjectedFailure(f"{FAIL_AT_ENV}: forward pass {fail_at} fails on purpose")
        return execute(seqs)

    core.runner.execute = failing_execute


class _CoreServer:
    def __init__(self, ctx: zmq.Context, core: EngineCore, processor: OutputProcessor, input_address: str,
                 events: zmq.Socket) -> None:
        self.ctx, self.core, self.processor = ctx, core, processor
        self.input_address, self.events = input_address, events
        self.to_core: queue.Queue[CoreCommand] = queue.Queue()
        self.to_processor: queue.Queue[tuple[str, object]] = queue.Queue()
        self.outbox = "inproc://slotserve-outbox"
        self.stopping = threading.Event()

    def run(self) -> None:
        outbox_reader = self.ctx.socket(zmq.PULL)
        outbox_reader.bind(self.outbox)  # bound before the other threads connect to it
        threads = [threading.Thread(target=self._core_loop, name="EngineCoreLoop", daemon=True),
                   threading.Thread(target=self._output_loop, name="OutputProcessor", daemon=True)]
        for t in threads:
            t.start()
        threading.current_thread().name = "IPCLoop"
        self._ipc_loop(outbox_reader)
        for t in threads:
            t.join(timeout=5)

    # ---- IPCLoop: socket in, socket out --------------------------------------------------------

    def _ipc_loop(self, outbox_reader: zmq.Socket) -> None:
        commands = self.ctx.socket(zmq.PULL)
        commands.connect(self.input_address)
        poller = zmq.Poller()
        poller.register(commands, zmq.POLLIN)
        poller.register(outbox_reader, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(timeout=1000))
            if outbox_reader in ready:
                while True:  # forward everything the other threads produced
                    try:
                        data = outbox_reader.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if data == b"":  # the shutdown marker
                        commands.close(linger=0)
                        outbox_reader.close(linger=0)
                        self.events.close(linger=1000)
                        return
                    self.events.send(data)
            if commands in ready:
                while True:
                    try:
                        command = decode_command(commands.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    self._route(command)

    def _route(self, command: CoreCommand) -> None:
        if command.kind == "add":
            # The output processor learns of a request before the core can produce anything for it.
            self.to_processor.put(("add", command.request))
        elif command.kind == "abort":
            self.to_processor.put(("abort", command.request_ids))
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
                while True:
                    try:
                        commands.append(self.to_core.get_nowait())
                    except queue.Empty:
                        break
                if any(c.kind == "shutdown" for c in commands):
                    break
                for command in commands:
                    self._apply(command, outbox)
                if self.core.has_unfinished_requests():
                    outputs = self.core.step()
                    if outputs:
                        self.to_processor.put(("outputs", outputs))
        except Exception as e:
            logger.error("engine core loop died: %s\n%s", e, traceback.format_exc())
            # Through the output thread, so it reaches the front end before that thread's shutdown marker.
            self.to_processor.put(("event", encode(CoreEvent("dead", message=f"{type(e).__name__}: {e}"))))
        finally:
            self.to_processor.put(("shutdown", None))
            outbox.close(linger=1000)

    def _apply(self, command: CoreCommand, outbox: zmq.Socket) -> None:
        if command.kind == "add":
            for seq in command.request.sequences:
                try:
                    self.core.add_request(seq)
                except ValueError as e:
                    outbox.send(encode(CoreEvent("error", request_id=command.request.request_id, message=str(e))))
        elif command.kind in ("abort", "stop"):
            self.core.abort_requests(command.sequence_ids or [], reason="abort" if command.kind == "abort" else "stop")
        elif command.kind == "stats":
            outbox.send(encode(CoreEvent("stats", stats=self.core.stats(), token=command.token)))

    # ---- OutputProcessor: text, stop strings, deltas ----------------------------------------------

    def _output_loop(self) -> None:
        outbox = self.ctx.socket(zmq.PUSH)
        outbox.connect(self.outbox)
        while True:
            kind, payload = self.to_processor.get()
            if kind == "shutdown":
                outbox.send(b"")
                break
            if kind == "event":
                outbox.send(payload)
            elif kind == "add":
                self.processor.add_request(payload)
            elif kind == "abort":
                for request_id in payload:
                    self.processor.abort_request(request_id)
            else:
                processed = self.processor.process(payload)
                if processed.stopped:
                    self.to_core.put(CoreCommand("stop", sequence_ids=processed.stopped))
                if processed.request_outputs or processed.embeddings:
                    outbox.send(encode(CoreEvent("outputs", outputs=processed.request_outputs,
                                                 embeddings=processed.embeddings)))
        outbox.close(linger=1000)
